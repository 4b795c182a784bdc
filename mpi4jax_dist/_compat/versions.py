"""The JAX versions supported and what changed between them: the table of the
package's docstring as data (``CHANGES``), and :func:`since`, by which every other
function of ``_compat`` chooses. Nothing here imports JAX's private modules.
"""

from __future__ import annotations

import re

import jax


def parse_version(version: str) -> tuple[int, int, int]:
    """Return ``(major, minor, patch)`` of a version string such as ``0.8.1.dev1``."""
    numbers = [int(x) for x in re.findall(r"\d+", version)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


JAX_VERSION = parse_version(jax.__version__)

# The oldest JAX supported: install_requires in setup.cfg says the same.
FLOOR = (0, 6, 0)

# The table of the package's docstring: what the code uses, and the first JAX
# version that has it.
CHANGES = {
    "jax.shard_map": (0, 6, 1),
    "jaxlib._jax": (0, 6, 1),
    "jax_cpu_collectives_implementation": (0, 6, 1),
    "heartbeat_timeout_seconds": (0, 7, 0),
    "jax.enable_x64": (0, 8, 0),
    "override_coordinator_port": (0, 8, 1),
    "jax.monitoring.unregister_event_duration_listener": (0, 8, 1),
    "jax_enable_preemption_service": (0, 8, 2),
    "cache host callbacks": (0, 11, 0),
    "jax.extend registers trace context": (0, 12, 0),
    "jax_oneapi_visible_devices": (0, 10, 0),
}


def since(change: str, version: tuple[int, int, int] = JAX_VERSION) -> bool:
    """Return True when JAX ``version`` (default: the one imported) has ``change``,
    a key of ``CHANGES``."""
    return version >= CHANGES[change]


def _by_version(rows, version: tuple[int, int, int]):
    """Return the value of the last of ``rows``, ``(first version, value)`` pairs
    in order, whose first version is <= ``version``."""
    value = rows[0][1]
    for first, row_value in rows:
        if version >= first:
            value = row_value
    return value


# How each JAX version calls ClusterEnv.get_coordinator_address: the keyword
# arguments it passes. A version takes the last row whose first version is <= it.
COORDINATOR_ADDRESS_KWARGS = (
    (FLOOR, ("timeout_secs",)),
    (
        CHANGES["override_coordinator_port"],
        ("timeout_secs", "override_coordinator_port"),
    ),
)


def coordinator_address_kwargs(version: tuple[int, int, int] = JAX_VERSION):
    """Return the keywords JAX ``version`` passes to get_coordinator_address."""
    return _by_version(COORDINATOR_ADDRESS_KWARGS, version)


# The parameters of JAX's ``compiler._cache_write``, which the wrapper of
# ``patches.cache_on_every_process`` takes and hands on: a version takes the last
# row whose first version is <= it.
CACHE_WRITE_PARAMS = (
    (
        FLOOR,
        (
            "cache_key",
            "compile_time_secs",
            "module_name",
            "backend",
            "executable",
            "host_callbacks",
        ),
    ),
    (
        CHANGES["cache host callbacks"],
        ("cache_key", "compile_time_secs", "module_name", "backend", "executable"),
    ),
)


def cache_write_params(version: tuple[int, int, int] = JAX_VERSION) -> tuple:
    """Return the parameters of ``compiler._cache_write`` in JAX ``version``."""
    return _by_version(CACHE_WRITE_PARAMS, version)
