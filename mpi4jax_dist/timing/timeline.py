"""The timeline of the collectives: when each call entered and left, on every rank.

``MPI4JAX_DIST_TIMELINE=DIR`` times every collective the package records (its
``allreduce`` and ``iallreduce``, and JAX's collectives over MPI through its
wrapper) from ``jax.distributed.initialize()`` to the end of the program, with
the bootstrap's own MPI calls; :func:`start` and :func:`stop` (or ``with
mpi4jax_dist.timeline(DIR):``) time a region. The extension appends each call
to fixed memory (``CAPACITY`` events of 64 bytes; ``_ffi/timeline.h``), written
to the rank's file whenever it fills and at the end; off, a call pays one load.
Each rank writes, in DIR:

- ``rank-NNNNN.events``: the calls, :data:`EVENT` records;
- ``rank-NNNNN.json``: what reads them (:data:`FORMAT`): the rank, the job's size,
  the host, its clock's offset to rank 0's at the start and at the end
  (:mod:`~mpi4jax_dist.diagnostics.clocks`), the names of the call sites and
  communicators, how many events were written and, with the variable, the
  bootstrap's MPI calls (``jax.distributed.initialize()``'s, timed as it made
  them). Written at the start and again
  at the end: a rank that dies keeps the start's, and its events written so far.

``python -m mpi4jax_dist timeline DIR`` merges them
(:mod:`mpi4jax_dist.diagnostics.timeline`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np

from .. import _config
from ..faults.failfast import JobError
from . import clocks

FORMAT = "mpi4jax_dist timeline 1"
# Events held in memory before they go to the file: 4 MiB.
CAPACITY = 1 << 16
# The extension's TimelineEvent (_ffi/timeline.h), as the file holds it.
EVENT = np.dtype(
    [
        ("enter_ns", "=i8"),
        ("wait_ns", "=i8"),
        ("leave_ns", "=i8"),
        ("comm", "=i8"),
        ("seq", "=i8"),
        ("count", "=i8"),
        ("site", "=i8"),
        ("kind", "=i4"),
        ("op", "u1"),
        ("type", "u1"),
        ("state", "u1"),
        ("reserved", "u1"),
    ]
)
assert EVENT.itemsize == 64
# How long the clocks' measurement waits for a rank: at the start every rank is
# there (a collective call); at the end one may have died.
CLOCK_TIMEOUT_S = 10.0


class TimelineError(JobError):
    """The timeline cannot be started or written where it was asked for: every
    rank raises it alike, and rank 0 alone prints it when uncaught."""


class _Run:
    """A timeline being written: this rank's files and what its JSON says."""

    def __init__(self, directory: Path | None, comm, module, what: str):
        self.directory, self.comm, self.module = directory, comm, module
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.fd = None
        # The bootstrap's MPI calls, read at each write (start_from_environment).
        self.bootstrap = None
        self.meta = {
            "format": FORMAT,
            "rank": self.rank,
            "size": self.size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "clock": "CLOCK_MONOTONIC, ns",
            "asked_by": what,
            "event_bytes": EVENT.itemsize,
        }

    def name(self, suffix: str) -> Path:
        return self.directory / f"rank-{self.rank:05d}{suffix}"

    def open(self) -> str | None:
        """Open this rank's events file; return why it cannot be, or None."""
        if self.directory is None:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(
                self.name(".events"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
            )
        except OSError as err:
            return f"{err.strerror or err} ({self.name('.events')})"
        return None

    def write_meta(self) -> None:
        if self.directory is None:
            return
        if self.bootstrap is not None:
            self.meta["bootstrap"] = self.bootstrap()
        path = self.name(".json")
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.meta, indent=1))
        os.replace(partial, path)


_lock = threading.Lock()
_run: _Run | None = None


def _module():
    from .. import _ffi

    return _ffi.load()


