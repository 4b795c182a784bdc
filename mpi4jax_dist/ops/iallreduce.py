"""``mpi4jax_dist.iallreduce``: a non-blocking allreduce for jitted code, on the
CPU. The start checks what it is given before any MPI call, binds the start's
primitive (ops/iallreduce_primitives.py, imported on the first start: it imports
mpi4jax) and returns a :class:`~mpi4jax_dist.Request` (ops/request.py), whose
life ops/lifecycle.py follows. What runs when and what is caught: docs/design.rst,
*The non-blocking allreduce*.
"""

from __future__ import annotations

from .. import _compat
from . import common, lifecycle
from .request import Request, is_traced

_WHO = lifecycle.WHO


def iallreduce(x, op=None, *, comm=None, site=None) -> Request:
    """Start reducing ``x`` over the ranks of ``comm`` without waiting: post
    ``MPI_Iallreduce`` on a copy of ``x`` the extension owns and return a
    :class:`Request` at once.

    Complete it with :meth:`Request.wait` in the same function, on every path; put
    the work to overlap between the two with :meth:`Request.overlap` (and
    :meth:`Request.test` for MPI progress). docs/design.rst says what runs
    when, and what is caught.

    Args:
        x, op, comm: as for :func:`mpi4jax_dist.allreduce`.
        site: as for :func:`mpi4jax_dist.allreduce`: a name the ranks compare in
            place of the start's source line, for starts made at different lines
            that are meant to match.

    Returns:
        A :class:`Request`.

    Raises:
        TypeError: as :func:`mpi4jax_dist.allreduce` (``site`` included;
            ``mpi4jax_dist.iallreduce`` in the message).
        ValueError: as :func:`mpi4jax_dist.allreduce`; or more than ``INT_MAX``
            elements on an MPI without ``MPI_Iallreduce_c`` (MPI-4): one request
            cannot be split into chunks.
        RuntimeError: as :func:`mpi4jax_dist.allreduce` on the CPU; or (at
            lowering) the request was dropped without its wait.
        ImportError: as :func:`mpi4jax_dist.allreduce` on the CPU.
        NotImplementedError: (at lowering) on a GPU; or differentiated.

    Messages:
        .. code-block:: text

            ValueError: mpi4jax_dist.iallreduce: <n> elements are more than
            one MPI_Iallreduce takes (INT_MAX = <INT_MAX>), and this MPI
            (<MPI>, MPI <version>) has no MPI-4 MPI_Iallreduce_c; one
            request cannot be split into chunks. Use mpi4jax_dist.allreduce,
            which reduces in chunks, or reduce smaller pieces.

            mpi4jax_dist.iallreduce: <n> elements are more than one
            MPI_Iallreduce takes (INT_MAX) on an MPI without MPI-4's
            MPI_Iallreduce_c, and one request cannot be split into chunks.
            Use mpi4jax_dist.allreduce, which reduces in chunks.

            RuntimeError: mpi4jax_dist.iallreduce: the request started at
            <file:line (function)> is never waited on: it was dropped
            without req.wait(). A start without its wait would leave MPI's
            reduction pending (and the next collective on its communicator
            hanging). Call req.wait() on it, or on the request that
            req.overlap() or req.test() returned, in the same function and
            on every path.

            NotImplementedError: mpi4jax_dist.iallreduce does not
            differentiate the array it reduces; use mpi4jax_dist.allreduce
            (MPI.SUM, differentiable) for that.
    """
    import jax.numpy as jnp

    _compat.require_mpi4jax(_WHO)
    site = common.call_site(site, _WHO)
    x = jnp.asarray(x)
    common.check_supported(x.dtype, who=_WHO)
    name = common.op_name(op, _WHO)
    common.check_supported(x.dtype, name, _WHO)
    common.check_mpi(_WHO)
    ext = lifecycle.load_extension()
    comm = common.Comm(common.communicator(comm, _WHO))
    lifecycle.check_count(x.size, ext)
    uid = lifecycle.new_uid()
    from .iallreduce_primitives import start_p

    buffer, handle = start_p.bind(
        x,
        op=common.OPS.index(name),
        comm=comm,
        uid=uid,
        site=site,
    )
    if not is_traced(buffer):  # it ran: an eager start (its uid is unused)
        uid = 0
    return Request(buffer, handle, (), uid, site.text, _compat.opaque_trace_state())
