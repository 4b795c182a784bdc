"""Each rank's steady clock against rank 0's, for the timeline.

Every rank's timeline is on its own ``CLOCK_MONOTONIC`` (``time.monotonic_ns``,
the extension's ``SteadyNs``), which starts at each node's boot: to put the ranks
on one time axis, each measures its clock's offset to rank 0's by ping-pongs
with a rank that knows its own (NTP's estimate: the reply's time against the
middle of the round trip, the round trip with the least time of ``PROBES``). The
pairs form a binomial tree: in round k the ranks below 2^k measure those 2^k
above them, so that ceil(log2 P) rounds reach every rank, each message O(1)
bytes, and an offset's error is at most the sum of half the round trips on its
path to rank 0 (``error_ns``). Every wait has a deadline: a rank that does not
come (it died, or never called) leaves its subtree unmeasured, not waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

# Ping-pongs per pair; the one with the shortest round trip is kept.
PROBES = 16
_TAG = 7301


@dataclass(frozen=True)
class Offset:
    """This rank's clock against rank 0's.

    Attributes:
        offset_ns: this clock minus rank 0's, in ns; None: not measured (a rank
            on the path to rank 0 did not answer in time).
        error_ns: at most this far off (half the round trips on the path).
        at_ns: this clock when measured.
    """

    offset_ns: int | None
    error_ns: int | None
    at_ns: int

    def as_dict(self) -> dict:
        return {
            "offset_ns": self.offset_ns,
            "error_ns": self.error_ns,
            "at_ns": self.at_ns,
        }


class _Late(Exception):
    """The peer did not answer before the deadline."""


def _wait(request, deadline: float) -> None:
    """Wait for ``request``: polled without a pause for a millisecond (a probe's
    reply is timed), then with pauses growing to a millisecond; past
    ``deadline`` (``time.monotonic()``) cancel it and raise :class:`_Late`."""
    spin_until = time.monotonic() + 1e-3
    pause = 1e-5
    while not request.Test():
        now = time.monotonic()
        if now > deadline:
            try:
                request.Cancel()
            except Exception:  # a send MPI cannot cancel: left to MPI
                pass
            raise _Late
        if now > spin_until:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def _send(comm, values, peer: int, deadline: float) -> None:
    _wait(comm.Isend(np.asarray(values, dtype=np.int64), peer, _TAG), deadline)


def _recv(comm, n: int, peer: int, deadline: float) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    _wait(comm.Irecv(out, peer, _TAG), deadline)
    return out


def _measure_above(comm, peer: int, known: tuple | None, deadline: float):
    """As the lower rank of a pair: probe ``peer`` and tell it its offset."""
    if known is None:
        _send(comm, [0, 0], peer, deadline)  # nothing to give: not measured
        return
    _send(comm, [1, 0], peer, deadline)
    best = None
    for _ in range(PROBES):
        t1 = time.monotonic_ns()
        _send(comm, [t1], peer, deadline)
        (t2,) = _recv(comm, 1, peer, deadline)
        t4 = time.monotonic_ns()
        rtt = t4 - t1
        if best is None or rtt < best[0]:
            best = (rtt, int(t2) - (t1 + t4) // 2)
    rtt, peer_minus_mine = best
    offset, error = known
    _send(comm, [1, offset + peer_minus_mine], peer, deadline)
    _send(comm, [error + rtt // 2, 0], peer, deadline)


def _measured_from_below(comm, peer: int, deadline: float):
    """As the upper rank of a pair: answer ``peer``'s probes; return (offset,
    error) or None."""
    flag, _ = _recv(comm, 2, peer, deadline)
    if not flag:
        return None
    for _ in range(PROBES):
        _recv(comm, 1, peer, deadline)
        _send(comm, [time.monotonic_ns()], peer, deadline)
    _, offset = _recv(comm, 2, peer, deadline)
    error, _ = _recv(comm, 2, peer, deadline)
    return int(offset), int(error)


def measure(comm, timeout_s: float) -> Offset:
    """Measure this rank's clock against ``comm``'s rank 0 (collective on
    ``comm``, which should carry no other messages of tag ``_TAG``); give up on
    what has not come in ``timeout_s`` seconds."""
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + timeout_s
    known = (0, 0) if rank == 0 else None
    step = 1
    while step < size:
        try:
            if rank < step and rank + step < size:
                _measure_above(comm, rank + step, known, deadline)
            elif step <= rank < 2 * step:
                known = _measured_from_below(comm, rank - step, deadline)
        except _Late:
            pass  # the pair's upper rank (this one, or its peer) stays unmeasured
        step *= 2
    offset, error = known if known is not None else (None, None)
    return Offset(offset, error, time.monotonic_ns())