def start(
    directory,
    comm=None,
    *,
    what: str = "mpi4jax_dist.timeline.start",
    bootstrap=None,
) -> None:
    """Time every collective from now on, written to ``directory``.

    Collective on ``comm`` (default ``MPI.COMM_WORLD``): every rank calls it.
    Each rank measures its clock against rank 0's (O(log P) rounds).

    Raises:
        TimelineError: a timeline is being written already, or ``directory``
            cannot be written on some rank (every rank raises it alike).
    """
    global _run
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    with _lock:
        if _run is not None:
            raise TimelineError(
                f"a timeline is being written already (to {_run.directory}): "
                "stop it first (mpi4jax_dist.timeline.stop())"
            )
        own = comm.Dup()
        folder = None if directory is None else Path(directory)
        run = _Run(folder, own, _module(), what)
        run.bootstrap = bootstrap
        problem = run.open()
        # Every rank learns whether one cannot write (8 bytes): all raise, or none.
        failed = own.allreduce(1 if problem else 0)
        if failed:
            first = own.allreduce(run.rank if problem else run.size, op=MPI.MIN)
            if run.fd is not None:
                os.close(run.fd)
            own.Free()
            raise TimelineError(
                _cannot_write(what, directory, problem, failed, first, run)
            )
        run.meta["start"] = clocks.measure(own, CLOCK_TIMEOUT_S).as_dict()
        run.meta["started_ns"] = time.monotonic_ns()
        if run.fd is not None:
            run.module.timeline_start(run.fd, CAPACITY)
        run.write_meta()
        _run = run


def _cannot_write(what, directory, problem, count, first, run) -> str:
    where = f"on {count} of {run.size} ranks (the first: rank {first})"
    why = f": {problem}" if problem else ""
    return (
        f"{what}: the timeline's folder {str(directory)!r} cannot be written "
        f"{where}{why}. Name a folder every rank can create and write to."
    )


def stop() -> Path | None:
    """Stop the timeline and write the rest of it; return its folder (None on a
    rank that writes none). Collective on the timeline's communicator: each rank
    measures its clock against rank 0's again (waiting at most
    ``CLOCK_TIMEOUT_S`` for a rank that does not come). A rank's files are whole
    once it has returned: read them once every rank has (after a barrier, or the
    job). Nothing where no timeline is being written."""
    global _run
    with _lock:
        run, _run = _run, None
    if run is None:
        return None
    if run.fd is not None:
        written, lost, error = run.module.timeline_stop()
        os.close(run.fd)
        run.meta.update(
            events=written,
            lost=lost,
            write_error=os.strerror(error) if error else None,
        )
    run.meta["stopped_ns"] = time.monotonic_ns()
    run.meta["end"] = clocks.measure(run.comm, CLOCK_TIMEOUT_S).as_dict()
    run.meta["sites"], run.meta["comms"], run.meta["kinds"] = _names(run)
    run.write_meta()
    return run.directory


def _names(run: _Run) -> tuple[dict, dict, dict]:
    """Every registered call site's text, communicator's (key, name, size) and
    kind of XLA's calls (``MPI_Allreduce``), by the ids events carry: from the
    extension's tables, without reading the events back. XLA's communicators
    (negative ids: the MPI wrapper's numbering, alike on every rank that makes
    the same collectives) are named by their size."""
    sites = {str(i): text for i, text in enumerate(run.module.sites(), start=1)}
    comms = {}
    for i in range(1, len(run.module.call_counts()) + 1):
        key, name, size = run.module.describe_comm(i)
        comms[str(i)] = {"key": f"{key:x}", "name": name, "size": size}
    first, xla_kinds, xla_sizes = run.module.timeline_xla()
    for i, size in enumerate(xla_sizes):
        comms[str(-1 - i)] = {
            "key": f"xla{i}",
            "name": f"XLA's communicator ({size} ranks)",
            "size": size,
        }
    kinds = {str(first + i): name for i, name in enumerate(xla_kinds)}
    return sites, comms, kinds


@contextlib.contextmanager
def timeline(directory, comm=None):
    """Time the collectives of the ``with`` block into ``directory``, for
    ``python -m mpi4jax_dist timeline DIR`` (:func:`start`, then :func:`stop`).

    Collective on ``comm`` (default ``MPI.COMM_WORLD``): every rank enters and
    leaves the block. Entering measures each rank's clock against rank 0's;
    leaving writes the rest of the timeline and measures them again.

    Raises:
        TimelineError: a timeline is being written already (one at a time), or
            ``directory`` cannot be written on some rank (every rank raises it).
    """
    start(directory, comm, what="mpi4jax_dist.timeline")
    try:
        yield Path(directory)
    finally:
        stop()


def start_from_environment(comm, bootstrap=None) -> None:
    """Where the job's ranks agreed on ``MPI4JAX_DIST_TIMELINE`` (rank 0's is
    set), start the timeline on the job's communicator ``comm``, to the program's
    end. A rank whose own variable is unset takes part in the clocks and writes
    nothing. ``bootstrap()`` returns the bootstrap's MPI calls as the JSON holds
    them (``[name, phase, enter_ns, leave_ns]``, those that ended), read at each
    write of it: its release may end after the start."""
    start(_config.timeline_dir(), comm, what=_config.TIMELINE, bootstrap=bootstrap)
    atexit.register(stop)
