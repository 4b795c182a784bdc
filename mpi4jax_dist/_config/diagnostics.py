"""The variables of the diagnostics: the timeline of the collectives."""

from __future__ import annotations

from collections.abc import Mapping

from .env import environ

TIMELINE = "MPI4JAX_DIST_TIMELINE"


def timeline_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Return the folder every rank writes its timeline to, from the bootstrap to
    its exit (``MPI4JAX_DIST_TIMELINE``), or None (unset or empty: no timeline)."""
    env = environ() if env is None else env
    return env.get(TIMELINE, "").strip() or None
