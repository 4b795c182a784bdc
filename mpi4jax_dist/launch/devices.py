"""Which local devices each process should use, without starting a JAX backend.

JAX's own rule, ``local_device_ids=[local_rank]``, assumes every rank sees all GPUs
of its node. Wrapper scripts on PBS systems often set ``CUDA_VISIBLE_DEVICES`` to one
GPU per rank; ``[local_rank]`` then names a device that does not exist. The rule
here looks at what this process can see.

Intel GPUs (Aurora): the wrapper sets ``ZE_AFFINITY_MASK`` per rank, to a tile
(``0.1``: tile 1 of GPU 0) or a whole GPU (``3``), and ``ZE_FLAT_DEVICE_HIERARCHY``
says what a device is: each tile (``FLAT``, the default) or each GPU
(``COMPOSITE``). What the process then sees, after Level Zero's rules: under
``FLAT`` one device per entry; under ``COMPOSITE`` one per GPU named (two tiles of
one GPU are that GPU, a tile alone is a device of its own).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from .. import _config

# GPUs the driver knows on this node, when no *_VISIBLE_DEVICES narrows them.
_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_accelerators(env: Mapping[str, str], nvidia_dir: str = _NVIDIA_GPUS):
    """Return ``(source, count)`` of accelerators this process sees, or None for CPU.

    Args:
        env: the environment (``*_VISIBLE_DEVICES``, ``JAX_PLATFORMS``).
        nvidia_dir: where the NVIDIA driver lists its GPUs (a parameter for tests).
    """
    wanted = _config.platforms(env)
    if wanted and all(p == "cpu" for p in wanted):
        return None
    visible = _config.visible_devices(env)
    if visible is not None:
        name, entries = visible
        return (name, len(entries)) if entries else None
    mask = _config.level_zero_mask(env)
    if mask is not None:
        hierarchy = _config.level_zero_hierarchy(env)
        count = level_zero_devices(mask, hierarchy)
        value = env[_config.ZE_AFFINITY_MASK].strip()
        return f"{_config.ZE_AFFINITY_MASK}={value} ({hierarchy})", count
    try:
        count = len(os.listdir(nvidia_dir))
    except OSError:
        return None
    return (nvidia_dir, count) if count else None


def level_zero_devices(mask: list[tuple[int, int | None]], hierarchy: str) -> int:
    """Return how many devices ``ZE_AFFINITY_MASK``'s ``mask`` (``(device, tile)``
    pairs) leaves a process under ``hierarchy`` (``FLAT``, ``COMPOSITE``,
    ``COMBINED``)."""
    if hierarchy == "FLAT":
        return len(set(mask))
    return len({device for device, _ in mask})


def describe(
    local_rank: int,
    local_size: int,
    env: Mapping[str, str] | None = None,
    nvidia_dir: str = _NVIDIA_GPUS,
) -> dict:
    """Return what this process will use, for ``--check``: ``source`` (what decided:
    ``JAX_LOCAL_DEVICE_IDS``, a ``*_VISIBLE_DEVICES`` or ``ZE_AFFINITY_MASK``
    setting, the NVIDIA driver's list, or None for the CPU), ``visible`` (how many
    accelerators it sees) and ``local_device_ids`` (None: all, or the CPU)."""
    env = _config.environ() if env is None else env
    seen = visible_accelerators(env, nvidia_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # said by the bootstrap
        ids = local_device_ids(local_rank, local_size, env, nvidia_dir)
    source = seen[0] if seen else None
    if _config.local_device_ids(env) is not None:
        source = f"{_config.LOCAL_DEVICE_IDS}={env[_config.LOCAL_DEVICE_IDS]}"
    return {
        "source": source,
        "visible": seen[1] if seen else 0,
        "local_device_ids": ids,
    }


def local_device_ids(
    local_rank: int,
    local_size: int,
    env: Mapping[str, str] | None = None,
    nvidia_dir: str = _NVIDIA_GPUS,
) -> list[int] | None:
    """Return the local device ids this process should use, or None for all/CPU.

    ``JAX_LOCAL_DEVICE_IDS`` wins. Otherwise, with ``n`` accelerators visible: none
    (or CPU only) -> None; ``n == 1`` -> ``[0]``; ``n == local_size`` ->
    ``[local_rank]``; ``n`` a multiple of ``local_size`` -> this rank's contiguous
    block of ``n // local_size``; anything else -> None with a warning (every rank
    then sees every device, which is rarely what is wanted).
    """
    env = _config.environ() if env is None else env
    explicit = _config.local_device_ids(env)
    if explicit is not None:
        return explicit
    seen = visible_accelerators(env, nvidia_dir)
    if seen is None:
        return None
    source, count = seen
    if count == 1:
        return [0]
    if count % local_size == 0:
        per_rank = count // local_size
        return list(range(local_rank * per_rank, (local_rank + 1) * per_rank))
    _config.warn_at_user_line(
        f"{count} accelerators visible ({source}) to each of {local_size} ranks on "
        f"this node: not one each nor an equal block each, so every rank sees all of "
        f"them. Set {_config.LOCAL_DEVICE_IDS} (or pass local_device_ids=) to choose.",
        RuntimeWarning,
    )
    return None
