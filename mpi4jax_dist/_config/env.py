"""The process environment, and how a boolean switch is read.

Precedence everywhere: an explicit argument, then the variable, then the default.
"""

from __future__ import annotations

import os
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
    warnings.warn(
        f"{name}={value!r} is not a boolean; expected one of "
        f"{', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}. Using {name}={int(default)}.",
        RuntimeWarning,
        stacklevel=2,
    )
    return default
