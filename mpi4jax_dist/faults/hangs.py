"""A hung job says which rank and where: each rank's stacks on ``SIGUSR1``
(faulthandler into a pipe a thread drains), and the collective timeout's watchdog,
which asks every rank for its stacks and its count of calls, names the ranks that
had not entered the call, and ends the job. docs/design.rst, *When a rank hangs*.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field

from .. import _compat, _config
from . import progress, stacks
from .stacks import ranks_text  # noqa: F401 (diagnostics' and the tests' name)

logger = logging.getLogger("mpi4jax_dist")

# How often the watchdog looks for an alarm or a message (local calls only): once a
# second, so that a rank where nothing is wrong is not woken more often (OS jitter
# is what HPC codes measure); a hang is reported at most a few polls later. Once
# something is wrong here (this rank's alarm, a message of the watchdogs), every
# URGENT_POLL_S: MPI moves the report's messages only while the watchdog calls it,
# against the main thread's own polling of a timed-out call.
POLL_S = 1.0
URGENT_POLL_S = 0.02
# How long rank 0 waits for every rank's stacks and count, once it asked.
REPLY_S = 10.0
# Rank 0 asks the ranks whose Python has not answered in this long the C way
# (_stacks's thread, which looks every C_POLL_S; both well within REPLY_S).
PYTHON_REPLY_S = 3.0
C_POLL_S = 3.0
# Rank 0's watchdog reports; where it cannot run (its main thread holds the GIL),
# the deputy does, this long after rank 0 would have: a timed-out call's alarm
# reaches both, and the deputy stands down once rank 0 asks it for its stacks.
DEPUTY = 1
DEPUTY_AFTER_S = PYTHON_REPLY_S + 2 * POLL_S
# The pipe faulthandler writes into: a dump of all threads is a few KiB; the
# write end does not block, so that a full pipe cannot stall the signal handler.
_PIPE_BYTES = 1 << 20
# On the watchdog's own communicator, where no user message meets them: the
# watchdogs' messages (pickled), and rank 0's requests to _stacks's threads and
# their replies (text).
_TAG = 31_415
_TAG_ASK_C, _TAG_REPLY_C = _TAG + 1, _TAG + 2


@dataclass
class _State:
    rank: int = 0
    size: int = 1
    stacks: bool = False  # SIGUSR1 registered
    writer: object = None  # the _stacks module, its thread started
    timeout_s: float | None = None  # the job's (rank 0's) once bootstrapped
    hang_timeout_s: float | None = None  # likewise
    bootstrapped: bool = False
    watchdog: _Watchdog | None = None
    # The communicators the compiled ops know (mpi4jax_dist.ops.common.Comm), in
    # order of registration.
    comms: list = field(default_factory=list)
    # The extension modules loaded (_ffi's CPU and CUDA ones), as configured.
    modules: list = field(default_factory=list)
    # Other records of the calls this process is in: (in_flight, C reader)
    # pairs (JAX's collectives over MPI, mpi4jax_dist.xla_mpi.record()).
    records: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


def timeout_s() -> float | None:
    """The collective timeout in force: the job's once bootstrapped (rank 0's
    setting), this process's ``MPI4JAX_DIST_COLLECTIVE_TIMEOUT`` before."""
    if _state.bootstrapped:
        return _state.timeout_s
    return _config.collective_timeout()


def hang_timeout_s() -> float | None:
    """The job's hang timeout once bootstrapped (rank 0's setting), or None."""
    return _state.hang_timeout_s if _state.bootstrapped else None


