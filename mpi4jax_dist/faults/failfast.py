"""When one rank fails, the whole job ends: an uncaught exception in any thread, a
non-zero ``sys.exit`` and the launcher's SIGTERM end every rank with
``MPI_Abort``, where JAX's atexit barrier and preemption service would leave the
others waiting; ``os._exit`` waits for the other ranks to reach their exit, or
ends the job non-zero. :func:`install` sets it up in a bootstrapped world of more
than one process (``MPI4JAX_DIST_FAIL_FAST=0``: off). docs/faults.rst, *When a
rank fails*. Python's functions replaced here (``sys.excepthook``,
``threading.excepthook``, ``sys.exit``, ``os._exit``) are in the table of
docs/replacements.rst, with what would make each unnecessary.
"""

from __future__ import annotations

import atexit
import dis
import functools
import os
import sys
import threading
import time
import traceback
import typing
from dataclasses import dataclass

from .. import _compat, _config, _mpi
from . import hangs

# MPI_Abort's error code for a KeyboardInterrupt: what a shell reports for SIGINT
# (and what python -m mpi4py uses).
_SIGINT_CODE = 128 + 2
# How long a rank whose error another rank reports waits for that rank's
# MPI_Abort before it ends the job itself.
_QUIET_S = 10.0
# How long a SIGINT may find Python not running (its main thread waits in C)
# before the job ends without it.
SIGINT_GRACE_S = 2.0
# How long os._exit waits for every rank to reach its exit (the hang timeout
# where one is set), and how long the end of the program waits for them before
# it goes on as it would have (to JAX's own shutdown and MPI_Finalize, which
# wait for them too).
_OS_EXIT_WAIT_S = 60.0
_END_WAIT_S = 300.0
# The barrier of JAX's coordination service that every rank's exit passes.
_EXIT_BARRIER = "mpi4jax_dist/exit"


@dataclass
class _State:
    installed: bool = False
    rank: int = 0
    size: int = 1
    # The non-zero SystemExit the main thread raised last through sys.exit.
    exiting: SystemExit | None = None
    previous_excepthook: object = None
    previous_thread_excepthook: object = None
    original_exit: object = None
    original_os_exit: object = None
    pid: int = 0  # the rank's process (a forked child calls os._exit too)
    # Whether this process has been to the exit barrier (once only).
    at_exit_barrier: bool = False


_state = _State()


class JobError(RuntimeError):
    """An error every rank of the job raises alike, because rank 0 decided it and
    told the others (a bad setting, no coordinator address): uncaught, only rank 0
    prints it (:func:`quiet_on_other_ranks`); every rank exits with status 1."""


class JobValueError(JobError, ValueError):
    """A :class:`JobError` for a bad value (a setting rank 0 rules for the job)."""


# What follows a JobError's one line: how to see where it was raised.
_WHERE = "python -X dev or PYTHONDEVMODE=1 prints the traceback"


def quiet_on_other_ranks(rank: int) -> None:
    """Leave an uncaught :class:`JobError` to rank 0 to print, as one line (its
    message names the variable and the fix; the traceback, through JAX's frames,
    under ``-X dev``): at 10^4 ranks the same traceback from every rank is 10^4
    tracebacks in the job's log. Any other exception prints as it would (a
    rank's own failure names its rank). Once per process, before the
    bootstrap's first collective."""
    previous = sys.excepthook
    if getattr(previous, "quiet_rank", None) is not None:
        previous.quiet_rank = rank
        return

    def hook(kind, value, tb):
        if isinstance(value, JobError):
            if hook.quiet_rank != 0:
                return  # rank 0 prints it for the job; the status is 1 all the same
            if not sys.flags.dev_mode:  # the error says what and how to fix it
                sys.stderr.write(f"mpi4jax_dist: {value} ({_WHERE})\n")
                return
        previous(kind, value, tb)

    hook.quiet_rank, hook.wrapped = rank, previous
    sys.excepthook = hook


