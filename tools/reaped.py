"""Run a command as the subreaper of what it starts, so that its CPU counts whole.

    .venv/bin/python tools/reaped.py COMMAND [ARG...]

tools/test.sh runs each stage so. A job that ``MPI_Abort`` ends leaves its ranks
to be reaped by someone other than their launcher: without a subreaper, by init,
and their CPU counts for no stage (six such jobs of test_failfast.py: 3.3 CPU-s
counted by the shell, 24 by ``/proc/stat``, 2026-12-08). As the subreaper
(``PR_SET_CHILD_SUBREAPER``, Linux) this process takes them in, reaps them, and
its parent's count of children's CPU then holds theirs.

Exits with the command's status (128 + N where signal N ended it). Once the
command has ended, what it left running is waited for 2 s, then named on stderr
and left (a daemon the stage started, say). Elsewhere than Linux it only runs the
command.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 2.0


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def status_of(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def left_running() -> list[str]:
    """Our children still running: ``name (pid)`` (psutil: the package's own
    dependency: tools/test.sh runs this with .venv's Python)."""
    names = []
    for child in psutil.Process().children():
        try:
            names.append(f"{child.name()} ({child.pid})")
        except psutil.NoSuchProcess:  # ended since
            pass
    return names


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    if not become_subreaper():
        return subprocess.call(argv)
    try:
        command = subprocess.Popen(argv)
    except OSError as err:
        print(f"tools/reaped.py: cannot run {argv[0]}: {err}", file=sys.stderr)
        return 127
    status = None
    try:
        # Reap every child, the command's orphans among them, until the command ends.
        while status is None:
            pid, wait_status = os.wait()
            if pid == command.pid:
                status = status_of(wait_status)
                command.returncode = status  # reaped here, not by Popen
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
    except ChildProcessError:  # none left
        return status
    except KeyboardInterrupt:
        return 130 if status is None else status
    names = left_running()
    if names:
        print(
            f"tools/reaped.py: left running by {argv[0]}: {', '.join(names)}",
            file=sys.stderr,
        )
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