def install(
    rank: int,
    size: int,
    timeout: float | None,
    comm=None,
    hang_timeout: float | None = None,
) -> None:
    """Install what this module does in a bootstrapped process (once): the stacks
    on ``SIGUSR1``, the job's collective timeout, and with ``comm`` (the watchdog's
    communicator, from the bootstrap) the watchdog thread, which also keeps the
    hang timeout where one is set."""
    with _state.lock:
        if _state.bootstrapped:
            return
        _state.rank, _state.size = rank, size
        _state.timeout_s, _state.bootstrapped = timeout, True
        _state.hang_timeout_s = hang_timeout
    _start_writer()
    if comm is not None and (timeout is not None or hang_timeout is not None):
        _state.watchdog = _Watchdog(comm, hang_timeout)
        _state.watchdog.start()
        atexit.register(_state.watchdog.stop)
        if _state.writer is not None:  # rank 0's too: the deputy may ask it
            signum = signal.SIGUSR1 if _state.stacks else 0
            _state.writer.answer(
                comm.py2f(), signum, _TAG_ASK_C, _TAG_REPLY_C, C_POLL_S
            )
    elif hang_timeout is not None and size > 1:
        if _compat.coordination_counters():
            # Below MPI_THREAD_MULTIPLE: the hang timeout without MPI.
            _state.watchdog = _ServiceWatchdog(rank, size, hang_timeout)
            _state.watchdog.start()
        elif rank == 0:
            logger.warning(
                "mpi4jax_dist: %s is not in force: below MPI_THREAD_MULTIPLE it needs "
                "jaxlib 0.7.2 or newer (the counters of JAX's coordination service).",
                _config.HANG_TIMEOUT,
            )
    configure_loaded_modules()


def configure(module) -> None:
    """Give an extension module the collective timeout, once (the compiled ops call
    it when they load one; :func:`install` sets it again for the ones loaded
    before the bootstrap)."""
    with _state.lock:
        if module in _state.modules:
            return
        _state.modules.append(module)
    _apply(module)


def _apply(module) -> None:
    module.set_collective_timeout(
        timeout_s() or 0.0, _state.watchdog is not None, _state.stacks
    )
    if _state.writer is not None:  # its replies quote the module's record
        _state.writer.set_in_flight(module.in_flight_reader())


def configure_loaded_modules() -> None:
    for module in _loaded_modules():
        _apply(module)


def _loaded_modules() -> list:
    """The extension modules ``_ffi`` has loaded (each passed to :func:`configure`)."""
    with _state.lock:
        return list(_state.modules)


def quote_record(in_flight, reader: int) -> None:
    """Quote another record of the calls this process is in, beside the
    extensions' (XLA's collectives over MPI: :func:`mpi4jax_dist.xla_mpi.record`):
    ``in_flight()`` its text for :func:`calls_in_flight`, ``reader`` the address
    of its C reader, for the replies of a rank whose Python cannot run."""
    with _state.lock:
        _state.records.append((in_flight, reader))
    if _state.writer is not None:
        _state.writer.set_in_flight(reader)


def calls_in_flight() -> str:
    """The collectives this process is in (entered, not yet returned), as the
    records say: the package's (``allreduce #5 SUM float32[4] at step.py:12 in
    body``) and XLA's over MPI (``XLA's MPI_Allreduce #3 SUM float32[4] on 2
    ranks``), several joined by ``; ``; "" when none."""
    with _state.lock:
        texts = [in_flight for in_flight, _ in _state.records]
    texts += [m.in_flight for m in _loaded_modules()]
    return "; ".join(filter(None, (in_flight() for in_flight in texts)))


def note_comm(comm) -> None:
    """Remember a communicator the compiled ops were given (an ``ops.common.Comm``),
    so that a timeout's report can name it and find its count on every rank."""
    with _state.lock:
        _state.comms.append(comm)


def reported_elsewhere(exc: BaseException) -> bool:
    """Whether ``exc`` is the error of a call the ranks disagreed on whose report
    another rank prints for the job (the communicator's rank 0): every rank
    raises the same report, and one copy in the log is enough."""
    text = str(exc)
    for module in _loaded_modules():
        last = module.disagreement()
        if last is not None and last[1] in text:
            return not last[0]
    return False


# --- stacks ---------------------------------------------------------------------------


