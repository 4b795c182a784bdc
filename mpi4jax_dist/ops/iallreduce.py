"""``mpi4jax_dist.iallreduce``: a non-blocking allreduce for jitted code.

Four primitives on the CPU handlers, all carrying mpi4jax's ordered effect: the
start (``MPI_Iallreduce`` on a copy the extension owns), the test, the wait, and the
tie that orders :meth:`Request.overlap`'s work between start and wait by data
dependencies. What runs when and what is caught: docs/design.rst, *The
non-blocking allreduce*.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import sys
import warnings
import weakref

import numpy as np

from .. import _compat, _config
from . import common

INT_MAX = 2**31 - 1
#: Seconds an eager request dropped without its wait is polled for completion
#: (the other ranks' drops complete it at once; a longer wait would only hold up
#: a rank whose peers never started it).
DROP_TIMEOUT_S = 2.0
#: Seconds the requests still pending at exit are polled for completion before
#: the job is ended.
EXIT_TIMEOUT_S = 2.0
#: The job's exit status when requests were still pending at exit.
EXIT_STATUS = 1

_WHO = "mpi4jax_dist.iallreduce"
# Start uids of traced requests (0: an eager start, not checked); those dropped
# without their wait, uid -> where the start was made.
_UIDS = itertools.count(1)
_DROPPED: dict[int, str] = {}


def _is_traced(value) -> bool:
    import jax

    return isinstance(value, jax.core.Tracer)


class Request:
    """A non-blocking allreduce in flight: what :func:`iallreduce` returns.

    Complete it with :meth:`wait`, in the function that started it and on every
    path; run work while it reduces with :meth:`overlap`, and let the MPI
    progress it with :meth:`test`::

        req = mpi4jax_dist.iallreduce(partials)   # MPI_Iallreduce posted
        req, n = req.overlap(matvec, w)           # runs while it reduces
        req = req.test()                          # MPI_Test, once
        sums = req.wait()                         # MPI_Wait

    A request is used once: :meth:`overlap` and :meth:`test` use it up and
    return its successor, which is the one to use next (rebind the name, as
    above). It holds the array's buffer, which the wait fills with the
    result (MPI reduces a copy the extension owns), and the handle of the
    request; neither is to be read before the wait. It is no pytree: start,
    overlap, test and wait it in one function (one ``jit``, one loop body).

    Attributes:
        shape, dtype: those of the array being reduced.
        site: where the start was made (``file:line in function``).
    """

    __slots__ = (
        "_buffer",
        "_handle",
        "_deps",
        "_uid",
        "site",
        "_trace",
        "_finalizer",
        "_used_by",
        "__weakref__",
    )

    def __init__(self, buffer, handle, deps, uid, site, trace):
        self._buffer, self._handle, self._deps = buffer, handle, tuple(deps)
        self._uid, self.site, self._trace = uid, site, trace
        self._used_by = None
        if uid:
            # Traced: the lowering of the start refuses a dropped request.
            self._finalizer = weakref.finalize(self, _DROPPED.__setitem__, uid, site)
            self._finalizer.atexit = False
        else:
            # Eager: the request is pending in MPI; complete it when dropped (not
            # at exit, where the exit report takes every pending request).
            self._finalizer = weakref.finalize(self, _eager_dropped, handle, site)
            self._finalizer.atexit = False

    @property
    def shape(self):
        return self._buffer.shape

    @property
    def dtype(self):
        return self._buffer.dtype

    def __repr__(self):
        state = f"used by req.{self._used_by}()" if self._used_by else "pending"
        return (
            f"<mpi4jax_dist.Request {self.dtype}{list(self.shape)} from "
            f"{self.site}, {state}>"
        )

    def overlap(self, fn, *args):
        """Run ``fn(*args)`` while this request's reduction is in flight.

        Start, ``fn`` and wait run in that order in the compiled program, by data
        dependencies: ``args``' JAX arrays pass through a no-op call that reads
        the request's handle (so ``fn`` starts after the start, or after the last
        :meth:`test`), and ``fn``'s JAX arrays pass through it again, which the
        wait (or the next test) takes as operands it never reads (so it runs after
        ``fn``, and ``fn``'s work runs once: no reader of its results can
        recompute them). Pass ``fn``'s inputs as ``args``: what ``fn`` closes
        over is not ordered. The no-op call passes the arrays on in place; an
        array of ``args`` used again after ``overlap`` (or carried unchanged
        through a loop) is therefore copied once by XLA, which keeps its value:
        return it from ``fn`` and use that instead to avoid the copy.
        Eagerly, ``fn`` simply runs.

        This request is used up: continue with the one returned.

        Example::

            req = mpi4jax_dist.iallreduce(partials)
            req, m = req.overlap(precond, w)
            req = req.test()
            req, n = req.overlap(matvec, m)
            sums = req.wait()

        Args:
            fn: the work to overlap; its inputs and outputs are pytrees.
            *args: ``fn``'s inputs; non-array leaves pass unchanged.

        Returns:
            ``(request, fn(*args))``: the request to continue with (to
            :meth:`wait` on, or to pass to another :meth:`overlap` or
            :meth:`test`), and ``fn``'s result.

        Raises:
            TypeError: ``fn`` is not callable, or ``args`` or ``fn``'s result
                hold no JAX array (nothing to order by).
            RuntimeError: this request was used already, or is used in another
                function than the one that started it.
        """
        import jax

        who = "mpi4jax_dist.Request.overlap"
        _check_request(self, who)
        if not callable(fn):
            raise TypeError(f"{who}: fn={fn!r} is not callable.")
        if not _is_traced(self._buffer):
            out = fn(*args)  # eagerly, dispatch order is the order
            self._consume("overlap")
            return self._successor(self._buffer, self._handle, self._deps), out
        leaves, treedef, arrays = _array_leaves(args)
        if not arrays:
            raise TypeError(
                f"{who}: args hold no JAX array, so nothing orders fn's work after "
                f"the start; pass fn's inputs as args rather than closing over them."
            )
        *_, tie = _primitives()
        tied = tie.bind(self._handle, *(leaves[i] for i in arrays))
        for i, value in zip(arrays, tied, strict=True):
            leaves[i] = value
        out = fn(*jax.tree.unflatten(treedef, leaves))
        out_leaves, out_treedef, out_arrays = _array_leaves(out)
        if not out_arrays:
            raise TypeError(
                f"{who}: fn returned no JAX array, so nothing orders the wait after "
                f"its work; return the work's results."
            )
        # fn's results pass through the no-op call too, and the wait takes them
        # from there: a result that had two readers (the wait and the caller's
        # next step) could have its computation fused into both by XLA, which
        # would run it twice, once after the wait. Each array once, and not an
        # input fn passed through (already tied, and computed by no one): an
        # array tied in place twice would be copied by XLA for each.
        inputs = {id(value) for value in tied}
        fresh = {}  # id -> the result array fn computed
        for i in out_arrays:
            if id(out_leaves[i]) not in inputs:
                fresh.setdefault(id(out_leaves[i]), out_leaves[i])
        through = {}
        if fresh:
            tied_out = tie.bind(self._handle, *fresh.values())
            through = dict(zip(fresh, tied_out, strict=True))
        passed = {}  # the results' arrays, once each, as the wait will take them
        for i in out_arrays:
            key = id(out_leaves[i])
            out_leaves[i] = through.get(key, out_leaves[i])
            passed.setdefault(key, out_leaves[i])
        self._consume("overlap")
        deps = self._deps + tuple(passed.values())
        return self._successor(self._buffer, self._handle, deps), jax.tree.unflatten(
            out_treedef, out_leaves
        )

    def test(self) -> Request:
        """Call ``MPI_Test`` on this request once, so that the MPI progresses it.

        Place it between pieces of overlapped work: an MPI without a progress
        thread (Open MPI 5; MPICH unless ``MPIR_CVAR_ASYNC_PROGRESS=1``) moves a
        non-blocking collective on only inside its own calls, so the later steps
        of the reduction wait for the next one. It runs after the work that
        :meth:`overlap` placed before it.

        This request is used up: continue with the one returned (``req =
        req.test()``).

        Returns:
            The request to continue with (to :meth:`wait` on, or to pass to
            :meth:`overlap` or :meth:`test` again).

        Raises:
            RuntimeError: this request was used already, or is used in another
                function than the one that started it.
        """
        who = "mpi4jax_dist.Request.test"
        _check_request(self, who)
        _, test_p, _, _ = _primitives()
        buffer, handle = test_p.bind(self._buffer, self._handle, *self._deps)
        self._consume("test")
        return self._successor(buffer, handle, ())

    def wait(self):
        """Complete this request (``MPI_Wait``) and return the reduced array.

        Every request needs its wait (or that of its successor from
        :meth:`overlap` or :meth:`test`), in the function that started it and on
        every path. It runs after the work that :meth:`overlap` placed before it.

        This request is used up.

        Returns:
            The reduced array, of the shape and dtype of the started one.

        Raises:
            RuntimeError: this request was used already, or is used in another
                function than the one that started it.
        """
        who = "mpi4jax_dist.Request.wait"
        _check_request(self, who)
        _, _, wait_p, _ = _primitives()
        out = wait_p.bind(self._buffer, self._handle, *self._deps)
        self._consume("wait")
        return out

    def _check(self, who: str) -> None:
        """Raise unless this request may be used now, by ``who``."""
        if self._used_by is not None:
            raise RuntimeError(
                f"{who}: the request started at {self.site} was already used by "
                f"req.{self._used_by}(); use the request that returned (a request "
                f"is used once: req.overlap() and req.test() return its successor)."
            )
        if _compat.opaque_trace_state() != self._trace:
            raise RuntimeError(
                f"{who}: the request started at {self.site} is used in another "
                f"function than the one that started it (a jit, loop body or "
                f"branch of its own). Start, overlap, test and wait a request in "
                f"the same function: its buffer is in flight and cannot cross into "
                f"another trace."
            )

    def _consume(self, name: str) -> None:
        """Mark this request as used by its method ``name``."""
        self._used_by = name
        self._finalizer.detach()

    def _successor(self, buffer, handle, deps) -> Request:
        """The request that continues this one (from :meth:`overlap`/:meth:`test`)."""
        return Request(buffer, handle, deps, self._uid, self.site, self._trace)


def _check_request(req, who: str) -> Request:
    # Only a method called on something else gets here with another type:
    # Request.wait(3).
    if not isinstance(req, Request):
        raise TypeError(
            f"{who}: req must be the mpi4jax_dist.Request that "
            f"mpi4jax_dist.iallreduce (or req.overlap(), or req.test()) returned; "
            f"got {type(req).__name__}."
        )
    req._check(who)
    return req


def _eager_dropped(handle, site) -> None:
    """Finalizer of an eager request dropped without its wait: complete it."""
    try:
        left = common.extension().complete_pending([int(handle)], DROP_TIMEOUT_S)
    except Exception:  # MPI gone: the exit report has it
        left = [None]
    warnings.warn(
        f"{_WHO}: the request started at {site} was dropped without "
        f"req.wait(); "
        + (
            "it was completed and its result discarded."
            if not left
            else f"it did not complete within {DROP_TIMEOUT_S:g} s (did the other "
            f"ranks start it?) and stays pending."
        ),
        RuntimeWarning,
        stacklevel=2,
    )


@functools.cache
def _register_exit_report() -> None:
    atexit.register(_report_pending_at_exit)


def _report_pending_at_exit() -> None:
    """Name the requests still pending at exit, give MPI :data:`EXIT_TIMEOUT_S` to
    complete them, and end the job with :data:`EXIT_STATUS` (before mpi4py
    finalizes MPI, after atexit's callbacks)."""
    try:
        import jax

        # Programs still running may be starting requests: let them finish.
        jax.effects_barrier()
    except Exception:  # a run that failed: the program was told already
        pass
    try:
        ext = common.extension()
        pending = ext.pending_requests()
    except Exception:
        return
    if not pending:
        return
    # One write per line: the ranks' lines then do not interleave.
    for handle, _uid, site in pending:
        sys.stderr.write(
            f"{_WHO}: at exit, the request started at {site} (handle {handle}) is "
            f"still pending: its req.wait() never ran.\n"
        )
    sys.stderr.flush()
    left = ext.complete_pending([], EXIT_TIMEOUT_S)
    done = len(pending) - len(left)
    sys.stderr.write(
        f"{_WHO}: {len(pending)} request(s) left pending at exit ({done} completed "
        f"since, {len(left)} not within {EXIT_TIMEOUT_S:g} s): ending the job with "
        f"status {EXIT_STATUS}. Every start needs its req.wait(), on every rank "
        f"and every path.\n"
    )
    from mpi4py import MPI

    from .. import _mpi

    _mpi.abort(MPI.COMM_WORLD, EXIT_STATUS)


def _load_extension():
    """The CPU extension, with the non-blocking handlers registered."""
    ext = common.extension()
    if not hasattr(ext, "iallreduce_handlers"):
        raise ImportError(
            f"{_WHO}: the extension {ext.__file__} has no non-blocking handlers: "
            f"it was built from an older mpi4jax_dist. Rebuild it: pip install "
            f"--no-build-isolation --force-reinstall --no-deps <path to "
            f"mpi4jax_dist>."
        )
    _register_exit_report()
    return ext


def iallreduce(x, op=None, *, comm=None) -> Request:
    """Start reducing ``x`` over the ranks of ``comm`` without waiting: post
    ``MPI_Iallreduce`` on a copy of ``x`` the extension owns and return a
    :class:`Request` at once.

    Complete it with :meth:`Request.wait` in the same function, on every path; put
    the work to overlap between the two with :meth:`Request.overlap` (and
    :meth:`Request.test` for MPI progress). docs/design.rst says what runs
    when, and what is caught.

    Args:
        x: array or scalar: float32/64, complex64/128, (u)int8/16/32/64, or bool
            for the logical ops, as :func:`mpi4jax_dist.allreduce`.
        op: an ``mpi4py.MPI.Op``: ``MPI.SUM`` (the default, also for None),
            ``PROD``, ``MIN``, ``MAX``, ``LAND``, ``LOR``, ``LXOR``, ``BAND``,
            ``BOR`` or ``BXOR``, where MPI defines it for the dtype.
        comm: an mpi4py intracommunicator; default: ``MPI.COMM_WORLD``. The
            calls run on a private duplicate of it, so that they never meet
            the program's own MPI calls on it.

    Returns:
        A :class:`Request`.

    Raises:
        TypeError: a dtype, op or communicator MPI cannot reduce with, before any
            MPI call.
        ValueError: more than ``INT_MAX`` elements on an MPI without
            ``MPI_Iallreduce_c`` (MPI-4), or ``comm`` is ``MPI.COMM_NULL``.
        RuntimeError: MPI is not initialized, or provides less than
            ``MPI_THREAD_SERIALIZED`` (as :func:`mpi4jax_dist.allreduce`); (at
            lowering) the request was dropped without its wait.
        ImportError: mpi4jax is not installed (naming the ``mpi4jax`` extra), or the
            extension was built against another MPI than mpi4py's.
        NotImplementedError: (at lowering) on a GPU.
    """
    import jax.numpy as jnp

    _compat.require_mpi4jax(_WHO)
    x = jnp.asarray(x)
    common.check_supported(x.dtype, who=_WHO)
    name = common.op_name(op, _WHO)
    common.check_supported(x.dtype, name, _WHO)
    common.check_mpi(_WHO)
    ext = _load_extension()
    comm = common.Comm(common.communicator(comm, _WHO))
    _check_count(x.size, ext)
    site = common.caller_site()
    uid = next(_UIDS)
    start, _, _, _ = _primitives()
    buffer, handle = start.bind(
        x,
        op=common.OPS.index(name),
        comm=comm,
        uid=uid,
        site=site,
    )
    if not _is_traced(buffer):  # it ran: an eager start (its uid is unused)
        uid = 0
    return Request(buffer, handle, (), uid, site, _compat.opaque_trace_state())


def _check_count(size: int, ext) -> None:
    if size > INT_MAX and not ext.LARGE_COUNT:
        major, minor = ext.MPI_STANDARD
        raise ValueError(
            f"{_WHO}: {size} elements are more than one MPI_Iallreduce takes "
            f"(INT_MAX = {INT_MAX}), and this MPI ({ext.HEADER_MPI}, MPI "
            f"{major}.{minor}) has no MPI-4 MPI_Iallreduce_c; one request cannot be "
            f"split into chunks. Use mpi4jax_dist.allreduce, which reduces in "
            f"chunks, or reduce smaller pieces."
        )


def _array_leaves(tree):
    """``(leaves, treedef, indices of the JAX array leaves)``."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    return leaves, treedef, arrays


@functools.cache
def _primitives():
    """Make the start, test, wait and tie primitives and their rules (first call)."""
    import jax
    from jax.core import ShapedArray
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    from .. import _ffi

    ordered_effect, abstract_token = common.ordering()

    start_target, test_target, wait_target, tie_target = _ffi.IALLREDUCE_TARGETS
    start = Primitive("mpi4jax_dist_iallreduce_start")
    start.multiple_results = True
    test_p = Primitive("mpi4jax_dist_iallreduce_test")
    test_p.multiple_results = True
    wait_p = Primitive("mpi4jax_dist_iallreduce_wait")
    tie = Primitive("mpi4jax_dist_iallreduce_tie")
    tie.multiple_results = True
    handle_aval = ShapedArray((), np.int32)

    # -- eager: one jitted call per (op, comm, site); the request's buffer is
    # donated to the test and the wait, which write into it in place (no copy).

    @functools.cache
    def start_jitted(op, comm, site):
        return jax.jit(lambda x: start.bind(x, op=op, comm=comm, uid=0, site=site))

    @functools.cache
    def then_jitted(prim):
        return jax.jit(lambda b, h, *deps: prim.bind(b, h, *deps), donate_argnums=0)

    def start_impl(x, *, op, comm, uid, site):
        del uid  # eager starts are not checked at lowering
        return start_jitted(op, comm, site)(x)

    def start_abstract(x, *, op, comm, uid, site):
        buffer = ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
        return [buffer, handle_aval], {ordered_effect}

    def then_abstract(prim):
        def rule(buffer, handle, *deps):
            out = ShapedArray(buffer.shape, buffer.dtype, weak_type=buffer.weak_type)
            if prim is test_p:
                return [out, handle_aval], {ordered_effect}
            return out, {ordered_effect}

        return rule

    def token_after(ctx, value, aval):
        (token,) = jax.ffi.ffi_lowering(_ffi.TOKEN_AFTER_TARGET)(
            ctx.replace(avals_in=(aval,), avals_out=(abstract_token,)), value
        )
        ctx.set_tokens_out(mlir.TokenSet({ordered_effect: token}))

    def start_lowering(ctx, x, *, op, comm, uid, site):
        if uid in _DROPPED:
            raise RuntimeError(
                f"{_WHO}: the request started at {_DROPPED[uid]} is never waited "
                f"on: it was dropped without req.wait(). A start without its "
                f"wait would leave MPI's reduction pending (and the next "
                f"collective on its communicator hanging). Call req.wait() on "
                f"it, or on the request that req.overlap() or req.test() "
                f"returned, in the same function and on every path."
            )
        ext = _load_extension()
        _check_count(int(np.prod(ctx.avals_in[0].shape)), ext)
        token = ctx.tokens_in.get(ordered_effect)
        buffer, handle = jax.ffi.ffi_lowering(
            start_target, operand_output_aliases={0: 0}, has_side_effect=True
        )(
            ctx.replace(avals_in=(*ctx.avals_in, abstract_token)),
            x,
            token,
            comm=np.int64(comm.id_in(ext)),
            op=np.int32(op),
            check=np.int32(_config.checks()),
            uid=np.int64(uid),
            site=np.int64(ext.register_site(site)),
        )
        token_after(ctx, handle, handle_aval)
        return [buffer, handle]

    def then_lowering(prim, target):
        aliases = {0: 0, 1: 1} if prim is test_p else {0: 0}

        def rule(ctx, buffer, handle, *deps):
            _load_extension()
            token = ctx.tokens_in.get(ordered_effect)
            avals = ctx.avals_in
            results = jax.ffi.ffi_lowering(
                target, operand_output_aliases=aliases, has_side_effect=True
            )(
                ctx.replace(avals_in=(*avals[:2], abstract_token, *avals[2:])),
                buffer,
                handle,
                token,
                *deps,
            )
            if prim is test_p:
                token_after(ctx, results[1], handle_aval)
            else:
                token_after(ctx, results[0], ctx.avals_out[0])
            return results

        return rule

    def start_batching(args, dims, **params):
        # Elementwise over ranks: the batch dimension stays; the handle is one.
        return start.bind(*args, **params), [dims[0], None]

    def then_batching(prim):
        def rule(args, dims):
            out = prim.bind(*args)
            if prim is test_p:
                return out, [dims[0], None]
            return out, dims[0]

        return rule

    # The tie of overlap: the handle and arrays in, the arrays out in place (a
    # no-op call; see cpu.cc). Eagerly the identity: no call, no copy.
    def tie_impl(handle, *arrays):
        return list(arrays)

    def tie_abstract(handle, *arrays):
        return list(arrays)

    def tie_lowering(ctx, handle, *arrays):
        _load_extension()
        return jax.ffi.ffi_lowering(
            tie_target,
            operand_output_aliases={i + 1: i for i in range(len(arrays))},
        )(ctx, handle, *arrays)

    def tie_batching(args, dims):
        return tie.bind(*args), list(dims[1:])

    def tie_jvp(primals, tangents):
        return tie.bind(*primals), list(tangents[1:])

    # Derivatives flow through the overlapped work (the test's and wait's operands
    # after the handle are only dependencies), never through the reduction: JAX
    # calls these rules only when some input carries a tangent.
    def no_derivative():
        return NotImplementedError(
            f"{_WHO} does not differentiate the array it reduces; use "
            f"mpi4jax_dist.allreduce (MPI.SUM, differentiable) for that."
        )

    def start_jvp(primals, tangents, **params):
        raise no_derivative()

    def then_jvp(prim):
        def rule(primals, tangents):
            if not isinstance(tangents[0], ad.Zero):
                raise no_derivative()
            out = prim.bind(*primals)
            return out, (list(tangents[:2]) if prim is test_p else tangents[0])

        return rule

    start.def_impl(start_impl)
    start.def_effectful_abstract_eval(start_abstract)
    mlir.register_lowering(start, start_lowering, platform="cpu")
    batching.primitive_batchers[start] = start_batching
    ad.primitive_jvps[start] = start_jvp
    for prim, target in ((test_p, test_target), (wait_p, wait_target)):
        prim.def_impl(functools.partial(lambda p, *a: then_jitted(p)(*a), prim))
        prim.def_effectful_abstract_eval(then_abstract(prim))
        mlir.register_lowering(prim, then_lowering(prim, target), platform="cpu")
        batching.primitive_batchers[prim] = then_batching(prim)
        ad.primitive_jvps[prim] = then_jvp(prim)
    # Every other platform (cuda, rocm, oneapi, ...): a clear error when lowered.
    refuse = common.unsupported_lowering(
        f"{_WHO} (and Request.test and Request.wait)", ("cpu",)
    )
    for prim in (start, test_p, wait_p, tie):
        mlir.register_lowering(prim, refuse)
    tie.def_impl(tie_impl)
    tie.def_abstract_eval(tie_abstract)
    mlir.register_lowering(tie, tie_lowering, platform="cpu")
    batching.primitive_batchers[tie] = tie_batching
    ad.primitive_jvps[tie] = tie_jvp
    return start, test_p, wait_p, tie
