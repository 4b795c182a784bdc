"""mpi4jax, the ``mpi4jax`` extra: whether it is there, and the private names of it
this package shares.

The cluster env, the diagnostics and the psum paths run without it. What needs it
asks by name (:func:`require_mpi4jax`): the compiled ops share its ordered effect,
and cg's backend="mpi4jax" reduces with it.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

MPI4JAX_EXTRA = "mpi4jax_dist[mpi4jax]"

# mpi4jax's warning at its import where JAX is newer than its release names (its
# jax_compat.check_jax_version): the same on every rank (docs/support.rst).
VERSION_WARNING = r"\s*The latest supported JAX version with this release of mpi4jax"


def mpi4jax_missing(what: str) -> str:
    """Return the message saying that ``what`` needs mpi4jax, and how to get it."""
    return (
        f'{what} needs mpi4jax: pip install "{MPI4JAX_EXTRA}" (mpi4jax compiles '
        f"against your MPI: put its mpicc first on PATH)"
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


def mpi4jax_ordering():
    """Return ``(ordered_effect, abstract_token)``: mpi4jax's ordered effect, which
    the compiled ops carry so that one token orders mpi4jax's calls and theirs
    (mpi4jax registered it as allowed in loops and custom_vjp), and the abstract
    token its lowerings use (private in JAX 0.10; mpi4jax follows JAX's moves)."""
    from mpi4jax._src.jax_compat import abstract_token
    from mpi4jax._src.utils import ordered_effect

    return ordered_effect, abstract_token


def mpi4jax_effect_if_imported():
    """Return mpi4jax's ordered effect where mpi4jax is imported, else None (no
    program can carry it then); import nothing: importing mpi4jax prints its
    version warning, which the package explains where a user first sees it."""
    utils = sys.modules.get("mpi4jax._src.utils")
    return None if utils is None else utils.ordered_effect


def one_version_warning(rank: int | None) -> None:
    """Leave mpi4jax's JAX-version warning, 12 lines on every rank that imports
    mpi4jax, to rank 0: an ignore filter on the others (``rank`` None: not known,
    nothing done). Not where the user chose which warnings to see (``-W``,
    ``PYTHONWARNINGS``). It acts on an mpi4jax imported after it: the package
    calls it at its import and again with MPI's rank once the job is set up."""
    if rank in (None, 0) or sys.warnoptions:
        return
    warnings.filterwarnings("ignore", message=VERSION_WARNING, category=UserWarning)