def _start_writer() -> None:
    """Start ``_stacks``'s thread (C: it needs no GIL), which writes each dump that
    faulthandler writes into its pipe, and register faulthandler on SIGUSR1 to
    write there (unless the program handles SIGUSR1, or ``MPI4JAX_DIST_STACKS=0``)."""
    from .. import _ffi

    try:
        writer = _ffi.load_stacks()
    except ImportError as err:
        logger.warning("mpi4jax_dist: no stacks will be written: %s", err)
        return
    read_fd, write_fd = os.pipe()
    try:
        import fcntl

        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass  # the default 64 KiB pipe still holds a dump of a few threads
    os.set_blocking(write_fd, False)
    directory = _config.hang_dir()
    main = threading.main_thread().ident or 0
    writer.start(
        read_fd, _state.rank, _state.size, directory or "", socket.gethostname(), main
    )
    _state.writer = writer
    if not _config.stacks_on_signal():
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        logger.info(
            "mpi4jax_dist: SIGUSR1 has a handler of the program's own: no stacks "
            "on SIGUSR1 (%s=0 silences this).",
            _config.STACKS,
        )
        return
    # MPICH's MPI_Init installs a C handler of its own for SIGUSR1 (its process
    # failure notices): called after the dump. Chaining to the default action
    # instead would end the process.
    chain = _caught_in_c(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=write_fd, all_threads=True, chain=chain)
    _state.stacks = True


def watch_interrupts(grace_s: float) -> bool:
    """Have ``_stacks``'s thread end the job where a SIGINT (Ctrl-C) finds the main
    thread in C and Python does not run within ``grace_s``: the rank's stacks
    written, one line, ``MPI_Abort`` (status 130). Return whether it watches."""
    if _state.writer is None:
        return False
    signum = signal.SIGUSR1 if _state.stacks else 0
    try:
        _state.writer.watch_interrupts(signum, grace_s)
    except (OSError, RuntimeError) as err:
        logger.warning("mpi4jax_dist: Ctrl-C is not watched from C: %s", err)
        return False
    return True


