"""The hang timeout (``MPI4JAX_DIST_HANG_TIMEOUT``): whether this rank makes
progress (its main thread runs Python, one of the package's collectives ends or
is entered), and the job's verdict, one small non-blocking reduction a period on
the watchdog's communicator. docs/faults.rst, *When a rank hangs*."""

from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
import time

import numpy as np

from . import record
from .stacks import Frame

# The verdict's reduction: MIN over [stuck, place, -place, stopping] (int64).
_STUCK, _PLACE, _NEG_PLACE, _STOPPING = range(4)


def epoch(wall: float, period_s: float) -> int:
    """The period of the wall clock that ``wall`` falls in: the same on every rank,
    as the nodes' clocks agree to well within a period."""
    return int(wall // period_s)


def period_s(timeout_s: float, poll_s: float) -> float:
    """How often a rank posts its state: a fifth of the timeout, at least the
    watchdog's poll and at most a minute (the report comes at most about two
    periods after the timeout)."""
    return min(max(timeout_s / 5, poll_s), 60.0)


# A C callback that Python's main thread runs when it next executes bytecode
# (Py_AddPendingCall): what tells "ran Python" from "waits in C".
_PENDING_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Progress:
    """This rank, looked at by the watchdog thread: progress is its main thread
    having run Python since the last look, or one of the package's collectives
    having been entered, waited for or ended (the record,
    :func:`mpi4jax_dist.faults.record.events`). Not the process's I/O: a thread
    that logs to a file would then hide every hang of the job.

    Each look leaves the interpreter a pending call (``Py_AddPendingCall``), which
    only the main thread runs, and only between two bytecode instructions: the next
    look finds it run if the thread ran Python meanwhile, however short (a loop of
    jitted steps, each a wait in C, runs some between steps), and not run if it
    waited in C all along (MPI, Gloo, a sleep), whatever woke it there. A main
    thread that waits in C while XLA works through programs dispatched ahead
    makes progress through the record: each program's collectives end.
    """

    def __init__(self, main: threading.Thread | None = None):
        self.main_id = (main or threading.main_thread()).ident
        self.last_progress = time.monotonic()
        self._ran = True  # the first look arms the first call
        self._callback = _PENDING_CALL(self._mark)  # kept: C holds its address
        self._add = ctypes.pythonapi.Py_AddPendingCall
        self._add.argtypes = [_PENDING_CALL, ctypes.c_void_p]
        self._add.restype = ctypes.c_int
        # What else counts as progress: the record's calls entered, waited for
        # and ended.
        self._count = record.events
        self._last_count = self._count()

    def _mark(self, _arg) -> int:
        self._ran = True
        return 0

    def look(self, now: float) -> None:
        count = self._count()
        moved, self._last_count = count != self._last_count, count
        if not (self._ran or moved):
            return  # no Python run since the last call's arming, nothing else moved
        self.last_progress = now
        if not self._ran:
            return  # the call armed at an earlier look is still pending
        self._ran = False
        if self._add(self._callback, None) != 0:  # the queue is full: no verdict
            self._ran = True

    def stuck_for(self, now: float) -> float:
        return now - self.last_progress

    def place(self) -> list[Frame]:
        """The main thread's stack, innermost frame first."""
        frame = sys._current_frames().get(self.main_id)
        frames = []
        while frame is not None:
            code = frame.f_code
            frames.append(Frame(code.co_filename, frame.f_lineno or 0, code.co_name))
            frame = frame.f_back
        return frames


def place_key(frames: list[Frame], calls: str = "") -> int:
    """A stack, and the collectives the rank is in (``calls``, from the record:
    each with its communicator's key and its number there), as a non-negative
    int64: equal places, equal keys. Ranks at one line of Python but in
    different calls of one jitted program, or in calls of one line on different
    communicators, stand apart."""
    text = "\n".join([calls] + [f"{f.file}:{f.line}:{f.function}" for f in frames])
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Verdict:
    """The job's state once a period: every rank posts an ``MPI_Iallreduce`` (MIN)
    of whether it is stuck, its place (twice, to see whether all are alike) and
    whether it is stopping; the next is posted once the last completed, so every
    rank's chain holds the same reductions. O(log P) messages of 32 bytes per rank
    per period, none of them on the user's communicators.

    A reduction moves a round only when both ranks of the round test it: at one
    poll a second that is a second a round, about log2 P of them (3 s at 8 ranks,
    measured). So every rank posts at the start of a period of the wall clock
    (``time.time() // period``, as the nodes' clocks agree) and tests at a fast
    poll for one poll after posting: the rounds run while every rank tests."""

    def __init__(self, comm, period_s: float):
        self.comm = comm
        self.period_s = period_s
        # Rounds of a reduction and a broadcast over P ranks, either way up.
        self.rounds = 2 * (max(comm.Get_size() - 1, 1).bit_length() + 1)
        self._send = np.zeros(4, dtype=np.int64)
        self._recv = np.zeros(4, dtype=np.int64)
        self._request = None
        self.posted_at: float | None = None
        self._epoch: int | None = None

    @property
    def pending(self) -> bool:
        return self._request is not None

    def due(self, wall: float) -> bool:
        """Whether to post now: none pending, and none yet in this period."""
        return not self.pending and epoch(wall, self.period_s) != self._epoch

    def post(
        self, now: float, wall: float, stuck: bool, place: int, stopping: bool = False
    ) -> None:
        from mpi4py import MPI

        self._send[:] = (int(stuck), place, -place, int(stopping))
        self._request = self.comm.Iallreduce(self._send, self._recv, op=MPI.MIN)
        self.posted_at = now
        self._epoch = epoch(wall, self.period_s)

    def wait_s(self, now: float, wall: float, poll_s: float, fast_s: float) -> float:
        """How long the watchdog may sleep: ``fast_s`` for one poll after posting
        while the reduction is pending, else until the next period starts, at
        most a poll."""
        if self.pending:
            return fast_s if now - self.posted_at < poll_s else poll_s
        return min(poll_s, self.period_s - wall % self.period_s + 1e-3)

    def late_s(self, poll_s: float) -> float:
        """How long a reduction may stay pending while every rank's watchdog runs:
        a period (clocks that disagree post up to a period apart) and a poll a
        round (past its fast poll, a rank tests once a poll again)."""
        return self.period_s + self.rounds * poll_s

    def late_by(self, now: float, timeout_s: float, poll_s: float) -> float:
        """How long the pending reduction has been pending past the timeout and
        :meth:`late_s` (negative: not yet)."""
        return now - self.posted_at - timeout_s - self.late_s(poll_s)

    def test(self) -> dict | None:
        """The last reduction's result once it completed (then the next may be
        posted), else None."""
        if self._request is None or not self._request.Test():
            return None
        self._request = None
        return {
            "all_stuck": bool(self._recv[_STUCK]),
            "one_place": int(self._recv[_PLACE]) == -int(self._recv[_NEG_PLACE]),
            "all_stopping": bool(self._recv[_STOPPING]),
        }

    def finish(self, deadline_s: float) -> bool:
        """Post reductions that say this rank stops until one says every rank does
        (no reduction is left pending at ``MPI_Finalize``); give up at the
        deadline. Return whether the chain ended."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self._request is None:
                self.post(time.monotonic(), time.time(), False, 0, stopping=True)
            result = self.test()
            if result is not None and result["all_stopping"]:
                return True
            time.sleep(0.005)
        return False


class ServiceVerdict:
    """The job's state once a period without MPI, for a watchdog that may not call
    it (below ``MPI_THREAD_MULTIPLE``): counters in JAX's coordination service,
    one set per period of ``period_s`` seconds of the wall clock (the ranks'
    clocks agree to well within a period on a cluster).

    Every rank adds 1 to the period's ``alive`` counter, and where it is stuck to
    ``stuck`` and to the counter of its place: O(1) small messages per rank per
    period, to the service on rank 0's host, which holds a handful of counters a
    period. Rank 0 reads a period two periods back (every rank has counted by
    then), three counters, and deletes the period before it.
    """

    PREFIX = "mpi4jax_dist/hang"

    def __init__(self, rank: int, size: int, period_s: float):
        self.rank, self.size, self.period_s = rank, size, period_s
        self.posted_epoch: int | None = None

    def _client(self):
        from .. import _compat

        return _compat.coordination_client()

    def post(self, wall: float, stuck: bool, place: int) -> bool:
        """Count this rank in the period of ``wall`` (once); return whether it did
        now (a new period)."""
        period = epoch(wall, self.period_s)
        client = self._client()
        if period == self.posted_epoch or client is None:
            return False
        self.posted_epoch = period
        key = f"{self.PREFIX}/{period}"
        client.key_value_increment(f"{key}/alive", 1)
        if stuck:
            client.key_value_increment(f"{key}/stuck", 1)
            client.key_value_increment(f"{key}/place/{place:x}", 1)
        if self.rank == 0:
            client.key_value_delete(f"{self.PREFIX}/{period - 4}")
        return True

    def read(self, wall: float, place: int) -> dict:
        """Rank 0: the period two before ``wall``'s: whether every rank counted
        itself (``all_alive``), was stuck, and stood at rank 0's ``place``."""
        key = f"{self.PREFIX}/{epoch(wall, self.period_s) - 2}"
        alive = self.count(f"{key}/alive")
        return {
            "all_alive": alive >= self.size,
            "all_stuck": self.count(f"{key}/stuck") >= self.size,
            "one_place": self.count(f"{key}/place/{place:x}") >= self.size,
        }

    def count(self, key: str) -> int:
        """A counter's value (0 where nobody has counted)."""
        try:
            return int(self._client().key_value_try_get(key))
        except Exception:  # not there: nobody counted
            return 0
