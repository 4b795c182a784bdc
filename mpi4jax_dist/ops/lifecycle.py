"""The life of a non-blocking allreduce's request outside its primitives: the
extension it needs, the count one request can take, the uid of a traced start,
and what becomes of a request that never meets its wait (dropped eagerly:
completed by its finalizer; dropped while traced: refused at the start's
lowering; pending at exit: named, and the job ended). docs/design.rst, *The
non-blocking allreduce*, says what is caught where.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import sys
import warnings
import weakref

from . import common

WHO = "mpi4jax_dist.iallreduce"
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

# Start uids of traced requests (0: an eager start, not checked); those dropped
# without their wait, uid -> where the start was made.
_UIDS = itertools.count(1)
_DROPPED: dict[int, str] = {}


def load_extension():
    """The CPU extension, with the non-blocking handlers registered (and the
    report of the requests pending at exit)."""
    ext = common.extension()
    if not hasattr(ext, "iallreduce_handlers"):
        raise ImportError(
            f"{WHO}: the extension {ext.__file__} has no non-blocking handlers: "
            f"it was built from an older mpi4jax_dist. Rebuild it: pip install "
            f"--no-build-isolation --force-reinstall --no-deps <path to "
            f"mpi4jax_dist>."
        )
    _register_exit_report()
    return ext


def check_count(size: int, ext) -> None:
    """Raise ``ValueError`` unless one ``MPI_Iallreduce`` of ``ext``'s MPI takes
    ``size`` elements (a request is one MPI call: it cannot go in chunks)."""
    if size > INT_MAX and not ext.LARGE_COUNT:
        major, minor = ext.MPI_STANDARD
        raise ValueError(
            f"{WHO}: {size} elements are more than one MPI_Iallreduce takes "
            f"(INT_MAX = {INT_MAX}), and this MPI ({ext.HEADER_MPI}, MPI "
            f"{major}.{minor}) has no MPI-4 MPI_Iallreduce_c; one request cannot be "
            f"split into chunks. Use mpi4jax_dist.allreduce, which reduces in "
            f"chunks, or reduce smaller pieces."
        )


def new_uid() -> int:
    """A uid for a start being traced, by which its lowering knows it."""
    return next(_UIDS)


def finalizer(request, uid: int, handle, site: str) -> weakref.finalize:
    """What happens when ``request`` goes without its wait (the finalizer that
    its wait, or its successor's making, detaches). Traced (``uid`` not 0): the
    start's lowering refuses it (:func:`refuse_dropped`). Eager: the request is
    pending in MPI, and is completed then (not at exit, where the exit report
    takes every pending request)."""
    if uid:
        done = weakref.finalize(request, _DROPPED.__setitem__, uid, site)
    else:
        done = weakref.finalize(request, _eager_dropped, handle, site)
    done.atexit = False
    return done


def refuse_dropped(uid: int) -> None:
    """Raise ``RuntimeError`` if the traced request of ``uid`` was dropped
    without its wait (called by the lowering of its start)."""
    if uid in _DROPPED:
        raise RuntimeError(
            f"{WHO}: the request started at {_DROPPED[uid]} is never waited "
            f"on: it was dropped without req.wait(). A start without its "
            f"wait would leave MPI's reduction pending (and the next "
            f"collective on its communicator hanging). Call req.wait() on "
            f"it, or on the request that req.overlap() or req.test() "
            f"returned, in the same function and on every path."
        )


def _eager_dropped(handle, site) -> None:
    """Finalizer of an eager request dropped without its wait: complete it."""
    try:
        left = common.extension().complete_pending([int(handle)], DROP_TIMEOUT_S)
    except Exception:  # MPI gone: the exit report has it
        left = [None]
    warnings.warn(
        f"{WHO}: the request started at {site} was dropped without "
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
            f"{WHO}: at exit, the request started at {site} (handle {handle}) is "
            f"still pending: its req.wait() never ran.\n"
        )
    sys.stderr.flush()
    left = ext.complete_pending([], EXIT_TIMEOUT_S)
    done = len(pending) - len(left)
    sys.stderr.write(
        f"{WHO}: {len(pending)} request(s) left pending at exit ({done} completed "
        f"since, {len(left)} not within {EXIT_TIMEOUT_S:g} s): ending the job with "
        f"status {EXIT_STATUS}. Every start needs its req.wait(), on every rank "
        f"and every path.\n"
    )
    from mpi4py import MPI

    from .. import _mpi

    _mpi.abort(MPI.COMM_WORLD, EXIT_STATUS)