def _caught_in_c(signum: int) -> bool:
    """Whether a handler not Python's catches ``signum`` (Linux's SigCgt)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def dump(reason: str) -> str | None:
    """Write this process's stacks now (all threads), as ``SIGUSR1`` does; return
    where they went (``MPI4JAX_DIST_HANG_DIR`` or ``stderr``), None where no
    stacks are written."""
    if _state.writer is None:
        return None
    with tempfile.TemporaryFile() as file:
        faulthandler.dump_traceback(file=file, all_threads=True)
        file.seek(0)
        text = file.read().decode(errors="replace")
    return _state.writer.write(text, reason)


# --- the watchdog ---------------------------------------------------------------------


class _Watchdog(threading.Thread):
    """Every rank's thread for the collective and hang timeouts (docs/design.rst)."""

    def __init__(self, comm, hang_timeout_s: float | None = None):
        super().__init__(name="mpi4jax_dist-watchdog", daemon=True)
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._stopping = threading.Event()
        self._alarm_sent = False
        self._reporting = False
        self.hang_timeout_s = hang_timeout_s
        self.progress = progress.Progress()
        self.period_s = progress.period_s(hang_timeout_s or 0.0, POLL_S)
        self.verdict = progress.Verdict(comm, self.period_s) if hang_timeout_s else None
        self._urgent = False
        self._sent: list = []  # this rank's alarm, sent without waiting
        # At exit, with the hang timeout: this rank stays in the verdicts as one
        # that has reached its exit until every rank stops (chain_ended).
        self._exiting = threading.Event()
        self._chain_ended = threading.Event()
        # The deputy: an alarm rank 0 has not acted on yet, and when it came.
        self._deputy_alarm: tuple[dict, float] | None = None

    def stop(self) -> None:
        """Stop polling before MPI is finalized (an atexit handler). With the hang
        timeout this rank first stays in the verdicts, as stuck at its exit, and
        answers rank 0, until every rank stops (no reduction is then left pending
        at ``MPI_Finalize``) or a verdict ends the job naming it: others waiting
        in a collective for this rank are a hang, and it is named as exited."""
        if (
            self.verdict is not None
            and self.is_alive()
            and threading.current_thread() is not self
        ):
            self._exiting.set()
            while self.is_alive() and not self._chain_ended.wait(POLL_S):
                pass
        self._stopping.set()
        if _state.writer is not None:
            _state.writer.stop_answering()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=POLL_S + 2)
        if (
            self.verdict is not None
            and not self.is_alive()
            and not self._chain_ended.is_set()
        ):
            self.verdict.finish(deadline_s=max(10.0, 3 * self.period_s))

    def run(self) -> None:
        from mpi4py import MPI

        while not self._stopping.wait(self._wait_s()):
            try:
                status = MPI.Status()
                message = self.comm.improbe(MPI.ANY_SOURCE, _TAG, status)
                while message is not None:
                    self._urgent = True
                    self._handle(message.recv(), status.Get_source())
                    message = self.comm.improbe(MPI.ANY_SOURCE, _TAG, status)
                if not self._alarm_sent:
                    alarm = _local_alarm()
                    if alarm is not None:
                        self._alarm_sent = self._urgent = True
                        alarm["rank"] = self.rank
                        if self.rank == 0:
                            self._report(alarm)
                        else:
                            # Not waited for: this thread must go on answering
                            # rank 0, which may be asking already.
                            self._sent.append(self.comm.isend(alarm, dest=0, tag=_TAG))
                            if self.rank == DEPUTY:
                                self._deputy_alarm = (alarm, time.monotonic())
                            else:
                                self._sent.append(
                                    self.comm.isend(alarm, dest=DEPUTY, tag=_TAG)
                                )
                if (
                    self._deputy_alarm is not None
                    and not self._reporting
                    and time.monotonic() - self._deputy_alarm[1] >= DEPUTY_AFTER_S
                ):
                    self._report(self._deputy_alarm[0])  # rank 0 did not
                if self.verdict is not None and not self._reporting:
                    if self._exiting.is_set():
                        if self._watch_at_exit(time.monotonic()):
                            return
                    else:
                        self._watch_progress(time.monotonic())
            except Exception as err:  # a watchdog that dies says why
                if not self._stopping.is_set():
                    logger.error("mpi4jax_dist: the watchdog stopped: %s", err)
                return

    def _wait_s(self) -> float:
        if self._urgent:
            return URGENT_POLL_S
        if self.verdict is None:
            return POLL_S
        return self.verdict.wait_s(time.monotonic(), time.time(), POLL_S, URGENT_POLL_S)

    def _watch_progress(self, now: float) -> None:
        """The hang timeout: look at the main thread, read the last verdict, post
        the next one when a period starts."""
        self.progress.look(now)
        stuck_s = self.progress.stuck_for(now)
        result = self.verdict.test()
        if result is not None and result["all_stuck"]:
            if not result["one_place"]:
                self._urgent = True  # rank 0 asks for the stacks now
                if self.rank == 0:
                    self._report_hang(stuck_s)
                return  # the others wait for rank 0's request for their stacks
            if self.rank == 0:
                _say_one_long_step(self.hang_timeout_s)
        wall = time.time()
        if self.verdict.due(wall):
            stuck = stuck_s >= self.hang_timeout_s
            place = (
                progress.place_key(self.progress.place(), calls_in_flight())
                if stuck
                else 0
            )
            self.verdict.post(now, wall, stuck, place)
        elif (
            self.verdict.pending
            and stuck_s >= self.hang_timeout_s
            and self._reports_late(now)
        ):
            # A rank has not taken part for longer than the timeout: its watchdog
            # cannot run (a thread holding the GIL, a stopped process).
            self._report_hang(stuck_s)

    def _watch_at_exit(self, now: float) -> bool:
        """The hang timeout at this rank's exit: post that it is stuck at its exit
        and stopping, at once whenever none is pending; return True once every
        rank stops. Ranks that wait elsewhere for the timeout make a hang verdict
        (not all at one place), which rank 0 reports."""
        result = self.verdict.test()
        if result is not None:
            if result["all_stopping"]:
                self._chain_ended.set()
                return True
            if result["all_stuck"] and not result["one_place"]:
                self._urgent = True
                if self.rank == 0:
                    self._report_hang(self.progress.stuck_for(now))
                return False  # the others wait for rank 0's request for stacks
        if not self.verdict.pending:
            self.verdict.post(now, time.time(), True, _EXITED_PLACE, stopping=True)
        elif self._reports_late(now):
            # A rank has not taken part for longer than the timeout (a thread
            # holding its GIL, a stopped process): rank 0 reports.
            self._report_hang(self.progress.stuck_for(now))
        return False

    def _reports_late(self, now: float) -> bool:
        """Whether this rank reports a verdict pending for longer than the timeout:
        rank 0, and the deputy ``DEPUTY_AFTER_S`` later (rank 0's watchdog may be
        the one that cannot run)."""
        late = now - self.verdict.posted_at - self.hang_timeout_s
        late -= self.verdict.late_s(POLL_S)
        if self.rank == 0:
            return late >= 0
        return self.rank == DEPUTY and late >= DEPUTY_AFTER_S

    def _handle(self, message: dict, source: int) -> None:
        kind = message.get("kind")
        if kind == "alarm" and self.rank == 0 and not self._reporting:
            self._report(message)
        elif kind == "alarm" and self.rank == DEPUTY and self._deputy_alarm is None:
            self._deputy_alarm = (message, time.monotonic())
        elif kind == "dump":
            # Rank 0 (or the deputy) reports: this rank posts no verdict more.
            self._reporting = True
            reply = {
                "kind": "reply",
                "rank": self.rank,
                "count": _count_of(message["group"]),
                "where": dump(message["reason"]),
                **_standing(self.progress, self._exiting.is_set()),
            }
            self.comm.send(reply, dest=source, tag=_TAG)

    def _ask_every_rank(self, reason: str, group) -> tuple[dict, set]:
        """Rank 0 (or the deputy): ask every other rank for its stacks, count and
        place; the ranks whose Python has not answered in ``PYTHON_REPLY_S``, the
        C way (their stacks and place only). Return the replies by rank (this
        one's included) and where the stacks went, after at most ``REPLY_S``."""
        from mpi4py import MPI

        ask = {"kind": "dump", "reason": reason, "group": group}
        others = [r for r in range(self.size) if r != self.rank]
        requests = [self.comm.isend(ask, dest=r, tag=_TAG) for r in others]
        replies = {
            self.rank: {
                "count": _count_of(group),
                **_standing(self.progress, self._exiting.is_set()),
            }
        }
        where = {dump(reason)}
        start = time.monotonic()
        asked_c = False
        while len(replies) < self.size and time.monotonic() < start + REPLY_S:
            if not asked_c and time.monotonic() >= start + PYTHON_REPLY_S:
                asked_c = True
                text = reason.encode()
                for r in others:
                    if r not in replies:
                        requests.append(
                            self.comm.Isend([text, MPI.CHAR], dest=r, tag=_TAG_ASK_C)
                        )
            status = MPI.Status()
            message = self.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if message is None:
                time.sleep(1e-3)
                continue
            if status.Get_tag() == _TAG_REPLY_C:
                data = bytearray(status.Get_count(MPI.CHAR))
                message.Recv([data, MPI.CHAR])
                held = _held_reply(data.decode(errors="replace"))
                replies.setdefault(status.Get_source(), held)
                where.add(held["where"])
                continue
            reply = message.recv()
            if reply.get("kind") == "reply":
                replies[reply["rank"]] = reply
                where.add(reply["where"])
        del requests  # eager sends; MPI_Abort ends them
        return replies, where

    def _report(self, alarm: dict) -> None:
        """Rank 0: ask every rank for its stacks and count, say who is missing, and
        end the job (never returns)."""
        from .. import _mpi

        self._reporting = True
        reason = (
            f"rank {alarm['rank']}'s {alarm['who']} waited {alarm['waited_s']:.3g} s "
            f"({_config.COLLECTIVE_TIMEOUT})"
        )
        replies, where = self._ask_every_rank(reason, alarm["group"])
        logger.critical("%s", report_line(alarm, replies, self.size, where))
        _mpi.abort(self.comm, 1)

    def _report_hang(self, stuck_s: float) -> None:
        """Rank 0: every rank's stacks, the ranks grouped by where they stand (the
        odd ones out first), and the end of the job (never returns)."""
        from .. import _mpi

        self._reporting = True
        reason = f"no progress for {stuck_s:.3g} s ({_config.HANG_TIMEOUT})"
        replies, where = self._ask_every_rank(reason, None)
        logger.critical("%s", hang_report(replies, self.size, stuck_s, where))
        _mpi.abort(self.comm, 1)