def install(rank: int, size: int) -> bool:
    """Make a failing rank end the job (docs/faults.rst); return whether
    the hooks are in place. Runs once per process; does nothing for a world of
    one process or when ``MPI4JAX_DIST_FAIL_FAST=0``."""
    if _state.installed or size < 2 or not _config.fail_fast():
        return _state.installed
    _state.rank, _state.size = rank, size
    if not _config.jax_preemption_requested():
        _compat.disable_preemption_service()
    # The hook before quiet_on_other_ranks' (the bootstrap's JobErrors are past).
    previous = sys.excepthook
    while getattr(previous, "quiet_rank", None) is not None:
        previous = previous.wrapped
    _state.previous_excepthook = previous
    _state.previous_thread_excepthook = threading.excepthook
    _state.original_exit = sys.exit
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    sys.exit = _exit
    _state.original_os_exit, _state.pid = os._exit, os.getpid()
    os._exit = _os_exit
    atexit.register(_meet_at_exit)
    _state.installed = True
    return True


def watch_interrupts() -> bool:
    """Where fail-fast is installed: one Ctrl-C ends the job even where every rank
    waits in C, where Python would raise KeyboardInterrupt only once it runs
    again (:func:`mpi4jax_dist.faults.writer.watch_interrupts`); after the stacks
    are set up (the writer's thread)."""
    return _state.installed and hangs.watch_interrupts(SIGINT_GRACE_S)


def report() -> dict:
    """Return what is in force in this process (or will be once JAX initializes
    through this package), for the diagnostics."""
    enabled = _config.fail_fast()
    if _state.installed:
        jax_catches = bool(_compat.preemption_service())
    else:
        jax_catches = not enabled or _config.jax_preemption_requested()
    return {
        "abort_on_failure": enabled,
        "installed": _state.installed,
        "sigterm": (
            "caught by JAX's preemption service"
            if jax_catches
            else "default action (the process ends)"
        ),
        "settings": {
            name: _config.environ().get(name)
            for name in (_config.FAIL_FAST, _config.JAX_PREEMPTION)
        },
    }


# --- the hooks ----------------------------------------------------------------------


def _excepthook(exc_type, exc, tb) -> None:
    code = _SIGINT_CODE if issubclass(exc_type, KeyboardInterrupt) else 1
    if hangs.reported_elsewhere(exc):
        # Every rank raises the same report of a call the ranks disagree on:
        # the rank that reports it prints it and ends the job. Wait for that
        # (printing nothing), then end it here should that rank not.
        time.sleep(_QUIET_S)
        _abort(None, None, code)
    lines = None
    if _state.previous_excepthook is sys.__excepthook__:
        lines = traceback.format_exception(exc_type, exc, tb)
    else:  # the user's own hook, which prints it its way
        _state.previous_excepthook(exc_type, exc, tb)
    _abort(f"uncaught {exc_type.__name__}", lines, code)


def _thread_excepthook(args) -> None:
    if issubclass(args.exc_type, SystemExit):  # ends its thread only, as in Python
        return
    lines = None
    if _state.previous_thread_excepthook is threading.__excepthook__:
        lines = traceback.format_exception(
            args.exc_type, args.exc_value, args.exc_traceback
        )
    else:
        _state.previous_thread_excepthook(args)
    name = args.thread.name if args.thread is not None else "?"
    _abort(f"uncaught {args.exc_type.__name__} in thread {name!r}", lines, 1)


@functools.wraps(sys.exit)
def _exit(status=None):
    try:
        _state.original_exit(status)
    except SystemExit as exc:
        if threading.current_thread() is threading.main_thread():
            _state.exiting = exc if _exit_code(exc) else None
            if _state.exiting is not None:
                # Registered last, so called first: before JAX's clean_up.
                atexit.unregister(_at_exit)
                atexit.register(_at_exit)
        raise


def _os_exit(status):
    """``os._exit`` in a job of several processes. The launcher ends the other
    ranks with this one and returns its status (MPICH's Hydra: ``os._exit(0)`` on
    one rank ended the job with status 0 and the others' work undone), so it
    first waits for every rank to reach its exit (the others' ``os._exit`` or the
    end of their program); where they do not in time, it ends the job non-zero,
    naming this rank. Where they do, it leaves as a rank that ends its program
    does (:func:`_leave`), so that the launcher does not kill the others while
    they finish."""
    if os.getpid() != _state.pid:  # a forked child (multiprocessing's end)
        _state.original_os_exit(status)
    # The hang timeout where one is set (steps that long may keep the others from
    # their exit); its default, ten minutes, is not what a rank that leaves waits.
    set_s = hangs.hang_timeout_s() if _config.hang_timeout_set() else None
    wait_s = set_s or _OS_EXIT_WAIT_S
    hangs.at_exit()
    if _every_rank_at_exit(wait_s) is False:
        _abort(
            f"os._exit({status!r}) while other ranks had not reached their exit "
            f"in {wait_s:g} s (the launcher would have ended them with this rank, "
            f"with status {status!r})",
            None,
            _failed_status(status),
        )
    _leave(status)
    _state.original_os_exit(status)


