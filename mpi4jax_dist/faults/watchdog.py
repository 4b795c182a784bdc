"""The watchdog: every rank's thread for the collective and hang timeouts
(docs/faults.rst, *When a rank hangs*). One loop looks at this rank once a poll;
what differs is how the ranks reach their verdict and their reports: over MPI on a
communicator of the watchdog's own (:class:`Watchdog`), or where the watchdog may
not call MPI, through JAX's coordination service (:class:`ServiceWatchdog`)."""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time

from .. import _compat, _config, _mpi
from . import progress, record, report, standstill, writer

logger = logging.getLogger("mpi4jax_dist")

# How often the watchdog looks for an alarm or a message (local calls only): once a
# second, so that a rank where nothing is wrong is not woken more often (OS jitter
# is what HPC codes measure); a hang is reported at most a few polls later. Once
# something is wrong here (this rank's alarm, a message of the watchdogs), every
# URGENT_POLL_S: MPI moves the report's messages only while the watchdog calls it,
# against the main thread's own polling of a timed-out call.
POLL_S = 1.0
URGENT_POLL_S = 0.02
# Rank 0 asks the ranks whose Python has not answered in this long the C way
# (_stacks's thread, which looks every C_POLL_S; both well within REPLY_S).
PYTHON_REPLY_S = 3.0
C_POLL_S = 3.0
# Rank 0's watchdog reports; where it cannot run (its main thread holds the GIL),
# the deputy does, this long after rank 0 would have: a timed-out call's alarm
# reaches both, and the deputy stands down once rank 0 asks it for its stacks.
DEPUTY = 1
DEPUTY_AFTER_S = PYTHON_REPLY_S + 2 * POLL_S
# On the watchdog's own communicator, where no user message meets them: the
# watchdogs' messages (pickled), rank 0's requests to _stacks's threads and
# their replies (text), and a rank's requests for the others' status lines and
# their replies (``python -m mpi4jax_dist status``: _ffi/stacks_status.c).
_TAG = 31_415
_TAG_ASK_C, _TAG_REPLY_C = _TAG + 1, _TAG + 2
_TAG_STATUS_ASK, _TAG_STATUS_REPLY = _TAG + 3, _TAG + 4
# The place of a rank at its exit, in the hang timeout's verdicts.
_EXITED_PLACE = progress.place_key([], "its exit")


class _Loop(threading.Thread):
    """What both watchdogs share: a daemon thread that polls until stopped, and
    the main thread it looks at."""

    def __init__(self, hang_timeout_s: float | None):
        super().__init__(name="mpi4jax_dist-watchdog", daemon=True)
        self.hang_timeout_s = hang_timeout_s
        self.progress = progress.Progress()
        self.period_s = progress.period_s(hang_timeout_s or 0.0, POLL_S)
        self._stopping = threading.Event()
        # Set to cut a wait short: the rank reached its exit, or stops.
        self._wake = threading.Event()

    def wake(self) -> None:
        """Poll now rather than at the end of the current wait."""
        self._wake.set()

    def _halt(self) -> None:
        """End the loop at once: no further poll."""
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        while True:
            self._wake.wait(self._wait_s())
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                if self._poll(time.monotonic()):
                    return
            except Exception as err:  # a watchdog that dies says why
                if not self._stopping.is_set():
                    logger.error("mpi4jax_dist: the watchdog stopped: %s", err)
                return

    def _wait_s(self) -> float:
        return POLL_S

    def _poll(self, now: float) -> bool:
        """One look; True once the watchdog has nothing more to do."""
        raise NotImplementedError

    def _place(self, stuck: bool) -> int:
        """This rank's place for a verdict: its stack and calls where stuck."""
        if not stuck:
            return 0
        return progress.place_key(self.progress.place(), record.place_text())