# The place of a rank at its exit, in the hang timeout's verdicts.
_EXITED_PLACE = progress.place_key([], "its exit")


def _standing(watched: progress.Progress, exited: bool = False) -> dict:
    """Where this rank's main thread stands, for rank 0's report: its frames,
    innermost first, and their source lines as they read now, and the calls the
    record says it is in; or that it has reached its exit."""
    if exited:
        return {"place": [], "source": [], "call": "", "exited": True}
    place = watched.place()
    return {
        "place": [tuple(f) for f in place],
        "source": stacks.quote(place),
        "call": calls_in_flight(),
    }


@functools.cache
def _say_one_long_step(hang_timeout_s: float) -> None:
    """Rank 0, once: every rank stuck at one place is one long step, not a hang."""
    logger.info(
        "mpi4jax_dist: every rank has stood at one place for %g s or more: one "
        "long step, not taken for a hang (%s).",
        hang_timeout_s,
        _config.HANG_TIMEOUT,
    )


def _held_reply(text: str) -> dict:
    """A reply of a rank's ``_stacks`` thread (where its stacks went, a newline,
    the calls its record says it is in, a newline, the dump) as a watchdog's: its
    main thread's stack for its place (and where that stands, as text), the
    calls, no count."""
    went, _, rest = text.partition("\n")
    calls, _, dump_text = rest.partition("\n")
    _, _, threads = stacks.parse_stacks(dump_text)
    place = threads.get("main", [])
    sources = threads["source"]
    return {
        "count": None,
        "held": True,
        "where": went,
        "call": calls,
        "place": [tuple(f) for f in place],
        "source": [sources.get((f.file, f.line), "") for f in place],
        "stands": stacks.where(place, sources),  # as the reports say it
    }


