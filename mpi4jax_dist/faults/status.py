"""Each rank's answer to ``python -m mpi4jax_dist status``: a Unix socket of the
rank's own in ``MPI4JAX_DIST_STATUS_DIR``, in a folder of its host's (a socket is
reached from its own host only: on a shared file system another node's socket
refuses, and must not be taken for a dead rank's), answered by ``_stacks``'s
thread in C (``_ffi/stacks_status.c``), so that a rank whose Python cannot run
answers too.
The thread waits for a client in ``poll()``: nothing is paid until one asks.
The asking side is :mod:`mpi4jax_dist.diagnostics.status`; docs/status.rst."""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import socket
import stat

from .. import _config
from . import stacks, writer

logger = logging.getLogger("mpi4jax_dist")

SUFFIX = ".sock"


def job_key(coordinator_address: str) -> str:
    """The job's name in the sockets' file names: the same on every rank (made
    of rank 0's coordinator address), one job's apart from another's."""
    return "j" + hashlib.blake2s(coordinator_address.encode()).hexdigest()[:12]


def host_dir(directory: str) -> str:
    """The folder of this host's sockets in ``directory``."""
    return os.path.join(directory, socket.gethostname())


def socket_path(directory: str, key: str, rank: int) -> str:
    """Where rank ``rank`` of job ``key`` listens, on this host."""
    return os.path.join(host_dir(directory), f"{key}.{rank}{SUFFIX}")


def private_dir(directory: str) -> str | None:
    """Make ``directory`` (mode 0700) where it is not; return why it cannot hold
    this user's sockets (another user's, or others may write into it), or
    None."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory)
    except OSError as err:
        return str(err)
    if info.st_uid != os.getuid():
        return f"{directory} belongs to another user (uid {info.st_uid})"
    if not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o022:
        return f"{directory} is not a folder only its owner may write to"
    return None


def listen(rank: int, coordinator_address: str) -> str | None:
    """Have ``_stacks``'s thread answer ``python -m mpi4jax_dist status`` on this
    rank's socket (a job's key from ``coordinator_address``) until the process
    exits; return its path, or None where no socket is made
    (``MPI4JAX_DIST_STATUS_DIR=off``, no stack writer, a folder that will not
    do: said once, at info level on rank 0, the job going on)."""
    directory = _config.status_dir()
    module = writer.module()
    if directory is None or module is None:
        return None
    why = private_dir(directory) or private_dir(host_dir(directory))
    path = socket_path(directory, job_key(coordinator_address), rank)
    if why is None:
        try:
            module.listen_status(
                path, coordinator_address, writer.signum(), stacks.LIBRARY_PATTERN
            )
        except (OSError, ValueError) as err:
            why = str(err)
    if why is not None:
        if rank == 0:
            logger.info(
                "mpi4jax_dist: python -m mpi4jax_dist status cannot ask this job "
                "(%s: %s); name another folder in %s.",
                _config.STATUS_DIR,
                why,
                _config.STATUS_DIR,
            )
        return None
    atexit.register(module.stop_status)
    return path