class _Reports:
    """What rank 0 (or the deputy) of the watchdogs over MPI says when it ends the
    job: every rank's stacks asked for, one report, ``MPI_Abort``. Each report
    method never returns."""

    def _ask_every_rank(self, reason: str, group) -> tuple[dict, set]:
        own = {
            "count": record.count_of(group),
            **report.standing(self.progress, self._exiting.is_set()),
        }
        return _ask_every_rank(self.comm, reason, group, own)

    def _report(self, alarm: dict) -> None:
        """Rank 0: ask every rank for its stacks and count, say who is missing, and
        end the job (never returns)."""
        self._reporting = True
        reason = (
            f"rank {alarm['rank']}'s {alarm['who']} waited {alarm['waited_s']:.3g} s "
            f"({_config.COLLECTIVE_TIMEOUT})"
        )
        replies, where = self._ask_every_rank(reason, alarm["group"])
        logger.critical("%s", report.report_line(alarm, replies, self.size, where))
        _mpi.abort(self.comm, 1)

    def _report_hang(self, stuck_s: float) -> None:
        """Rank 0: every rank's stacks, the ranks grouped by where they stand (the
        odd ones out first), and the end of the job (never returns)."""
        self._reporting = True
        reason = f"no progress for {stuck_s:.3g} s ({_config.HANG_TIMEOUT})"
        replies, where = self._ask_every_rank(reason, None)
        logger.critical("%s", report.hang_report(replies, self.size, stuck_s, where))
        _mpi.abort(self.comm, 1)

    def _report_standstill(self, calls: dict) -> None:
        """Rank 0: every rank waits in a call none of which can complete (``calls``,
        what each is in): every rank's stacks, one report, the end of the job."""
        self._reporting = True
        reason = "the ranks wait in calls that cannot match"
        stacks, where = self._ask_every_rank(reason, None)
        text = report.standstill_report(
            calls, stacks, self.size, standstill.STALL_S, where
        )
        logger.critical("%s", text)
        _mpi.abort(self.comm, 1)


