"""The process environment, how a boolean switch is read, and how a value the
package cannot use as written is warned of.

Precedence everywhere: an explicit argument, then the variable, then the default.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on", "t", "y")
_FALSE = ("0", "false", "no", "off", "f", "n", "")


def environ() -> Mapping[str, str]:
    """Return the process environment (the one place that touches ``os.environ``)."""
    return os.environ


def get_bool(name: str, default: bool = False, env: Mapping[str, str] | None = None):
    """Return a strict boolean variable; warn and use ``default`` on anything else.

    Ignoring a malformed value is safe for our switches, so this warns rather than
    raising: a job does not die over ``MPI4JAX_DIST_DISABLE=maybe``.
    """
    env = environ() if env is None else env
    value = env.get(name)
    if value is None:
        return default
    folded = value.strip().lower()
    if folded in _TRUE:
        return True
    if folded in _FALSE:
        return False
    warn_setting(
        f"{name}={value!r} is not a boolean; expected one of "
        f"{', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}. Using {name}={int(default)}."
    )
    return default


class SettingWarning(RuntimeWarning):
    """A variable's value the package cannot use as written, and what it uses
    instead. Every rank reads the same environment: rank 0 alone shows it
    (:func:`setting_warnings_on_rank_0`)."""


# Modules whose frames are not where a user set anything: the package's, JAX's,
# and Python's import and -m machinery.
_NOT_THE_USER = ("mpi4jax_dist", "jax", "jaxlib", "importlib", "runpy")


def _ours(frame) -> bool:
    """Whether ``frame`` runs code of :data:`_NOT_THE_USER`'s modules (by the
    module's name: the functions dataclasses write have no file of their own)."""
    module = frame.f_globals.get("__name__") or ""
    return module.split(".")[0] in _NOT_THE_USER or frame.f_code.co_filename.startswith(
        "<frozen "
    )


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """Warn, attributed to the user's line that led here (the first frame outside
    the package and JAX: what Python 3.12's ``skip_file_prefixes`` does), not to
    the package's own source."""
    frame, level = sys._getframe(1), 1  # our caller, at stacklevel 2 of warn()
    while frame.f_back is not None and _ours(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def warn_setting(message: str) -> None:
    """Warn with a :class:`SettingWarning`, at the user's line."""
    warn_at_user_line(message, SettingWarning)


def setting_warnings_on_rank_0(rank: int | None) -> None:
    """Leave :class:`SettingWarning` to rank 0: an ignore filter on the other
    ranks (``rank`` None: not known, nothing done), not where the user chose
    which warnings to see (``-W``, ``PYTHONWARNINGS``). The package calls it at its
    import, with the launcher's rank, and with MPI's once the job is set up."""
    if rank in (None, 0) or sys.warnoptions:
        return
    warnings.filterwarnings("ignore", category=SettingWarning)
