"""What the package asks of MPI itself, below everything that uses it.

The MPI library's name, and :class:`RecordingComm`: a communicator whose every call
is written to a :class:`CallLog` as it runs, so that what the bootstrap reports
about its own MPI traffic is counted, not declared: ``python -m mpi4jax_dist --check
--verbose`` prints the log's collectives, with their payload per rank and what the
MPI adds (docs/cli.rst). ``mpi4py.MPI`` is imported only inside functions:
importing this module starts nothing.
"""

from __future__ import annotations

import os
import sys
import time
import typing
from dataclasses import dataclass, field, replace

# Bytes this rank hands to MPI in each call the bootstrap makes (its payload, not
# what the MPI moves on its behalf), and what the MPI adds where we know it. A call
# not listed here is recorded as "unknown", which the tests refuse.
_INT = 4  # a C int: colors, keys, split types


def _no_bytes(*args, **kwargs) -> int:
    return 0


def _buffer_bytes(buf, *args, **kwargs) -> int:
    return int(getattr(buf, "nbytes", 0))


def _two_ints(*args, **kwargs) -> int:
    return 2 * _INT


# What the MPI itself does in the calls that create communicators, by family (the
# MPI's sources: MPICH's src/mpi/comm/, Open MPI's ompi/communicator/comm.c and
# comm_cid.c, both in 4.x and 5.x). Intel MPI is MPICH's code; an MPI not listed
# here gets no sentence rather than another's.
_MPICH_ADDS = {
    "creation": "MPICH agrees on the new context id with an allreduce of a "
    "fixed-size bitmask",
    "Split": "MPICH allgathers every rank's (color, key) to build the groups: O(P) "
    "bytes per rank (its MPI_Comm_split, src/mpi/comm/comm_split.c)",
    "Split_type": "MPICH splits by node id with its Comm_split, which allgathers "
    "every rank's (color, key): O(P) bytes per rank",
}
_OPEN_MPI_ADDS = {
    "creation": "Open MPI agrees on the new context id with allreduces of one int, "
    "repeated until every rank offers the same free id (ompi/communicator/comm_cid.c)",
    "Split": "Open MPI allgathers every rank's (color, key) to build the groups: "
    "O(P) bytes per rank (ompi_comm_split, ompi/communicator/comm.c)",
    "Split_type": "Open MPI finds the node's ranks in the locality it already "
    "holds (a loop over the P ranks, no messages), then allreduces a few ints "
    "and agrees on a context id: O(log P), O(1) bytes",
}
MPI_ADDS = {"mpich": _MPICH_ADDS, "impi": _MPICH_ADDS, "openmpi": _OPEN_MPI_ADDS}


def family(library_version: str) -> str | None:
    """Return the ABI family of an ``MPI_Get_library_version`` string.

    ``openmpi``, ``impi`` (Intel MPI: MPICH's ABI, but its own library, built
    apart), ``mpich`` (MPICH and the derivatives that share its ABI: MVAPICH, Cray
    MPICH), or None for an MPI we do not know.
    """
    text = library_version.lower()
    if "open mpi" in text:
        return "openmpi"
    if "intel(r) mpi" in text:
        return "impi"
    if any(name in text for name in ("mpich", "mvapich")):
        return "mpich"
    return None


def _adds(what: str):
    """What the running MPI adds to a call that creates a communicator."""

    def sentence() -> str:
        from mpi4py import MPI

        return MPI_ADDS.get(family(MPI.Get_library_version()), {}).get(what, "")

    return sentence


# name: (kind, payload in bytes from the call's arguments, what the MPI adds: a
# sentence, or a function that gives the running MPI's)
CALLS = {
    "Idup": ("collective", _no_bytes, _adds("creation")),
    "Dup": ("collective", _no_bytes, _adds("creation")),
    "Split_type": ("collective", _two_ints, _adds("Split_type")),
    "Split": ("collective", _two_ints, _adds("Split")),
    "Ibcast": ("collective", _buffer_bytes, "a binomial tree: O(log P) steps"),
    "Iexscan": ("collective", _buffer_bytes, "O(log P) steps (recursive doubling)"),
    "Iallreduce": ("collective", _buffer_bytes, "O(log P) steps (recursive doubling)"),
    "Ibarrier": ("collective", _no_bytes, "O(log P) messages of no data"),
    # Collective by the standard, but MPICH and Open MPI only drop a reference.
    "Free": ("free", _no_bytes, "no communication in MPICH or Open MPI"),
    "Get_rank": ("local", _no_bytes, ""),
    "Get_size": ("local", _no_bytes, ""),
    "Abort": ("abort", _no_bytes, "ends every process of the job"),
}


