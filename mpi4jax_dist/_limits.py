"""Rank 0's open-file limit against what JAX's coordination service needs.

JAX's coordination service on rank 0 holds one TCP connection, so one file
descriptor, per process of the job, beside what the process already has open. With
the soft ``RLIMIT_NOFILE`` below that, gRPC logs "File descriptor limit reached.
Retrying." every second and every client fails with ``DEADLINE_EXCEEDED``, only
after ``initialization_timeout`` + 5 s. A soft limit of 1024 is common; NCCL raises
its soft limit to the hard one at start-up for the same reason, and so does rank 0
here, before its service starts (:func:`ensure_file_limit`).
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger("mpi4jax_dist")

# Files rank 0 has open besides the service's connections: Python's, JAX's and
# XLA's, gRPC's own (about 30 measured with jaxlib's service alone), MPI's (shared
# memory segments, sockets to the launcher) and its own client's connection.
FILE_MARGIN = 256


def files_needed(num_processes: int) -> int:
    """Open files rank 0 needs for a job of ``num_processes``: one connection each,
    plus :data:`FILE_MARGIN`."""
    return num_processes + FILE_MARGIN


def file_limits() -> tuple[int | None, int | None]:
    """Return this process's ``(soft, hard)`` open-file limits (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        None if soft == resource.RLIM_INFINITY else soft,
        None if hard == resource.RLIM_INFINITY else hard,
    )


def ensure_file_limit(num_processes: int) -> tuple[int, int | None] | None:
    """Raise the soft open-file limit to the hard one when it is below what a
    coordination service for ``num_processes`` needs.

    Returns:
        ``(old soft, new soft)`` when it was raised (logged once here), None when
        the soft limit was already enough.

    Raises:
        RuntimeError: even the hard limit is too low, naming both limits, the
            process count and the fix.
    """
    needed = files_needed(num_processes)
    soft, hard = file_limits()
    if soft is None or soft >= needed:
        return None
    if hard is not None and hard < needed:
        raise RuntimeError(
            f"rank 0 needs {needed} open files for JAX's coordination service "
            f"({num_processes} processes, one connection each, + {FILE_MARGIN} for "
            f"the rest), but its hard limit is {hard} (soft {soft}), and a process "
            f"cannot raise its own hard limit. Start the job where `ulimit -Hn` "
            f"shows at least {needed} (ask the site: limits.conf, or the batch "
            f"system's limit); `ulimit -n` shows the soft one."
        )
    hard_raw = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard_raw, hard_raw))
    logger.info(
        "mpi4jax_dist: raised rank 0's open-file limit from %d to %s (the hard "
        "limit): JAX's coordination service needs %d for %d processes.",
        soft,
        "unlimited" if hard is None else hard,
        needed,
        num_processes,
    )
    return soft, hard
