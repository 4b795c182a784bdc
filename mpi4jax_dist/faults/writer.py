"""The stack writer: ``_ffi/stacks.c``'s thread (C: it needs no GIL), which writes
each dump faulthandler writes into its pipe, on ``SIGUSR1`` and when a watchdog
asks, to ``MPI4JAX_DIST_HANG_DIR/rank-N.txt`` or stderr; it also answers a
watchdog's request from C where this rank's Python cannot run, and watches Ctrl-C."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import tempfile
import threading

from .. import _config

logger = logging.getLogger("mpi4jax_dist")

# The pipe faulthandler writes into: a dump of all threads is a few KiB; the
# write end does not block, so that a full pipe cannot stall the signal handler.
_PIPE_BYTES = 1 << 20


class _Writer:
    module = None  # the _stacks module, its thread started
    on_signal = False  # faulthandler registered on SIGUSR1


_writer = _Writer()


def module():
    """The started ``_stacks`` module, or None where no stacks are written."""
    return _writer.module


def on_signal() -> bool:
    """Whether ``SIGUSR1`` writes this rank's stacks."""
    return _writer.on_signal


def signum() -> int:
    """The signal whose handler writes the stacks, 0 for none (what ``_stacks``'s
    thread sends the main thread for a dump)."""
    return signal.SIGUSR1 if _writer.on_signal else 0


def start(rank: int, size: int) -> None:
    """Start ``_stacks``'s thread and register faulthandler on SIGUSR1 to write
    into its pipe (unless the program handles SIGUSR1, or
    ``MPI4JAX_DIST_STACKS=0``)."""
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
    writer.start(read_fd, rank, size, directory or "", socket.gethostname(), main)
    _writer.module = writer
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
    _writer.on_signal = True


def watch_interrupts(grace_s: float) -> bool:
    """Have ``_stacks``'s thread end the job where a SIGINT (Ctrl-C) finds the main
    thread in C and Python does not run within ``grace_s``: the rank's stacks
    written, one line, ``MPI_Abort`` (status 130). Return whether it watches."""
    if _writer.module is None:
        return False
    try:
        _writer.module.watch_interrupts(signum(), grace_s)
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
    if _writer.module is None:
        return None
    with tempfile.TemporaryFile() as file:
        faulthandler.dump_traceback(file=file, all_threads=True)
        file.seek(0)
        text = file.read().decode(errors="replace")
    return _writer.module.write(text, reason)
