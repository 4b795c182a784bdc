"""What the fault handling reads: fail-fast and JAX's preemption service
(``faults/failfast.py``), stacks on demand, the collective and hang timeouts
(``faults/hangs.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from .env import environ, get_bool

FAIL_FAST = "MPI4JAX_DIST_FAIL_FAST"
# JAX's own variable for its preemption service (which catches SIGTERM): set to a
# true value, it tells us the user wants JAX's preemption handling.
JAX_PREEMPTION = "JAX_ENABLE_PREEMPTION_SERVICE"


def fail_fast(env: Mapping[str, str] | None = None) -> bool:
    """Return True unless ``MPI4JAX_DIST_FAIL_FAST=0`` turns off what makes a
    failing rank end the job (see ``faults/failfast.py``)."""
    return get_bool(FAIL_FAST, True, env)


def jax_preemption_requested(env: Mapping[str, str] | None = None) -> bool:
    """Return True when ``JAX_ENABLE_PREEMPTION_SERVICE`` asks for JAX's preemption
    service (and with it JAX's SIGTERM handler) by name."""
    return get_bool(JAX_PREEMPTION, False, env)


# --- hangs: stacks on demand and the collective timeout (faults/hangs.py) ----------

STACKS = "MPI4JAX_DIST_STACKS"
HANG_DIR = "MPI4JAX_DIST_HANG_DIR"
COLLECTIVE_TIMEOUT = "MPI4JAX_DIST_COLLECTIVE_TIMEOUT"
HANG_TIMEOUT = "MPI4JAX_DIST_HANG_TIMEOUT"


def stacks_on_signal(env: Mapping[str, str] | None = None) -> bool:
    """Return whether ``SIGUSR1`` makes each rank print its threads' Python stacks
    (default on; ``MPI4JAX_DIST_STACKS=0`` leaves the signal alone)."""
    return get_bool(STACKS, True, env)


def hang_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Return the folder each rank writes its stacks to (``rank-N.txt``), or None
    (``MPI4JAX_DIST_HANG_DIR`` unset or empty: stderr, each line prefixed with the
    rank)."""
    env = environ() if env is None else env
    return env.get(HANG_DIR, "").strip() or None


def collective_timeout(env: Mapping[str, str] | None = None) -> float | None:
    """Return ``MPI4JAX_DIST_COLLECTIVE_TIMEOUT`` in seconds, or None (off).

    The longest any of the package's collectives (``allreduce``, ``iallreduce``'s
    wait, the bootstrap's) waits; past it the job ends with a report of who was
    missing. Unset, empty or ``0``: off.

    Raises:
        ValueError: the value is not a non-negative number of seconds.
    """
    return _seconds(
        COLLECTIVE_TIMEOUT,
        "how long a collective may wait (longer than the slowest rank's work "
        "between two collectives, e.g. 600)",
        env,
    )


# The hang timeout when none is set: ten minutes, PyTorch's NCCL default for its
# collective timeout. A correct program stays under it as long as no step leaves
# every rank without progress (no Python run, none of the package's collectives
# entered or ended) for ten minutes while the ranks stand at different places;
# docs/faults.rst.
DEFAULT_HANG_TIMEOUT_S = 600.0


def hang_timeout(env: Mapping[str, str] | None = None) -> float | None:
    """Return ``MPI4JAX_DIST_HANG_TIMEOUT`` in seconds (default 600), or None (off).

    How long the ranks of a job may all make no progress (no rank's main thread
    running Python, none of the package's collectives entered or ended) while they
    stand at different places, whatever they wait in, before the job is taken for
    hung: every rank's stacks, one report, the job ends.
    Unset or empty: 600 s; ``0``: off.

    Raises:
        ValueError: the value is not a non-negative number of seconds.
    """
    return _seconds(
        HANG_TIMEOUT,
        "how long every rank may go without progress (longer than the longest "
        "step of the program, e.g. 900)",
        env,
        default=DEFAULT_HANG_TIMEOUT_S,
    )


def hang_timeout_set(env: Mapping[str, str] | None = None) -> bool:
    """Return whether ``MPI4JAX_DIST_HANG_TIMEOUT`` is set (not left to its
    default)."""
    env = environ() if env is None else env
    return bool(env.get(HANG_TIMEOUT, "").strip())


def _seconds(
    name: str,
    meaning: str,
    env: Mapping[str, str] | None,
    default: float | None = None,
) -> float | None:
    env = environ() if env is None else env
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
        wrong = (
            "is negative"
            if seconds < 0
            else "is not finite" if not math.isfinite(seconds) else None
        )
    except ValueError:
        wrong = "is not a number of seconds"
    if wrong:
        off = "0 or nothing" if default is None else f"0 (unset: {default:g} s)"
        raise ValueError(
            f"{name}={value!r} {wrong}. Set it to {meaning}, or {off} to turn it off."
        )
    return seconds or None