class _ServiceWatchdog(threading.Thread):
    """The hang timeout where the watchdog may not call MPI (below
    ``MPI_THREAD_MULTIPLE``): the verdict through counters in JAX's coordination
    service (:class:`~mpi4jax_dist.faults.progress.ServiceVerdict`), the request
    for stacks and the replies through its keys, and ``MPI_Abort`` at the end.
    Only a rank that is stuck looks for rank 0's request (once a period); rank 0
    reads the verdict only while it is stuck itself."""

    def __init__(self, rank: int, size: int, hang_timeout_s: float):
        super().__init__(name="mpi4jax_dist-watchdog", daemon=True)
        self.rank, self.size = rank, size
        self.hang_timeout_s = hang_timeout_s
        self.period_s = progress.period_s(hang_timeout_s, POLL_S)
        self.progress = progress.Progress()
        self.verdict = progress.ServiceVerdict(rank, size, self.period_s)
        self.prefix = progress.ServiceVerdict.PREFIX
        self._stopping = threading.Event()
        self._short_since: float | None = None  # rank 0: a rank has not counted
        self._answered = False
        self._counting = False  # counted once: the client is connected

    def stop(self) -> None:
        """Say that this rank stops (so that rank 0 takes a rank that no longer
        counts for one that has ended, not for one that cannot answer)."""
        self._stopping.set()
        if self._counting:
            try:
                _compat.coordination_client().key_value_increment(
                    f"{self.prefix}/stopping", 1
                )
            except Exception:  # the client is shut down: the job ends anyway
                pass

    def run(self) -> None:
        while not self._stopping.wait(POLL_S):
            try:
                self._watch(time.monotonic())
            except Exception as err:  # a watchdog that dies says why
                if not self._stopping.is_set():
                    logger.error("mpi4jax_dist: the watchdog stopped: %s", err)
                return

    def _watch(self, now: float) -> None:
        self.progress.look(now)
        stuck_s = self.progress.stuck_for(now)
        stuck = stuck_s >= self.hang_timeout_s
        place = (
            progress.place_key(self.progress.place(), calls_in_flight()) if stuck else 0
        )
        wall = time.time()
        if not self.verdict.post(wall, stuck, place):
            return  # once a period
        if not self._counting:
            self._counting = True
            # Registered after jax.distributed's shutdown, so run before it.
            atexit.register(self.stop)
        if not stuck:
            self._short_since = None
            return
        if self.rank != 0:
            if not self._answered:
                self._answer()
            return
        result = self.verdict.read(wall, place)
        if not result["all_alive"]:
            if self.verdict.count(f"{self.prefix}/stopping"):
                return  # ranks are ending: not a hang
            self._short_since = self._short_since or now
            if now - self._short_since >= self.hang_timeout_s + self.period_s:
                self._report(stuck_s)  # a rank's watchdog cannot run
            return
        self._short_since = None
        if result["all_stuck"] and not result["one_place"]:
            self._report(stuck_s)
        elif result["all_stuck"]:
            _say_one_long_step(self.hang_timeout_s)

    def _answer(self) -> None:
        """A stuck rank other than 0: rank 0's request for the stacks, if it has
        made one, answered with them, where they went and this rank's place."""
        client = _compat.coordination_client()
        try:
            reason = client.key_value_try_get(f"{self.prefix}/dump")
        except Exception:  # no request
            return
        self._answered = True
        reply = {"rank": self.rank, "where": dump(reason), **_standing(self.progress)}
        client.key_value_set(f"{self.prefix}/reply/{self.rank}", json.dumps(reply))
        client.key_value_increment(f"{self.prefix}/replied", 1)

    def _report(self, stuck_s: float) -> None:
        """Rank 0: ask for every rank's stacks and place, print the report and
        end the job (never returns)."""
        from mpi4py import MPI

        from .. import _mpi

        client = _compat.coordination_client()
        reason = f"no progress for {stuck_s:.3g} s ({_config.HANG_TIMEOUT})"
        client.key_value_set(f"{self.prefix}/dump", reason)
        replies = {0: _standing(self.progress)}
        where = {dump(reason)}
        deadline = time.monotonic() + REPLY_S + self.period_s
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
            "%s", hang_report(replies, self.size, stuck_s, where, silent, self.period_s)
        )
        _mpi.abort(MPI.COMM_WORLD, 1)


