"""Ranks that wait in calls that cannot match, found in seconds with no timeout set.

MPI completes a collective once every member of its communicator has entered it
alike. Some disagreements it cannot even match, so no header check ever runs:
a blocking call against a non-blocking one, messages padded to different sizes,
a call on another communicator, an extra call at the end while another rank has
reached its exit. Each rank then waits for good, and nothing but a timeout would
end the job. The job is at a *standstill* when, at one moment, every rank waits
in one of the package's collectives (or has reached its exit) with no progress
for :data:`STALL_S`, and no call any rank is in has been entered alike by every
member of its communicator (such a call completes: a long transfer is not a
standstill). Then no call can ever complete.

How the ranks find out, at no cost while they make progress
(docs/faults.rst, *When a rank hangs*): a chain of two small non-blocking
reductions on a communicator of its own, which a rank joins only once it stands
still. The first completes only once every rank has posted it, that is has
stood still since its last; the second, which every rank then posts
at once, says whether each still stands where it stood when it posted the first
(then all stood still together when the first completed) and whether they all
wait in one call (MIN of a hash and of its negation). All still, not in one call:
rank 0 asks every rank which calls it is in (O(P) small messages, once) and
decides (:func:`live_calls`). A rank that makes progress never posts: its
communicator then carries nothing. A rank whose watchdog cannot run (a thread
holding its GIL, a stopped process) never posts either: that is the hang
timeout's.
"""

from __future__ import annotations

import hashlib
import time
from typing import NamedTuple

import numpy as np

from . import record

# How long a rank must wait in a call with no progress to count as standing still:
# long enough that ranks in matching calls have met (the slowest handshake of a
# loaded machine), short enough to name a standstill within seconds.
STALL_S = 3.0
# How long ranks may all stand still while some wait in a first call on a
# communicator whose duplicates are being made, before that call is taken for one
# that cannot complete: where every member has entered it, the making (an
# MPI_Comm_idup, O(log P) small messages) takes milliseconds even at 10^5 ranks.
SETUP_S = 10.0
# After a second round that found no standstill, a rank that still stands at the
# same place posts again only after this long, doubling up to BACKOFF_MAX_S (a
# long transfer every rank waits in is not asked about every few seconds).
BACKOFF_S = 2 * STALL_S
BACKOFF_MAX_S = 120.0
# What a rank at its exit stands in (any value no call's hash takes: the hash is
# non-negative).
_AT_EXIT = -1
_IDLE, _FIRST, _SECOND = range(3)
# Rank 0's question to every rank, and the answers (on the watchdog's
# communicator and tag).
ASK, REPLY = "calls", "calls-reply"


def place_hash(calls: list[record.Call], at_exit: bool, rank: int) -> int:
    """The calls a rank waits in (or its exit) as a non-negative int64, alike on
    ranks that wait in the same calls. A first call still making its
    communicator's duplicates names the communicator by its group alone, alike
    for every communicator of that group: such a rank stands apart (``rank``
    mixed in), for rank 0 to look closer."""
    if at_exit:
        return _AT_EXIT
    waits = [c for c in calls if c.waiting]
    text = "\n".join(sorted(repr(c.same_as()) for c in waits))
    if any(c.setting_up for c in waits):
        text += f"\nrank {rank}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def live_calls(replies: dict) -> list[record.Call]:
    """Of the calls the ranks are in (``replies``: rank -> {"calls": [Call,
    ...], "exited": bool, "still_s": seconds}), those every member of its
    communicator has entered alike: MPI can complete them (empty at a
    standstill). A first call still making its communicator's duplicates is one
    where its rank has stood still for less than :data:`SETUP_S` (its key names
    the group alone, alike for every communicator of that group: once every
    member has entered it, the making takes milliseconds)."""
    entered: dict = {}
    sizes: dict = {}
    for reply in replies.values():
        for call in reply.get("calls", ()):
            if call.setting_up and reply.get("still_s", 0.0) >= SETUP_S:
                continue  # not made in SETUP_S: its members are elsewhere
            entered.setdefault(call.same_as(), []).append(call)
            sizes[call.same_as()] = call.size
    return [calls[0] for key, calls in entered.items() if len(calls) >= sizes[key]]


