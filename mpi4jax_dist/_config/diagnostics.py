"""The variables of the diagnostics: the timeline of the collectives, and where
each rank answers ``python -m mpi4jax_dist status``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .env import environ

TIMELINE = "MPI4JAX_DIST_TIMELINE"
STATUS_DIR = "MPI4JAX_DIST_STATUS_DIR"


def timeline_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Return the folder every rank writes its timeline to, from the bootstrap to
    its exit (``MPI4JAX_DIST_TIMELINE``), or None (unset or empty: no timeline)."""
    env = environ() if env is None else env
    return env.get(TIMELINE, "").strip() or None


def status_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Return the folder of the ranks' status sockets (``MPI4JAX_DIST_STATUS_DIR``;
    unset or empty: ``/tmp/mpi4jax_dist-UID``, a folder of this user's on each
    node, which the job and ``python -m mpi4jax_dist status`` find alike whatever
    ``TMPDIR`` says), or None where it is ``off``: no rank answers."""
    env = environ() if env is None else env
    value = env.get(STATUS_DIR, "").strip()
    if value.lower() == "off":
        return None
    return value or f"/tmp/mpi4jax_dist-{os.getuid()}"
