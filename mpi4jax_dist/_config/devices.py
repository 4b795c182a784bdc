"""Which devices a process sees: JAX's platforms and local device ids, the
accelerators' visible devices, Intel GPUs' Level Zero mask and hierarchy
(``launch/devices.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from .env import environ

LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
PLATFORMS = "JAX_PLATFORMS"
# Which accelerators this process may see, in the order we look at them.
VISIBLE_DEVICES = (
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)


# Intel GPUs (Level Zero): which devices a process sees, and whether a device is a
# tile (FLAT, the default) or a whole GPU (COMPOSITE; COMBINED as COMPOSITE here).
ZE_AFFINITY_MASK = "ZE_AFFINITY_MASK"
ZE_HIERARCHY = "ZE_FLAT_DEVICE_HIERARCHY"
ZE_HIERARCHIES = ("FLAT", "COMPOSITE", "COMBINED")


def local_device_ids(env: Mapping[str, str] | None = None) -> list[int] | None:
    """Return ``JAX_LOCAL_DEVICE_IDS`` as a list of ints, or None when unset."""
    env = environ() if env is None else env
    value = env.get(LOCAL_DEVICE_IDS, "").strip()
    if not value:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(
            f"{LOCAL_DEVICE_IDS}={value!r} is not a comma-separated list of device "
            f"numbers (for example 0 or 0,1)."
        ) from None


def platforms(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the platforms ``JAX_PLATFORMS`` asks for (lower case), maybe empty."""
    env = environ() if env is None else env
    value = env.get(PLATFORMS, "") or env.get("JAX_PLATFORM_NAME", "")
    return [p.strip().lower() for p in value.split(",") if p.strip()]


def visible_devices(
    env: Mapping[str, str] | None = None,
) -> tuple[str, list[str]] | None:
    """Return ``(variable, entries)`` for the first ``*_VISIBLE_DEVICES`` set, or None.

    ``-1`` or an empty value hides every device (CUDA's convention): no entries.
    """
    env = environ() if env is None else env
    for name in VISIBLE_DEVICES:
        value = env.get(name)
        if value is None:
            continue
        entries = [e.strip() for e in value.split(",") if e.strip()]
        if entries and entries[0] == "-1":
            entries = []
        return name, entries
    return None


def level_zero_mask(
    env: Mapping[str, str] | None = None,
) -> list[tuple[int, int | None]] | None:
    """Return ``ZE_AFFINITY_MASK`` as ``(device, tile)`` pairs (tile None for a
    whole device), or None when unset or empty (Level Zero: every device visible).

    Raises:
        ValueError: an entry is neither a device (``3``) nor a device's tile
            (``0.1``).
    """
    env = environ() if env is None else env
    value = env.get(ZE_AFFINITY_MASK, "")
    if not value.strip():
        return None
    entries = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", part)
        if match is None:
            raise ValueError(
                f"{ZE_AFFINITY_MASK}={value!r}: {part.strip()!r} is not a device "
                f"(3) or a device's tile (0.1); expected a comma-separated list of "
                f"them, such as 0.0 or 0.0,0.1 or 3."
            )
        device, tile = match.groups()
        entries.append((int(device), None if tile is None else int(tile)))
    return entries


def level_zero_hierarchy(env: Mapping[str, str] | None = None) -> str:
    """Return ``ZE_FLAT_DEVICE_HIERARCHY`` in upper case: ``FLAT`` (the default),
    ``COMPOSITE`` or ``COMBINED``.

    Raises:
        ValueError: another value.
    """
    env = environ() if env is None else env
    value = env.get(ZE_HIERARCHY, "").strip()
    if value.upper() in ("",) + ZE_HIERARCHIES:
        return value.upper() or "FLAT"
    raise ValueError(
        f"{ZE_HIERARCHY}={value!r} is not FLAT (the default: each tile of an Intel "
        f"GPU is a device), COMPOSITE (each GPU is one device) or COMBINED."
    )
