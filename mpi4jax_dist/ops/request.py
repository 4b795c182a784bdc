""":class:`Request`, what :func:`mpi4jax_dist.iallreduce` returns: a reduction in
flight, its work overlapped (:meth:`Request.overlap`), progressed
(:meth:`Request.test`) and completed (:meth:`Request.wait`) by the primitives of
ops/iallreduce_primitives.py, and each request used once, in the function that
started it."""

from __future__ import annotations

from .. import _compat
from . import lifecycle


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
    Each method raises ``RuntimeError`` on a request used already, or used in
    another function than the one that started it.

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
        self._finalizer = lifecycle.finalizer(self, uid, handle, site)

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
            TypeError: ``fn`` is not callable, or ``args`` or ``fn``'s
                result hold no JAX array (nothing to order by).
            RuntimeError: this request is used up, or out of its function
                (as :meth:`wait`).

        Messages:
            .. code-block:: text

                TypeError: mpi4jax_dist.Request.overlap: fn=<value> is
                not callable.

                TypeError: mpi4jax_dist.Request.overlap: args hold no
                JAX array, so nothing orders fn's work after the start;
                pass fn's inputs as args rather than closing over them.

                TypeError: mpi4jax_dist.Request.overlap: fn returned no
                JAX array, so nothing orders the wait after its work;
                return the work's results.
        """
        import jax

        from .iallreduce_primitives import tie_p

        who = "mpi4jax_dist.Request.overlap"
        check_request(self, who)
        if not callable(fn):
            raise TypeError(f"{who}: fn={fn!r} is not callable.")
        if not is_traced(self._buffer):
            out = fn(*args)  # eagerly, dispatch order is the order
            self._consume("overlap")
            return self._successor(self._buffer, self._handle, self._deps), out
        leaves, treedef, arrays = _array_leaves(args)
        if not arrays:
            raise TypeError(
                f"{who}: args hold no JAX array, so nothing orders fn's work after "
                f"the start; pass fn's inputs as args rather than closing over them."
            )
        tied = tie_p.bind(self._handle, *(leaves[i] for i in arrays))
        for i, value in zip(arrays, tied, strict=True):
            leaves[i] = value
        out = fn(*jax.tree.unflatten(treedef, leaves))
        out_leaves, out_treedef, out_arrays = _array_leaves(out)
        if not out_arrays:
            raise TypeError(
                f"{who}: fn returned no JAX array, so nothing orders the wait after "
                f"its work; return the work's results."
            )
        passed = _tie_results(tie_p, self._handle, tied, out_leaves, out_arrays)
        self._consume("overlap")
        deps = self._deps + passed
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
            RuntimeError: this request is used up, or out of its function
                (as :meth:`wait`).
        """
        from .iallreduce_primitives import test_p

        check_request(self, "mpi4jax_dist.Request.test")
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
            TypeError: ``req`` is not a request.
            RuntimeError: this request is used up, or out of its function
                (the same from :meth:`test` and :meth:`overlap`).

        Messages:
            .. code-block:: text

                TypeError: mpi4jax_dist.Request.wait: req must be the
                mpi4jax_dist.Request that mpi4jax_dist.iallreduce (or
                req.overlap(), or req.test()) returned; got <type>.

                RuntimeError: <mpi4jax_dist.Request.wait, .test or
                .overlap>: the request started at <file:line (function)>
                was already used by req.<method>(); use the request that
                returned (a request is used once: req.overlap() and
                req.test() return its successor).

                RuntimeError: <mpi4jax_dist.Request.wait, .test or
                .overlap>: the request started at <file:line (function)>
                is used in another function than the one that started it
                (a jit, loop body or branch of its own). Start, overlap,
                test and wait a request in the same function: its buffer
                is in flight and cannot cross into another trace.
        """
        from .iallreduce_primitives import wait_p

        check_request(self, "mpi4jax_dist.Request.wait")
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


def check_request(req, who: str) -> Request:
    """Return ``req`` if it is a :class:`Request` that ``who`` may use now."""
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


def is_traced(value) -> bool:
    import jax

    return isinstance(value, jax.core.Tracer)


def _array_leaves(tree):
    """``(leaves, treedef, indices of the JAX array leaves)``."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    return leaves, treedef, arrays


def _tie_results(tie_p, handle, tied, out_leaves, out_arrays) -> tuple:
    """Pass the arrays ``fn`` computed through the tie, in ``out_leaves``, and
    return the results' arrays, once each, as the wait will take them.

    A result that had two readers (the wait and the caller's next step) could have
    its computation fused into both by XLA, which would run it twice, once after
    the wait. Each array once, and not an input ``fn`` passed through (``tied``:
    already tied, and computed by no one): an array tied in place twice would be
    copied by XLA for each.
    """
    inputs = {id(value) for value in tied}
    fresh = {}  # id -> the result array fn computed
    for i in out_arrays:
        if id(out_leaves[i]) not in inputs:
            fresh.setdefault(id(out_leaves[i]), out_leaves[i])
    through = {}
    if fresh:
        tied_out = tie_p.bind(handle, *fresh.values())
        through = dict(zip(fresh, tied_out, strict=True))
    passed = {}
    for i in out_arrays:
        key = id(out_leaves[i])
        out_leaves[i] = through.get(key, out_leaves[i])
        passed.setdefault(key, out_leaves[i])
    return tuple(passed.values())