def _leave(status) -> None:
    """What the end of a program does for the job, without the program's atexit
    handlers: stop the watchdog, leave JAX's coordination service (whose shutdown
    barrier the others wait at) and finalize MPI. A rank gone without
    ``MPI_Finalize`` is a failure to the launchers: MPICH's Hydra then SIGKILLs
    the ranks still finishing (status 9 or 0 by the race), Open MPI's returns 1
    and Intel MPI's 255. Where a step fails, the others could wait at JAX's
    shutdown barrier for minutes: the job ends with ``MPI_Abort``, naming why."""
    import jax
    from mpi4py import MPI

    try:
        hangs.stop()
        jax.distributed.shutdown()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    except Exception as exc:
        _abort(
            f"os._exit({status!r}): its clean-up failed ({type(exc).__name__}: {exc})",
            None,
            _failed_status(status),
        )


def _failed_status(status) -> int:
    """The status a job that ``os._exit(status)`` could not end cleanly ends with:
    ``status`` where it is a non-zero int, else 1."""
    return status if isinstance(status, int) and status else 1


def _meet_at_exit() -> None:
    """At the end of the program: meet the ranks that leave by ``os._exit`` at the
    exit barrier (a while at most; then on to JAX's shutdown, as before)."""
    if os.getpid() == _state.pid:
        _every_rank_at_exit(_END_WAIT_S)


def _every_rank_at_exit(timeout_s: float) -> bool | None:
    """Wait at most ``timeout_s`` for every rank at the exit barrier of JAX's
    coordination service; return whether they all came (None: there is no
    service client, or this process has been there already)."""
    client = _compat.coordination_client()
    if client is None or _state.at_exit_barrier:
        return None
    _state.at_exit_barrier = True
    try:
        client.wait_at_barrier(_EXIT_BARRIER, int(timeout_s * 1000))
    except Exception:  # the deadline passed, or the service has gone
        return False
    return True


def _at_exit() -> None:
    exc = _state.exiting
    if exc is None or not _ended_program(exc):
        return
    _abort(f"sys.exit({exc.code!r})", None, _exit_code(exc))


def _exit_code(exc: SystemExit) -> int:
    """The status Python exits with for ``exc``: 0 for None, the int, else 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    return 1


def _ended_program(exc: BaseException) -> bool:
    """Return whether ``exc`` left the outermost frame that saw it by being raised.

    Python records frames in ``exc.__traceback__`` as the exception passes them, up
    to the frame that caught it (3.11 stops at the last frame that caught it, even
    to raise it again). That frame either ended right where the exception passed,
    or by raising it again (``raise``): then nothing caught it afterwards, and it
    ended the program. A frame that caught it and carried on ended elsewhere.
    """
    tb = exc.__traceback__
    if tb is None:
        return True
    frame = tb.tb_frame
    if frame.f_lasti == tb.tb_lasti:
        return True
    last = next(
        (i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti),
        None,
    )
    return last is not None and last.opname in ("RERAISE", "RAISE_VARARGS")


def _abort(what: str | None, lines, code: int) -> typing.NoReturn:
    """Print ``what`` (and the traceback ``lines``, prefixed with the rank; nothing
    for None) and end the job with ``MPI_Abort(MPI_COMM_WORLD, code)``; never
    returns."""
    from mpi4py import MPI

    rank, size = _state.rank, _state.size
    text = (
        f"mpi4jax_dist: rank {rank} of {size}: {what}; MPI_Abort ends the job "
        f"({_config.FAIL_FAST}=0 turns this off).\n"
        if what
        else ""
    )
    if lines:
        prefix = f"[rank {rank}] "
        text += "".join(prefix + line + "\n" for line in "".join(lines).splitlines())
    try:
        sys.stderr.write(text)
    except Exception:  # a closed stderr must not stop the abort
        pass
    if MPI.Is_finalized():  # no MPI left to abort: end this process alone
        os._exit(code)
    _mpi.abort(MPI.COMM_WORLD, code)