@dataclass(frozen=True)
class Call:
    """One MPI call, recorded as it ran.

    Attributes:
        name: the mpi4py method (``Split_type``, ``Ibcast``, ...).
        phase: what the caller was doing (``arrival``, ``topology``, ``release``).
        kind: ``collective``, ``local``, ``free``, ``abort`` or ``unknown``.
        bytes_per_rank: the payload this rank handed to MPI (None when unknown).
        mpi_adds: what the MPI itself does beyond that payload, where known.
        enter_ns, leave_ns: ``time.monotonic_ns()`` as it was made, and as it
            returned or, for a non-blocking call, as a wait saw its request
            complete (:meth:`CallLog.completed`; 0 until then), for the timeline.
    """

    name: str
    phase: str
    kind: str
    bytes_per_rank: int | None
    mpi_adds: str = ""
    enter_ns: int = 0
    leave_ns: int = 0


@dataclass
class CallLog:
    """The calls made through :class:`RecordingComm` objects, in order; ``phase``
    is stamped on each call as it is made."""

    phase: str = ""
    calls: list[Call] = field(default_factory=list)
    # The non-blocking calls' requests not yet seen complete: id -> (the call's
    # index, the request, kept so that its id is not another's meanwhile).
    _pending: dict = field(default_factory=dict, repr=False)

    def record(self, name: str, args, kwargs) -> int:
        """Write a call being made; return its index, for :meth:`returned`."""
        kind, payload, adds = CALLS.get(name, ("unknown", None, ""))
        size = None if payload is None else payload(*args, **kwargs)
        adds = adds() if callable(adds) else adds
        entered = time.monotonic_ns()
        self.calls.append(Call(name, self.phase, kind, size, adds, entered))
        return len(self.calls) - 1

    def returned(self, index: int, result) -> None:
        """Call ``index`` returned ``result``: it ends now, or where it returned
        requests, once a wait sees them complete."""
        from mpi4py import MPI

        results = result if isinstance(result, tuple) else (result,)
        requests = [r for r in results if isinstance(r, MPI.Request)]
        for request in requests:
            self._pending[id(request)] = (index, request)
        if not requests:
            self._end(index)

    def completed(self, request) -> None:
        """A wait saw ``request`` complete: the call that returned it ends now."""
        index, _ = self._pending.pop(id(request), (None, None))
        if index is not None:
            self._end(index)

    def _end(self, index: int) -> None:
        call = self.calls[index]
        self.calls[index] = replace(call, leave_ns=time.monotonic_ns())

    def collectives(self) -> list[Call]:
        """The calls that communicate (collectives, and any call not known)."""
        return [c for c in self.calls if c.kind in ("collective", "unknown")]


class RecordingComm:
    """An mpi4py communicator whose every method call is recorded in ``log``.

    Communicators the calls return are wrapped too (the null communicator is
    returned as is, and is false); requests are returned as they are: their
    ``Test`` calls are progress, not calls of the bootstrap.
    """

    def __init__(self, comm, log: CallLog):
        self.comm, self.log = comm, log

    def __bool__(self) -> bool:
        return bool(self.comm)

    def __getattr__(self, name: str):
        attr = getattr(self.comm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            index = self.log.record(name, args, kwargs)
            result = attr(*args, **kwargs)
            self.log.returned(index, result)
            return self._wrap(result)

        return call

    def _wrap(self, result):
        from mpi4py import MPI

        if isinstance(result, tuple):
            return tuple(self._wrap(r) for r in result)
        if isinstance(result, MPI.Comm) and result:
            return RecordingComm(result, self.log)
        return result


# Between printing why and MPI_Abort: time for the launcher to forward the message
# (MPICH's Hydra lost it in 3 of 25 jobs without it).
ABORT_GRACE_S = 0.2


def abort(comm, code: int = 1) -> typing.NoReturn:
    """End every process of ``comm``'s job with ``code``; never returns.

    Flushes this process's output and gives the launcher :data:`ABORT_GRACE_S` to
    forward it before ``MPI_Abort``. MPICH 5's ``MPI_Abort`` returned before the
    launcher ended the process, and the caller carried on: ``os._exit`` follows it,
    so that nothing after an abort runs (not even atexit handlers).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the abort
            pass
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)
    os._exit(code)


def mpi_library() -> str:
    """Return the first line of the MPI library's version string (no padding NULs)."""
    from mpi4py import MPI

    first = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
    return " ".join(first.split())  # MPICH 4.0: "MPICH Version:\t4.0.2"


def thread_level_name(level: int) -> str:
    """Return ``single``, ``funneled``, ``serialized`` or ``multiple``."""
    from mpi4py import MPI

    names = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    return names.get(level, str(level))


def thread_level_meaning(level: int) -> str:
    """Say what MPI's thread ``level`` means for this package's compiled ops."""
    from mpi4py import MPI

    if level >= MPI.THREAD_MULTIPLE:
        return "allreduce, iallreduce and cg run; no lock"
    if level == MPI.THREAD_SERIALIZED:
        return (
            "allreduce, iallreduce and cg run, their MPI calls under one lock; "
            "your own mpi4py calls must not overlap a running jitted program"
        )
    return (
        "allreduce, iallreduce and cg refuse to run: XLA calls them on its worker "
        "threads; set MPICH_MAX_THREAD_SAFETY=serialized (or multiple) on Cray "
        "MPICH, and leave mpi4py.rc.thread_level at 'multiple'"
    )