class Watchdog(_Reports, _Loop):
    """The watchdogs over MPI, on a communicator of their own: a timed-out call's
    alarm goes to rank 0 (and the deputy), which asks every rank for its count and
    stacks; with the hang timeout, the verdict is one small reduction a period
    (:class:`~mpi4jax_dist.faults.progress.Verdict`); with ``still_comm``, ranks
    that all wait in calls that cannot match end the job within seconds
    (:class:`~mpi4jax_dist.faults.standstill.Standstill`, its chain on
    ``still_comm``)."""

    def __init__(self, comm, hang_timeout_s: float | None = None, still_comm=None):
        super().__init__(hang_timeout_s)
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._alarm_sent = False
        self._reporting = False
        self.verdict = progress.Verdict(comm, self.period_s) if hang_timeout_s else None
        self.still = standstill.Standstill(still_comm) if still_comm else None
        self._urgent = False
        self._urgent_until = 0.0  # fast polls until then (rank 0 may ask)
        self._sent: list = []  # this rank's alarm, sent without waiting
        # At exit: this rank stays in the verdicts and the standstill's chain as
        # one that has reached its exit until every rank stops (chain_ended).
        self._exiting = threading.Event()
        self._exited_at = 0.0  # time.monotonic() when this rank reached its exit
        self._chain_ended = threading.Event()
        self._verdicts_ended = self.verdict is None
        self._still_ended = self.still is None
        # The deputy: an alarm rank 0 has not acted on yet, and when it came.
        self._deputy_alarm: tuple[dict, float] | None = None

    def start(self) -> None:
        """Start the thread, and have ``_stacks``'s thread answer a request for
        this rank's stacks from C (rank 0's too: the deputy may ask it)."""
        super().start()
        if writer.module() is not None:
            writer.module().answer(
                self.comm.py2f(),
                writer.signum(),
                _TAG_ASK_C,
                _TAG_REPLY_C,
                _TAG_STATUS_ASK,
                _TAG_STATUS_REPLY,
                C_POLL_S,
            )

    def at_exit(self) -> None:
        """Take this rank as at its exit from now on (its verdicts and the
        standstill's chain say so; it answers rank 0 as exited)."""
        self._exited_at = time.monotonic()
        self._exiting.set()
        self.wake()

    def stop(self) -> None:
        """Stop polling before MPI is finalized (an atexit handler). With the hang
        timeout or the standstill's chain this rank first stays in them, as one
        at its exit, and answers rank 0, until every rank stops (no reduction is
        then left pending at ``MPI_Finalize``) or a verdict ends the job naming
        it: others waiting in a collective for this rank cannot go on, and it is
        named as exited."""
        chains = self.verdict is not None or self.still is not None
        if chains and self.is_alive() and threading.current_thread() is not self:
            self.at_exit()
            while self.is_alive() and not self._chain_ended.wait(POLL_S):
                pass
        self._halt()
        if writer.module() is not None:
            writer.module().stop_answering()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=POLL_S + 2)
        if self.is_alive() or self._chain_ended.is_set():
            return
        deadline_s = max(10.0, 3 * self.period_s)
        if not self._verdicts_ended:
            self.verdict.finish(deadline_s=deadline_s)
        if not self._still_ended:
            self.still.finish(deadline_s, (record.events(), standstill.AT_EXIT))

    def _poll(self, now: float) -> bool:
        from mpi4py import MPI

        if MPI.Is_finalized():  # the program finalized MPI itself: nothing to do
            return True
        status = MPI.Status()
        message = self.comm.improbe(MPI.ANY_SOURCE, _TAG, status)
        while message is not None:
            self._urgent = True
            self._handle(message.recv(), status.Get_source())
            message = self.comm.improbe(MPI.ANY_SOURCE, _TAG, status)
        if not self._alarm_sent:
            self._raise_alarm()
        if (
            self._deputy_alarm is not None
            and not self._reporting
            and time.monotonic() - self._deputy_alarm[1] >= DEPUTY_AFTER_S
        ):
            self._report(self._deputy_alarm[0])  # rank 0 did not
        if self._reporting:
            return False
        now = time.monotonic()
        self.progress.look(now)
        exiting = self._exiting.is_set()
        if self.still is not None and not self._still_ended:
            self._watch_standstill(now, exiting)
        if self.verdict is not None and not self._verdicts_ended:
            if exiting:
                self._verdicts_ended = self._watch_at_exit(now)
            else:
                self._watch_progress(now)
        if exiting and self._verdicts_ended and self._still_ended:
            self._chain_ended.set()
            return True
        return False

    def _watch_standstill(self, now: float, exiting: bool) -> None:
        """One look at the standstill's chain: where it says every rank stands
        still and not all in one call, rank 0 asks every rank which calls it is
        in and, where none can complete, reports and ends the job."""
        look = self.still.look(now, self.progress, exiting)
        self._still_ended = look.ended
        if look.check is None:
            return
        # Rank 0 asks what every rank is in, now: answer at once.
        self._urgent_until = now + report.REPLY_S + 1.0
        if self.rank != 0:
            return
        own = standstill.mine(0, exiting, self.progress.stuck_for(now))
        others: list = []
        replies = standstill.ask_calls(self.comm, own, _TAG, report.REPLY_S, others)
        for message, source in others:  # an alarm, say, that came meanwhile
            self._handle(message, source)
        if not standstill.none_can_complete(replies, self.size):
            due_s = standstill.setup_due_s(replies)
            self.still.no_standstill(now, look.check, due_s)
            return
        self._report_standstill(replies)

    def _raise_alarm(self) -> None:
        """This rank's first timed-out call: rank 0 reports it; another rank sends
        it to rank 0 and the deputy."""
        alarm = record.local_alarm(self.size)
        if alarm is None:
            return
        self._alarm_sent = self._urgent = True
        alarm["rank"] = self.rank
        if self.rank == 0:
            self._report(alarm)
            return
        # Not waited for: this thread must go on answering rank 0, which may be
        # asking already.
        self._sent.append(self.comm.isend(alarm, dest=0, tag=_TAG))
        if self.rank == DEPUTY:
            self._deputy_alarm = (alarm, time.monotonic())
        else:
            self._sent.append(self.comm.isend(alarm, dest=DEPUTY, tag=_TAG))

    def _wait_s(self) -> float:
        now = time.monotonic()
        if self._urgent or now < self._urgent_until:
            return URGENT_POLL_S
        still = self.still
        if still and still.testing(now, self.progress, self._exiting.is_set()):
            return URGENT_POLL_S
        if self.verdict is None:
            return POLL_S
        return self.verdict.wait_s(now, time.time(), POLL_S, URGENT_POLL_S)

    def _watch_progress(self, now: float) -> None:
        """The hang timeout: read the last verdict, post the next one when a
        period starts (the rank was looked at just before)."""
        stuck_s = self.progress.stuck_for(now)
        result = self.verdict.test()
        if result is not None and result["all_stuck"]:
            if not result["one_place"]:
                self._urgent = True  # rank 0 asks for the stacks now
                if self.rank == 0:
                    self._report_hang(stuck_s)
                return  # the others wait for rank 0's request for their stacks
            if self.rank == 0:
                report.say_one_long_step(self.hang_timeout_s)
        wall = time.time()
        if self.verdict.due(wall):
            stuck = stuck_s >= self.hang_timeout_s
            self.verdict.post(now, wall, stuck, self._place(stuck))
        elif (
            self.verdict.pending
            and stuck_s >= self.hang_timeout_s
            and self._reports_late(now)
        ):
            # A rank has not taken part for longer than the timeout: its watchdog
            # cannot run (a thread holding the GIL, a stopped process).
            self._report_hang(stuck_s)

    def _watch_at_exit(self, now: float) -> bool:
        """The hang timeout at this rank's exit: post that it is at its exit and
        stopping, at once whenever none is pending; return True once every rank
        stops. Stuck there once it has stood there for the timeout, as a rank is
        elsewhere: ranks that then still wait elsewhere make a hang verdict (not all
        at one place), which rank 0 reports. (Posted stuck at once, a rank that had
        just left a long step shared by all made one verdict with the others' posts
        from inside that step: a false hang, CI of 2026-12-07.)"""
        result = self.verdict.test()
        if result is not None:
            if result["all_stopping"]:
                return True
            if result["all_stuck"] and not result["one_place"]:
                self._urgent = True
                if self.rank == 0:
                    self._report_hang(self.progress.stuck_for(now))
                return False  # the others wait for rank 0's request for stacks
        if not self.verdict.pending:
            stuck = now - self._exited_at >= self.hang_timeout_s
            self.verdict.post(now, time.time(), stuck, _EXITED_PLACE, stopping=True)
        elif self._reports_late(now):
            # A rank has not taken part for longer than the timeout (a thread
            # holding its GIL, a stopped process): rank 0 reports.
            self._report_hang(self.progress.stuck_for(now))
        return False

    def _reports_late(self, now: float) -> bool:
        """Whether this rank reports a verdict pending for longer than the timeout:
        rank 0, and the deputy ``DEPUTY_AFTER_S`` later (rank 0's watchdog may be
        the one that cannot run)."""
        after_s = {0: 0.0, DEPUTY: DEPUTY_AFTER_S}.get(self.rank)
        return (
            after_s is not None
            and self.verdict.late_by(now, self.hang_timeout_s, POLL_S) >= after_s
        )

    def _handle(self, message: dict, source: int) -> None:
        kind = message.get("kind")
        if kind == standstill.ASK:
            still_s = self.progress.stuck_for(time.monotonic())
            standstill.answer(self.comm, source, _TAG, self._exiting.is_set(), still_s)
        elif kind == "alarm" and self.rank == 0 and not self._reporting:
            self._report(message)
        elif kind == "alarm" and self.rank == DEPUTY and self._deputy_alarm is None:
            self._deputy_alarm = (message, time.monotonic())
        elif kind == "dump":
            # Rank 0 (or the deputy) reports: this rank posts no verdict more.
            self._reporting = True
            reply = {
                "kind": "reply",
                "rank": self.rank,
                "count": record.count_of(message["group"]),
                "where": writer.dump(message["reason"]),
                **report.standing(self.progress, self._exiting.is_set()),
            }
            standstill.send_unwaited(self.comm, reply, source, _TAG)