def hang_report(
    replies: dict,
    size: int,
    stuck_s: float,
    where: set,
    silent_why: str = "stopped, or its MPI stuck",
    waited_s: float = 0.0,
) -> str:
    """The hang timeout's report: one line per place the ranks stand at, the odd
    ones out first, then the ranks that did not answer (``silent_why``: why a rank
    may not, after ``REPLY_S`` and ``waited_s`` more) and where the stacks are."""
    groups: dict = {}
    sources: dict = {}
    exited = sorted(r for r, reply in replies.items() if reply.get("exited"))
    for rank, reply in sorted(replies.items()):
        if reply.get("exited"):
            continue
        frames = tuple(stacks.Frame(*f) for f in reply["place"])
        groups.setdefault((frames, reply.get("call", "")), []).append(rank)
        for frame, text in zip(frames, reply["source"], strict=True):
            if text:
                sources.setdefault((frame.file, frame.line), text)
    lines = [
        f"mpi4jax_dist: no rank of {size} made progress for {stuck_s:.3g} s "
        f"({_config.HANG_TIMEOUT}), and they do not all stand at one place: the "
        f"job is hung. Where the ranks stand, the odd ones out first:"
    ]
    silent = [r for r in range(size) if r not in replies]
    if silent:
        lines.append(
            f"  no answer from {ranks_text(silent)} in {REPLY_S + waited_s:g} s "
            f"({silent_why}): where it stands is unknown"
        )
    if exited:
        lines.append(
            f"  {ranks_text(exited)} reached {'its' if len(exited) == 1 else 'their'} "
            f"exit (the end of the program, or sys.exit): in no collective, waiting "
            f"at exit for the others"
        )
    held = sorted(r for r, reply in replies.items() if reply.get("held"))
    if held:
        lines.append(
            f"  {ranks_text(held)} answered from C only (a thread holds the GIL): "
            f"placed below by the stacks written then"
        )
    lines += [
        "  " + line
        for line in stacks.group_lines(groups, sources, odd_first=True, by_call=True)
    ]
    whose = "The stacks of the ranks that answered" if silent else "Every rank's stacks"
    if went := _stacks_went(where):
        lines.append(f"{whose}: {went}.")
    return "\n".join(lines) + "\nMPI_Abort ends the job."


def _stacks_went(where: set) -> str | None:
    """Where the ranks wrote their stacks, for a report: ``on stderr, as [rank N]
    lines`` or ``in DIR (python -m mpi4jax_dist --hangs DIR)``."""
    places = sorted(w for w in where if w)
    if places == ["stderr"]:
        return "on stderr, as [rank N] lines"
    shown = [p for p in places if p != "stderr"]
    if not shown:
        return None
    return f"in {', '.join(shown)} (python -m mpi4jax_dist --hangs {shown[0]})"


