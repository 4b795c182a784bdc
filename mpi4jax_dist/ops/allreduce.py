"""``mpi4jax_dist.allreduce``: the primitive, its public function, its lowering to
the CPU and CUDA handlers (operand aliased to result: reduced in place), and its
batching and differentiation rules (docs/design.rst, *The in-place allreduce*)."""

from __future__ import annotations

import functools

import numpy as np

from .. import _compat, _config
from .common import (
    OPS,
    Comm,
    caller_site,
    check_mpi,
    check_supported,
    communicator,
    extension,
    op_name,
    ordering,
    unsupported_lowering,
)


def allreduce(x, op=None, *, comm=None):
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
    element count, its number on the communicator) travels with the data, in
    one message up to 16 KiB and beside it above. Ranks that disagree fail
    alike, with one report naming each side and where it was made
    (``MPI4JAX_DIST_CHECKS=0`` leaves the header out).

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

    Returns:
        The reduced array, of the shape and dtype of ``x``.

    Raises:
        TypeError: a dtype, op or communicator MPI cannot reduce with, before any
            MPI call.
        ValueError: ``comm`` is ``MPI.COMM_NULL`` (a rank in no group of a
            ``Split``).
        RuntimeError: MPI is not initialized, or provides less than
            ``MPI_THREAD_SERIALIZED`` (the message names
            ``MPICH_MAX_THREAD_SAFETY``).
        ImportError: mpi4jax is not installed (a ``ModuleNotFoundError`` naming
            the ``mpi4jax`` extra), or the extension was built against another
            MPI than mpi4py's, or (on a CUDA GPU, when compiled) without CUDA,
            or against a CUDA that this node's driver or JAX's CUDA plugin does
            not match.
        RuntimeError: (on a CUDA GPU, when compiled) CUDA-aware MPI asked for
            from an MPI that says it cannot read device memory, or cannot say
            (unless ``MPI4JAX_DIST_CUDA_AWARE_MPI=force``).
    """
    import jax.numpy as jnp

    # Its ordered effect and default communicator are mpi4jax's.
    _compat.require_mpi4jax("mpi4jax_dist.allreduce")
    x = jnp.asarray(x)
    check_supported(x.dtype)  # before op_name, which may import mpi4py.MPI
    name = op_name(op)
    check_supported(x.dtype, name)
    check_mpi()
    comm = Comm(communicator(comm))
    return _primitive().bind(
        x, op=OPS.index(name), comm=comm, transpose=False, site=caller_site()
    )


def _cuda_aware(module) -> bool:
    """Return whether the CUDA handler hands MPI device memory (see
    :func:`mpi4jax_dist._config.cuda_aware_mpi`): only when asked, and only to an
    MPI that says it reads device memory, or that cannot say and is trusted by
    name (``force``).

    Raises:
        RuntimeError: CUDA-aware MPI asked for, and the MPI says it cannot read
            device memory, or cannot say and the setting is not ``force``.
    """
    setting = _config.cuda_aware_mpi()
    if setting == "off":
        return False
    support = module.mpi_cuda_support()
    if support is True or (support is None and setting == "force"):
        return True
    from mpi4py import MPI

    library = " ".join(MPI.Get_library_version().split()[:4])
    asked = _config.cuda_aware_source()
    if support is False:
        raise RuntimeError(
            f"mpi4jax_dist.allreduce was told that MPI reads device memory "
            f"({asked}), but this MPI ({library}) says it cannot "
            f"(MPIX_Query_cuda_support() is 0); it would crash on a device "
            f"pointer. Unset {_config.CUDA_AWARE_MPI} and "
            f"{_config.MPI4JAX_CUDA_AWARE_MPI}, or set {_config.CUDA_AWARE_MPI}=0, "
            f"to stage through host memory, or use an MPI built with CUDA support."
        )
    raise RuntimeError(
        f"mpi4jax_dist.allreduce was told that MPI reads device memory ({asked}), "
        f"but this MPI ({library}) cannot say whether it does (no "
        f"MPIX_Query_cuda_support: Open MPI without its CUDA extension, Intel MPI, "
        f"MPICH before 4.1), and an MPI without CUDA support crashes or reads "
        f"garbage on a device pointer. Set {_config.CUDA_AWARE_MPI}=force if you "
        f"know this MPI was built with CUDA support, or "
        f"{_config.CUDA_AWARE_MPI}=0 to stage through host memory (works with "
        f"every MPI)."
    )


@functools.cache
def _primitive():
    """Make the primitive and its rules (first call only: imports mpi4jax)."""
    import jax
    from jax.core import ShapedArray
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    from .. import _ffi

    ordered_effect, abstract_token = ordering()

    prim = Primitive("mpi4jax_dist_allreduce")

    @functools.cache
    def jitted(op, comm, transpose, site):
        return jax.jit(
            lambda x: prim.bind(x, op=op, comm=comm, transpose=transpose, site=site)
        )

    def impl(x, *, op, comm, transpose, site):
        return jitted(op, comm, transpose, site)(x)

    def abstract_eval(x, *, op, comm, transpose, site):
        out = ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
        # The transposed allreduce is the identity (as in mpi4jax): no MPI call,
        # nothing to order.
        return out, (set() if transpose else {ordered_effect})

    def lowering(ctx, x, *, op, comm, transpose, site, platform="cpu"):
        if transpose:
            return [x]
        module = extension(platform)
        attributes = {
            "comm": np.int64(comm.id_in(module)),
            "op": np.int32(op),
            "chunk_bytes": np.int64(_config.allreduce_chunk_bytes()),
            "check": np.int32(_config.checks()),
            "site": np.int64(module.register_site(site)),
        }
        if platform == "cuda":
            attributes["cuda_aware"] = np.int32(_cuda_aware(module))
        token = ctx.tokens_in.get(ordered_effect)
        (result,) = jax.ffi.ffi_lowering(
            _ffi.ALLREDUCE_TARGET,
            operand_output_aliases={0: 0},
            has_side_effect=True,
        )(ctx.replace(avals_in=(*ctx.avals_in, abstract_token)), x, token, **attributes)
        # The next MPI call waits for a token made from the result, not for a
        # second result of the allreduce: an (array, token) result is a tuple,
        # whose index table XLA allocates as temp memory.
        (token,) = jax.ffi.ffi_lowering(_ffi.TOKEN_AFTER_TARGET)(
            ctx.replace(avals_in=ctx.avals_out, avals_out=(abstract_token,)),
            result,
        )
        ctx.set_tokens_out(mlir.TokenSet({ordered_effect: token}))
        return [result]

    refuse = unsupported_lowering("mpi4jax_dist.allreduce", ("cpu", "cuda"))

    def other_lowering(ctx, x, *, op, comm, transpose, site):
        if transpose:  # the transpose of the allreduce is the identity
            return [x]
        return refuse(ctx)

    def batching_rule(args, dims, **params):
        # Elementwise over ranks: the batch dimension stays where it is.
        return prim.bind(args[0], **params), dims[0]

    def jvp(primals, tangents, *, op, comm, transpose, site):
        if OPS[op] != "SUM":
            raise NotImplementedError(
                f"mpi4jax_dist.allreduce is differentiable for MPI.SUM only; got "
                f"MPI.{OPS[op]}."
            )
        (x,), (t,) = primals, tangents
        params = dict(op=op, comm=comm, transpose=transpose, site=site)
        return prim.bind(x, **params), prim.bind(t, **params)

    def transpose_rule(cotangent, x, *, op, comm, transpose, site):
        if OPS[op] != "SUM":
            raise NotImplementedError(
                f"the transpose of mpi4jax_dist.allreduce is defined for MPI.SUM "
                f"only; got MPI.{OPS[op]}."
            )
        cotangent = ad.instantiate_zeros(cotangent)
        return (
            prim.bind(cotangent, op=op, comm=comm, transpose=not transpose, site=site),
        )

    prim.def_impl(impl)
    prim.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lowering, platform="cpu")
    try:
        mlir.register_lowering(
            prim, functools.partial(lowering, platform="cuda"), platform="cuda"
        )
    except NotImplementedError:  # JAX's CUDA plugin is not installed
        pass
    # Every other platform (rocm, oneapi, tpu, ...): a clear error when lowered,
    # never a CPU fallback.
    mlir.register_lowering(prim, other_lowering)
    batching.primitive_batchers[prim] = batching_rule
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose_rule
    return prim
