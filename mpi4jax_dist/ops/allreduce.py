"""``mpi4jax_dist.allreduce``: the public function, its checks before any MPI call,
and the bind of its primitive (ops/allreduce_primitive.py, imported on the first
call: it imports mpi4jax)."""

from __future__ import annotations

from .. import _compat
from .common import (
    OPS,
    Comm,
    call_site,
    check_mpi,
    check_supported,
    communicator,
    op_name,
)


def allreduce(x, op=None, *, comm=None, site=None):
    """Reduce ``x`` over the ranks of ``comm``, in place where XLA allows it.

    Where ``mpi4jax.allreduce`` returns a new buffer, this one's operand and
    result alias: under ``jax.jit(f, donate_argnums=...)``, or on an intermediate
    inside a ``jit``, XLA gives the handler one buffer and MPI reduces it in place
    (``MPI_IN_PLACE``), so a message of N bytes needs N bytes, not 2N. Without
    donation (eagerly, or on a jit argument still alive) XLA first copies the
    input into the result's buffer, as it would for any op, and MPI reduces that
    in place; were XLA ever to hand over two buffers, the handler would copy and
    reduce in place just the same (MPI asks for ``MPI_IN_PLACE`` on all ranks or
    none).

    On a CUDA GPU the device buffer is reduced where it is: by a CUDA-aware MPI
    (``MPI4JAX_DIST_CUDA_AWARE_MPI=1``, see
    :func:`mpi4jax_dist._config.cuda_aware_mpi`), or by default through a pinned
    host buffer (``MPI4JAX_DIST_STAGING_BYTES``, default 64 MiB, see
    :func:`mpi4jax_dist._config.staging_bytes`), so that device memory holds one
    message and host memory that buffer.

    Any element count works, above 2**31 included. The reduction runs in chunks
    of ``MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES`` (default 64 MiB; 0 for one call,
    see :func:`mpi4jax_dist._config.allreduce_chunk_bytes`), which bounds MPI's
    scratch memory.

    Every call is checked against the other ranks' calls before it returns a
    value: a header saying what the call is (blocking or not, op, dtype,
    element count, its number on the communicator, the source line it was made
    at) travels with the data, in one message up to 16 KiB and beside it above.
    Ranks that disagree fail alike, with one report naming each side and where
    it was made (``MPI4JAX_DIST_CHECKS=0`` leaves the header out). Calls meant
    to match from different lines (an allreduce in each branch of a
    ``lax.cond`` on the rank) take one ``site`` name.

    Calls keep program order on every rank: they share mpi4jax's ordered effect,
    so mpi4jax's calls and these are ordered together. Usable eagerly, in
    ``jit``, ``lax.fori_loop``/``while_loop``/``scan``, under ``vmap``, and under
    ``grad``/``jvp`` for ``MPI.SUM`` with mpi4jax's rules (the transpose of the
    allreduce is the identity). MPI must let any thread call it: XLA calls the
    handler from its worker threads. ``MPI_THREAD_MULTIPLE`` (mpi4py's default)
    or ``MPI_THREAD_SERIALIZED`` (Cray MPICH's where ``MPICH_MAX_THREAD_SAFETY``
    is unset), where the extension's MPI calls hold one process-wide lock: your
    own mpi4py calls must then not overlap a running jitted program.

    Args:
        x: array or scalar: float32/64, complex64/128, (u)int8/16/32/64, or bool
            for the logical ops.
        op: an ``mpi4py.MPI.Op``: ``MPI.SUM`` (the default, also for None),
            ``PROD``, ``MIN``, ``MAX``, ``LAND``, ``LOR``, ``LXOR``, ``BAND``,
            ``BOR`` or ``BXOR``, where MPI defines it for the dtype.
        comm: an mpi4py intracommunicator; default: ``MPI.COMM_WORLD``. The
            calls run on a private duplicate of it, so that they never meet
            the program's own MPI calls on it.
        site: a name the ranks compare in place of the call's source line, for
            calls made at different lines that are meant to match, such as an
            allreduce in each branch of a ``lax.cond`` on the rank: give each
            the same name (``site="halo"``). Default: the source line, so that
            a call matched with one from another line fails.

    Returns:
        The reduced array, of the shape and dtype of ``x``.

    Raises:
        TypeError: a dtype, op or communicator MPI cannot reduce with, or a
            ``site`` that is not a str, before any MPI call.
        ValueError: ``comm`` is ``MPI.COMM_NULL`` (a rank in no group of a
            ``Split``, or a freed communicator), or ``site`` is empty.
        NotImplementedError: differentiated with an op other than ``MPI.SUM``,
            or (when compiled) on a platform without a handler: no fallback to
            the CPU (on AMD or Intel GPUs use ``mpi4jax.allreduce`` or
            ``lax.psum`` in ``shard_map``).
        RuntimeError: MPI is not initialized, or provides less than
            ``MPI_THREAD_SERIALIZED``; (on a CUDA GPU) CUDA-aware MPI asked for
            from an MPI that cannot read device memory, or cannot say: runtime
            conditions, quoted in docs/troubleshooting.rst.
        ImportError: mpi4jax is not installed (a ``ModuleNotFoundError`` naming
            the ``mpi4jax`` extra), or the extension was built against another
            MPI than mpi4py's, or (on a CUDA GPU, when compiled) without CUDA,
            or against a CUDA that this node's driver or JAX's CUDA plugin does
            not match (docs/troubleshooting.rst).

    Messages:
        .. code-block:: text

            TypeError: mpi4jax_dist.allreduce cannot reduce <dtype> arrays:
            MPI has no standard <dtype> type. Supported dtypes: <dtypes>
            (bool with MPI.LAND, MPI.LOR and MPI.LXOR only). Cast first, for
            example x.astype(jnp.float32).

            TypeError: mpi4jax_dist.allreduce cannot reduce <dtype> with
            MPI.<op>: MPI reduces <dtype> with <ops> only (or cast to an
            integer type).

            TypeError: mpi4jax_dist.allreduce: op must be one of <ops>; got
            <op>. User-defined ops and MPI.MAXLOC/MINLOC/REPLACE/NO_OP are
            not supported.

            TypeError: mpi4jax_dist.allreduce: comm must be an mpi4py
            intracommunicator (MPI.Intracomm, such as MPI.COMM_WORLD or a
            Split of it); got <type>.

            TypeError: <function>: site must be a str, a name the ranks
            compare in place of the call's source line (the same on every
            rank for the calls meant to match), or None; got <type>.

            ValueError: mpi4jax_dist.allreduce: comm is MPI.COMM_NULL: a
            communicator freed (comm.Free()), or a Split of which this rank
            is in no group. Call with a live communicator (after a Split, on
            the group's members only).

            ValueError: mpi4jax_dist.allreduce: comm has been freed
            (comm.Free()) since an earlier call was given it: it is
            MPI.COMM_NULL now. Call with a live communicator.

            ValueError: <function>: site must be a non-empty name; got
            <site>. Give the calls meant to match one name on every rank, or
            leave site out to compare the source line.

            NotImplementedError: mpi4jax_dist.allreduce is differentiable
            for MPI.SUM only; got MPI.<op>.

            NotImplementedError: the transpose of mpi4jax_dist.allreduce is
            defined for MPI.SUM only; got MPI.<op>.

            NotImplementedError: <mpi4jax_dist.allreduce |
            mpi4jax_dist.iallreduce (and Request.test and Request.wait)>
            runs on <CPU and CUDA | CPU> only: it has no handler for the
            <platform> platform, and does not fall back to the CPU. <what
            runs there>
    """
    import jax.numpy as jnp

    # Its ordered effect is mpi4jax's.
    _compat.require_mpi4jax("mpi4jax_dist.allreduce")
    site = call_site(site)
    x = jnp.asarray(x)
    check_supported(x.dtype)  # before op_name, which may import mpi4py.MPI
    name = op_name(op)
    check_supported(x.dtype, name)
    check_mpi()
    comm = Comm(communicator(comm))
    from .allreduce_primitive import allreduce_p

    return allreduce_p.bind(
        x, op=OPS.index(name), comm=comm, transpose=False, site=site
    )