def setup_due_s(replies: dict) -> float | None:
    """Where first calls still making their duplicates were taken to complete:
    in how many seconds the first of them is not (:data:`SETUP_S`)."""
    left = [
        SETUP_S - reply.get("still_s", 0.0)
        for reply in replies.values()
        if any(c.setting_up for c in reply.get("calls", ()))
    ]
    return max(min(left), 0.0) + 1.0 if left else None


def none_can_complete(replies: dict, size: int) -> bool:
    """Whether ``replies`` (rank -> {"calls", "exited"}) come from all ``size``
    ranks and hold no call MPI can complete: a standstill."""
    return len(replies) == size and not live_calls(replies)


def ask_calls(comm, own: dict, tag: int, reply_s: float, others: list) -> dict:
    """Rank 0: ask every other rank of ``comm`` which of the package's calls it is
    in and whether it has reached its exit (their watchdogs answer :data:`ASK`
    with :data:`REPLY`); return the replies by rank, this one's (``own``)
    included, after at most ``reply_s``. Other messages that come meanwhile on
    ``tag`` are added to ``others``, as (message, source), for the watchdog."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    ask = {"kind": ASK}
    requests = [comm.isend(ask, dest=r, tag=tag) for r in range(size) if r != rank]
    replies = {rank: own}
    end = time.monotonic() + reply_s
    while len(replies) < size and time.monotonic() < end:
        status = MPI.Status()
        message = comm.improbe(MPI.ANY_SOURCE, tag, status)
        if message is None:
            time.sleep(1e-3)
            continue
        reply = message.recv()
        if reply.get("kind") == REPLY:
            replies[reply["rank"]] = reply
        else:
            others.append((reply, status.Get_source()))
    _unfinished.extend(requests)  # every rank that answered has received its own
    _unfinished[:] = [r for r in _unfinished if not r.Test()]
    return replies


# Sends whose receiver had not received them when last looked at (rank 0's asks,
# a rank's answers): tested again at the next round, so that none is left to grow.
_unfinished: list = []


def answer(comm, source: int, tag: int, exiting: bool, still_s: float) -> None:
    """Answer rank 0's :data:`ASK`: this rank's calls, or that it is at its exit."""
    send_unwaited(comm, mine(comm.Get_rank(), exiting, still_s), source, tag)


def send_unwaited(comm, message, dest: int, tag: int) -> None:
    """Send ``message`` to ``dest`` without waiting for it to be received. A
    blocking send spins in MPI until then (over TCP, a core's worth), and a rank
    pinned to its asker's core kept the asker from running for a minute. Each
    call tests the sends of the calls before (:data:`_unfinished`)."""
    _unfinished[:] = [r for r in _unfinished if not r.Test()]
    _unfinished.append(comm.isend(message, dest=dest, tag=tag))


def mine(rank: int, exiting: bool, still_s: float) -> dict:
    """This rank's answer to :data:`ASK` (rank 0's own too): its calls, or that it
    is at its exit, and how long it has stood still."""
    return {
        "kind": REPLY,
        "rank": rank,
        "calls": [] if exiting else record.calls(),
        "exited": exiting,
        "still_s": still_s,
    }


class Look(NamedTuple):
    """What a look at the chain found: whether it has ended (every rank at its
    exit), and the token to check with where rank 0 is to ask every rank."""

    ended: bool
    check: tuple | None


class Standstill:
    """This rank's part in the chain of reductions (see the module's docstring),
    on ``comm``, a communicator no other messages use. :meth:`poll` once a look
    of the watchdog."""

    def __init__(self, comm):
        self.comm = comm
        self.phase = _IDLE
        self._send = np.zeros(3, dtype=np.int64)
        self._recv = np.zeros(3, dtype=np.int64)
        self._request = None
        self._token: tuple | None = None  # where this rank stood at its first post
        self._quiet_until = 0.0  # no first post before this (after a no)
        self._backoff_s = BACKOFF_S
        self._last_token: tuple | None = None

    @property
    def pending(self) -> bool:
        """Whether a reduction of the chain is posted and not yet complete."""
        return self._request is not None

    def testing(self, now: float, progress, exiting: bool) -> bool:
        """Whether to test often: this rank stands still and its reduction is
        pending (its rounds move only while tested)."""
        return self.pending and (exiting or progress.stuck_for(now) >= STALL_S)

    def look(self, now: float, progress, exiting: bool) -> Look:
        """Look at this rank (``progress``, a
        :class:`~mpi4jax_dist.faults.progress.Progress` looked at this poll, and
        whether it is at its exit) and :meth:`poll` with what it found."""
        calls = [] if exiting else record.calls()
        waiting = any(c.waiting for c in calls)
        still = exiting or (waiting and progress.stuck_for(now) >= STALL_S)
        key = place_hash(calls, exiting, self.comm.Get_rank())
        token = (record.events(), key)
        result = self.poll(now, still, token, key)
        if result is None or result["one_call"] or not result["all_still"]:
            ended = bool(result and exiting and result["all_at_exit"])
            return Look(ended, None)
        return Look(False, token)

    def poll(self, now: float, still: bool, token: tuple, key: int) -> dict | None:
        """One look: ``still`` whether this rank stands still now, ``token`` where
        (alike only while it has not moved since: the record's count of events
        and its calls), ``key`` its :func:`place_hash`. Returns the second
        round's result once one completes (``all_still``, ``one_call``,
        ``all_at_exit``), else None."""
        from mpi4py import MPI

        if self.phase == _IDLE:
            if still and self._may_post(now, token):
                self._token = token
                self._send[:] = (1, 0, 0)
                self._request = self.comm.Iallreduce(self._send, self._recv, MPI.MIN)
                self.phase = _FIRST
            return None
        if not self._request.Test():
            return None
        if self.phase == _FIRST:
            same = still and token == self._token
            self._send[:] = (int(same), key, -key)
            self._request = self.comm.Iallreduce(self._send, self._recv, MPI.MIN)
            self.phase = _SECOND
            return None
        self._request = None
        self.phase = _IDLE
        result = {
            "all_still": bool(self._recv[0]),
            "one_call": int(self._recv[1]) == -int(self._recv[2]),
            "all_at_exit": int(self._recv[1]) == _AT_EXIT == -int(self._recv[2]),
        }
        if result["all_still"] and result["one_call"]:
            self._hold(now, token)  # one call everywhere: a long transfer
        return result

    def no_standstill(
        self, now: float, token: tuple, until_s: float | None = None
    ) -> None:
        """Rank 0 found a call that can complete: ask again only later (in
        ``until_s`` where that is sooner: a set-up taken to complete is due)."""
        self._hold(now, token)
        if until_s is not None:
            self._quiet_until = min(self._quiet_until, now + until_s)

    def _hold(self, now: float, token: tuple) -> None:
        if token == self._last_token:
            self._backoff_s = min(2 * self._backoff_s, BACKOFF_MAX_S)
        else:
            self._backoff_s = BACKOFF_S
        self._last_token = token
        self._quiet_until = now + self._backoff_s

    def _may_post(self, now: float, token: tuple) -> bool:
        return token != self._last_token or now >= self._quiet_until

    def finish(self, deadline_s: float, token: tuple) -> bool:
        """At exit: stay in the chain, as at exit, until a second round says every
        rank is (no reduction is then left pending at ``MPI_Finalize``); give up
        at the deadline. Return whether the chain ended."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            result = self.poll(time.monotonic(), True, token, _AT_EXIT)
            if result is not None and result["all_at_exit"]:
                return True
            time.sleep(0.005)
        return False


AT_EXIT = _AT_EXIT
