"""Optional dependencies, and the one message for a missing one.

mpi4jax is the ``mpi4jax`` extra (``pip install "mpi4jax_dist[mpi4jax]"``): the
cluster env, the diagnostics and the psum paths run without it. What needs it asks
for it by name, through :func:`require_mpi4jax`: :func:`mpi4jax_dist.allreduce`
(it shares mpi4jax's ordered effect and default communicator) and the
``backend="mpi4jax"`` of :mod:`mpi4jax_dist.cg`. Nothing here imports mpi4jax.
"""

from __future__ import annotations

import importlib.util

EXTRA = "mpi4jax_dist[mpi4jax]"


def mpi4jax_missing(what: str) -> str:
    """Return the message saying that ``what`` needs mpi4jax, and how to get it."""
    return (
        f'{what} needs mpi4jax: pip install "{EXTRA}" (mpi4jax compiles against '
        f"your MPI: put its mpicc first on PATH)"
    )


def has_mpi4jax() -> bool:
    """Return whether mpi4jax is installed (without importing it)."""
    return importlib.util.find_spec("mpi4jax") is not None


def require_mpi4jax(what: str, alternative: str = "") -> None:
    """Raise unless mpi4jax is installed; import nothing.

    Args:
        what: what needs it, as the message's subject (``"mpi4jax_dist.allreduce"``).
        alternative: a sentence appended to the message, such as what works
            without mpi4jax.

    Raises:
        ModuleNotFoundError: (an ``ImportError``) naming ``what``, the extra and
            the fix.
    """
    if not has_mpi4jax():
        message = mpi4jax_missing(what) + (f". {alternative}" if alternative else "")
        raise ModuleNotFoundError(message, name="mpi4jax")
