"""How the bootstrap waits: every wait against a deadline, past which the job ends
with one line.

Only local MPI calls here (a request's ``Test``, ``MPI_Abort``): the bootstrap's
collectives are posted in mpi4jax_dist/launch/bootstrap.py.
"""

from __future__ import annotations

import logging
import time
import typing
from dataclasses import dataclass

from .. import _config, _mpi

logger = logging.getLogger("mpi4jax_dist")


@dataclass(frozen=True)
class Deadline:
    """When one phase's waits end, and what ending the job past it needs.

    Attributes:
        at: the ``time.monotonic()`` past which the job ends.
        timeout_s: the seconds that set ``at`` (``initialization_timeout``).
        collective_timeout_s: ``MPI4JAX_DIST_COLLECTIVE_TIMEOUT`` (None: off): no
            single wait lasts longer.
        comm, log: the job's communicator and the bootstrap's log, for the abort.
    """

    at: float
    timeout_s: float
    collective_timeout_s: float | None
    comm: object
    log: _mpi.CallLog


def wait(request, deadline: Deadline, what: str) -> None:
    """Wait for ``request`` until ``deadline``, or for the collective timeout where
    it comes first; abort past it."""
    pause = 1e-5
    limit = deadline.collective_timeout_s
    collective = None if limit is None else time.monotonic() + limit
    while not request.Test():
        now = time.monotonic()
        if collective is not None and now > collective and collective < deadline.at:
            timed_out(deadline, what)
        if now > deadline.at:
            give_up(deadline, what)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    deadline.log.completed(request)


def give_up(deadline: Deadline, what: str) -> typing.NoReturn:
    """Abort the job: this rank waited ``deadline.timeout_s`` for ``what``."""
    abort(
        deadline.comm,
        deadline.log,
        f"gave up after {deadline.timeout_s:g} s waiting for {what}. "
        f"Raise initialization_timeout if the job is just slow.",
    )


def timed_out(deadline: Deadline, what: str) -> typing.NoReturn:
    """Abort the job: this rank waited the collective timeout for ``what``."""
    abort(
        deadline.comm,
        deadline.log,
        f"gave up after {deadline.collective_timeout_s:g} s "
        f"({_config.COLLECTIVE_TIMEOUT}) waiting for {what} in the bootstrap. "
        f"Raise {_config.COLLECTIVE_TIMEOUT} if the job is just slow.",
    )


def abort(comm, log: _mpi.CallLog, message: str) -> typing.NoReturn:
    """Print ``message`` for this rank and end the whole MPI job (``comm``'s), the
    abort recorded in ``log``; never returns."""
    # Through logging (with no handler configured, Python prints it to stderr).
    logger.critical(
        "mpi4jax_dist: rank %d of %d: %s",
        comm.Get_rank(),
        comm.Get_size(),
        message,
    )
    _mpi.abort(_mpi.RecordingComm(comm, log), 1)