def _ask_every_rank(comm, reason: str, group, own: dict) -> tuple[dict, set]:
    """Rank 0 (or the deputy): ask every other rank of ``comm`` for its stacks,
    count and place; the ranks whose Python has not answered in
    ``PYTHON_REPLY_S``, the C way (their stacks and place only). Return the
    replies by rank (this one's, ``own``, included) and where the stacks went,
    after at most ``REPLY_S``."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    ask = {"kind": "dump", "reason": reason, "group": group}
    others = [r for r in range(size) if r != rank]
    requests = [comm.isend(ask, dest=r, tag=_TAG) for r in others]
    replies = {rank: own}
    where = {writer.dump(reason)}
    start = time.monotonic()
    asked_c = False
    while len(replies) < size and time.monotonic() < start + report.REPLY_S:
        if not asked_c and time.monotonic() >= start + PYTHON_REPLY_S:
            asked_c = True
            text = reason.encode()
            for r in others:
                if r not in replies:
                    requests.append(
                        comm.Isend([text, MPI.CHAR], dest=r, tag=_TAG_ASK_C)
                    )
        status = MPI.Status()
        message = comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        if message is None:
            time.sleep(1e-3)
            continue
        if status.Get_tag() in (_TAG_STATUS_ASK, _TAG_STATUS_REPLY):
            message.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])
            continue  # a status request of _stacks's, met while reporting
        if status.Get_tag() == _TAG_REPLY_C:
            data = bytearray(status.Get_count(MPI.CHAR))
            message.Recv([data, MPI.CHAR])
            held = report.held_reply(data.decode(errors="replace"))
            replies.setdefault(status.Get_source(), held)
            where.add(held["where"])
            continue
        reply = message.recv()
        if reply.get("kind") == "reply":
            replies[reply["rank"]] = reply
            where.add(reply["where"])
    del requests  # eager sends; MPI_Abort ends them
    return replies, where


class ServiceWatchdog(_Loop):
    """The hang timeout where the watchdog may not call MPI (below
    ``MPI_THREAD_MULTIPLE``): the verdict through counters in JAX's coordination
    service (:class:`~mpi4jax_dist.faults.progress.ServiceVerdict`), the request
    for stacks and the replies through its keys, and ``MPI_Abort`` at the end.
    Only a rank that is stuck looks for rank 0's request (once a period); rank 0
    reads the verdict only while it is stuck itself."""

    def __init__(self, rank: int, size: int, hang_timeout_s: float):
        super().__init__(hang_timeout_s)
        self.rank, self.size = rank, size
        self.verdict = progress.ServiceVerdict(rank, size, self.period_s)
        self.prefix = progress.ServiceVerdict.PREFIX
        self._short_since: float | None = None  # rank 0: a rank has not counted
        self._answered = False
        self._counting = False  # counted once: the client is connected

    def stop(self) -> None:
        """Say that this rank stops (so that rank 0 takes a rank that no longer
        counts for one that has ended, not for one that cannot answer)."""
        self._halt()
        if self._counting:
            try:
                _compat.coordination_client().key_value_increment(
                    f"{self.prefix}/stopping", 1
                )
            except Exception:  # the client is shut down: the job ends anyway
                pass

    def _poll(self, now: float) -> bool:
        self.progress.look(now)
        stuck_s = self.progress.stuck_for(now)
        stuck = stuck_s >= self.hang_timeout_s
        place = self._place(stuck)
        wall = time.time()
        if not self.verdict.post(wall, stuck, place):
            return False  # once a period
        if not self._counting:
            self._counting = True
            # Registered after jax.distributed's shutdown, so run before it.
            atexit.register(self.stop)
        if not stuck:
            self._short_since = None
            return False
        if self.rank != 0:
            if not self._answered:
                self._answer()
            return False
        result = self.verdict.read(wall, place)
        if not result["all_alive"]:
            if self.verdict.count(f"{self.prefix}/stopping"):
                return False  # ranks are ending: not a hang
            self._short_since = self._short_since or now
            if now - self._short_since >= self.hang_timeout_s + self.period_s:
                self._report(stuck_s)  # a rank's watchdog cannot run
            return False
        self._short_since = None
        if result["all_stuck"] and not result["one_place"]:
            self._report(stuck_s)
        elif result["all_stuck"]:
            report.say_one_long_step(self.hang_timeout_s)
        return False

    def _answer(self) -> None:
        """A stuck rank other than 0: rank 0's request for the stacks, if it has
        made one, answered with them, where they went and this rank's place."""
        client = _compat.coordination_client()
        try:
            reason = client.key_value_try_get(f"{self.prefix}/dump")
        except Exception:  # no request
            return
        self._answered = True
        reply = {
            "rank": self.rank,
            "where": writer.dump(reason),
            **report.standing(self.progress),
        }
        client.key_value_set(f"{self.prefix}/reply/{self.rank}", json.dumps(reply))
        client.key_value_increment(f"{self.prefix}/replied", 1)

    def _report(self, stuck_s: float) -> None:
        """Rank 0: ask for every rank's stacks and place, print the report and
        end the job (never returns)."""
        from mpi4py import MPI

        client = _compat.coordination_client()
        reason = f"no progress for {stuck_s:.3g} s ({_config.HANG_TIMEOUT})"
        client.key_value_set(f"{self.prefix}/dump", reason)
        replies = {0: report.standing(self.progress)}
        where = {writer.dump(reason)}
        deadline = time.monotonic() + report.REPLY_S + self.period_s
        while time.monotonic() < deadline:
            if self.verdict.count(f"{self.prefix}/replied") >= self.size - 1:
                break
            time.sleep(0.1)
        for _, text in client.key_value_dir_get(f"{self.prefix}/reply/"):
            reply = json.loads(text)
            replies[reply["rank"]] = reply
            where.add(reply["where"])
        silent = "a thread holding its GIL, or stopped"
        logger.critical(
            "%s",
            report.hang_report(
                replies, self.size, stuck_s, where, silent, self.period_s
            ),
        )
        _mpi.abort(MPI.COMM_WORLD, 1)
