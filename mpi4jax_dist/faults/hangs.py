"""A hung job says which rank and where: each rank's stacks on ``SIGUSR1``
(:mod:`~mpi4jax_dist.faults.writer`), and the collective and hang timeouts, whose
watchdog (:mod:`~mpi4jax_dist.faults.watchdog`) asks every rank for its stacks and
its count of calls (:mod:`~mpi4jax_dist.faults.record`), names the ranks that had
not entered the call or stand apart (:mod:`~mpi4jax_dist.faults.report`), and ends
the job. This module installs them and gives the extensions their settings.
docs/faults.rst, *When a rank hangs*.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field

from .. import _compat, _config
from . import record, writer
from .record import calls_in_flight, note_comm, reported_elsewhere  # noqa: F401
from .stacks import ranks_text  # noqa: F401 (diagnostics' and the tests' name)
from .watchdog import ServiceWatchdog, Watchdog
from .writer import dump, watch_interrupts  # noqa: F401

logger = logging.getLogger("mpi4jax_dist")


@dataclass
class _State:
    timeout_s: float | None = None  # the job's (rank 0's) once bootstrapped
    hang_timeout_s: float | None = None  # likewise
    bootstrapped: bool = False
    watchdog: Watchdog | ServiceWatchdog | None = None
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


def report() -> dict:
    """What ends a job that hangs, as in force in this process (or, before the
    bootstrap, as its settings would make it), for the diagnostics: the hang and
    collective timeouts in seconds (None: off), whether the watchdog runs
    (``"running"``, ``"through JAX's service"`` below ``MPI_THREAD_MULTIPLE``,
    ``"none"``) and whether it ends a standstill (ranks that all wait in calls
    that cannot match)."""
    watchdog = _state.watchdog
    if _state.bootstrapped:
        hang, collective = _state.hang_timeout_s, _state.timeout_s
        still = getattr(watchdog, "still", None) is not None
    else:
        hang, collective = _config.hang_timeout(), _config.collective_timeout()
        still = _config.checks()
    running = {Watchdog: "running", ServiceWatchdog: "through JAX's service"}
    return {
        "hang_timeout_s": hang,
        "hang_timeout_set": _config.hang_timeout_set(),
        "collective_timeout_s": collective,
        "watchdog": running.get(type(watchdog), "none"),
        "bootstrapped": _state.bootstrapped,
        "standstill": still,
    }


def install(
    rank: int,
    size: int,
    timeout: float | None,
    comm=None,
    hang_timeout: float | None = None,
    still_comm=None,
) -> None:
    """Install what this module does in a bootstrapped process (once): the stacks
    on ``SIGUSR1``, the job's collective timeout, and with ``comm`` (the watchdog's
    communicator, from the bootstrap) the watchdog thread, which also keeps the
    hang timeout where one is set and, with ``still_comm`` (a second one), finds
    ranks that all wait in calls that cannot match
    (:mod:`~mpi4jax_dist.faults.standstill`)."""
    with _state.lock:
        if _state.bootstrapped:
            return
        _state.timeout_s, _state.bootstrapped = timeout, True
        _state.hang_timeout_s = hang_timeout
    writer.start(rank, size)
    if comm is not None:
        _state.watchdog = Watchdog(comm, hang_timeout, still_comm)
        _state.watchdog.start()
        atexit.register(_state.watchdog.stop)
    elif hang_timeout is not None and size > 1:
        if _compat.coordination_counters():
            # Below MPI_THREAD_MULTIPLE: the hang timeout without MPI.
            _state.watchdog = ServiceWatchdog(rank, size, hang_timeout)
            _state.watchdog.start()
        elif rank == 0 and _config.hang_timeout_set():
            logger.warning(
                "mpi4jax_dist: %s is not in force: below MPI_THREAD_MULTIPLE it needs "
                "jaxlib 0.7.2 or newer (the counters of JAX's coordination service).",
                _config.HANG_TIMEOUT,
            )
        elif rank == 0:  # its default: said, not warned about
            logger.info(
                "mpi4jax_dist: the hang timeout (%s's default) is not in force: below "
                "MPI_THREAD_MULTIPLE it needs jaxlib 0.7.2 or newer.",
                _config.HANG_TIMEOUT,
            )
    configure_loaded_modules()


def at_exit() -> None:
    """Have the watchdog take this rank as at its exit from now on, as its atexit
    handler does (for ``os._exit``, which runs no atexit handler): the other
    ranks' watchdogs then see it at its exit, and their verdicts and reports say
    so."""
    if isinstance(_state.watchdog, Watchdog):
        _state.watchdog.at_exit()


def stop() -> None:
    """Stop the watchdog as its atexit handler does (for ``os._exit``, which runs
    none)."""
    if _state.watchdog is not None:
        _state.watchdog.stop()


def configure(module) -> None:
    """Give an extension module the collective timeout, once (the compiled ops call
    it when they load one; :func:`install` sets it again for the ones loaded
    before the bootstrap)."""
    if record.add_module(module):
        _apply(module)


def _apply(module) -> None:
    # Only the watchdog over MPI takes a timed-out call's alarm (the one through
    # JAX's service keeps the hang timeout alone): without it the call ends the
    # job itself.
    module.set_collective_timeout(
        timeout_s() or 0.0, isinstance(_state.watchdog, Watchdog), writer.on_signal()
    )
    if writer.module() is not None:  # its replies quote the module's record
        writer.module().set_in_flight(module.in_flight_reader())
        writer.module().set_totals(module.totals_reader())


def configure_loaded_modules() -> None:
    for module in record.modules():
        _apply(module)


def quote_record(in_flight, reader: int) -> None:
    """Quote another record of the calls this process is in, beside the
    extensions' (XLA's collectives over MPI: :func:`mpi4jax_dist.xla_mpi.record`):
    ``in_flight()`` its text for :func:`calls_in_flight`, ``reader`` the address
    of its C reader, for the replies of a rank whose Python cannot run."""
    record.add_record(in_flight)
    if writer.module() is not None:
        writer.module().set_in_flight(reader)