def _local_alarm() -> dict | None:
    """This process's first timed-out call (from any loaded extension), as the
    message for rank 0, or None."""
    for module in _loaded_modules():
        alarm = module.alarm()
        if alarm is None:
            continue
        who, comm_id, call, waited_s = alarm
        comm = _comm_of(module, comm_id)
        group = _group_of(comm) if comm is not None else None
        return {
            "kind": "alarm",
            "who": who,
            "call": call,
            "waited_s": waited_s,
            "group": group,
            "comm": _describe(comm),
        }
    return None


def _comm_of(module, comm_id: int):
    with _state.lock:
        comms = list(_state.comms)
    for comm in comms:
        if comm._ids.get(module.__name__) == comm_id:
            return comm
    return None


def _group_of(comm) -> tuple:
    """A communicator as every rank can name it: (CRC of its group's world ranks,
    its size, its place among the noted communicators of that group)."""
    ranks = _world_ranks(comm.comm)
    crc = zlib.crc32(b"".join(r.to_bytes(4, "little") for r in ranks))
    with _state.lock:
        comms = list(_state.comms)
    same = [c for c in comms if c.comm.Get_size() == len(ranks)]
    place = 0
    for other in same:
        if other is comm:
            break
        if _world_ranks(other.comm) == ranks:
            place += 1
    return (crc, len(ranks), place, ranks if len(ranks) < _state.size else None)


def _world_ranks(comm) -> list[int]:
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in group.Translate_ranks(None, world)]
    finally:
        group.Free()
        world.Free()


def _count_of(group) -> int | None:
    """This rank's count of calls entered on the communicator ``group`` names (0
    where it has none, or never called on it; None when the alarm named none)."""
    if group is None:
        return None
    crc, size, place = group[:3]
    with _state.lock:
        comms = list(_state.comms)
    matches = []
    for comm in comms:
        try:
            ranks = _world_ranks(comm.comm)
        except Exception:  # freed since
            continue
        if (
            len(ranks) == size
            and zlib.crc32(b"".join(r.to_bytes(4, "little") for r in ranks)) == crc
        ):
            matches.append(comm)
    if place >= len(matches):
        return 0
    comm = matches[place]
    total = 0
    for module in _loaded_modules():
        comm_id = comm._ids.get(module.__name__)
        if comm_id is not None:
            counts = module.call_counts()
            if 0 < comm_id <= len(counts):
                total += counts[comm_id - 1]
    return total


def _describe(comm) -> str:
    if comm is None:
        return "a communicator"
    name = comm.comm.Get_name()
    size = comm.comm.Get_size()
    return (
        f"communicator {name!r} ({size} ranks)"
        if name
        else (f"a communicator of {size} ranks")
    )


def report_line(alarm: dict, replies: dict, size: int, where: set) -> str:
    """The one line of a timeout: the call, its communicator, the ranks that had not
    entered it, those that answered from C only, and those that did not answer."""
    group = alarm.get("group")
    members = range(size) if group is None or group[3] is None else group[3]
    call = alarm["call"]
    counts = {r: reply["count"] for r, reply in replies.items()}
    missing = [r for r in members if counts.get(r) is not None and counts[r] < call]
    held = sorted(r for r, reply in replies.items() if reply.get("held"))
    silent = [r for r in range(size) if r not in replies]
    line = (
        f"mpi4jax_dist: rank {alarm['rank']} of {size} waited "
        f"{alarm['waited_s']:.3g} s in {alarm['who']}, call {call} on "
        f"{alarm['comm']} ({_config.COLLECTIVE_TIMEOUT}); "
    )
    if missing:
        last = sorted({counts[r] for r in missing})
        line += (
            f"not entered by {ranks_text(missing)} (their last call there: "
            f"{', '.join(str(c) for c in last[:5])})"
        )
    elif held or silent:
        line += "entered by every rank that could say"
    else:
        line += "every rank had entered it"
    if held:
        line += (
            f"; {ranks_text(held)} answered from C only (a thread holds the GIL), "
            f"so whether each entered is unknown: rank {held[0]} stands "
            f"{replies[held[0]]['stands']}"
        )
    if silent:
        line += (
            f"; no answer from {ranks_text(silent)} in {REPLY_S:g} s (stopped, or "
            f"its MPI stuck)"
        )
    if went := _stacks_went(where):
        line += f"; every rank's stacks: {went}"
    return line + ". MPI_Abort ends the job."
