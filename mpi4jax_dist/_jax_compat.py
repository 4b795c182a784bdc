"""Differences between JAX versions and every use of JAX's private modules.

Supported: jax 0.6 up to today. What changed, and where we rely on it:

=========  ==========================================================================
version    change
=========  ==========================================================================
0.6        ``ClusterEnv.get_coordinator_address(cls, timeout_secs)``, called with
           ``timeout_secs`` by keyword; older bases have no ``name`` (ours sets it).
0.7        ``jax.shard_map`` with ``check_vma`` (before: jax.experimental.shard_map
           with ``check_rep``).
0.8.1      ``get_coordinator_address(cls, timeout_secs, override_coordinator_port)``,
           the port passed by keyword from ``JAX_COORDINATOR_PORT``.
=========  ==========================================================================
"""

from __future__ import annotations

import inspect
import re

import jax
from jax._src import clusters as _clusters
from jax._src import distributed as _distributed

ClusterEnv = _clusters.ClusterEnv


def parse_version(version: str) -> tuple[int, int, int]:
    """Return ``(major, minor, patch)`` of a version string such as ``0.8.1.dev1``."""
    numbers = [int(x) for x in re.findall(r"\d+", version)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


JAX_VERSION = parse_version(jax.__version__)

# How each JAX version calls ClusterEnv.get_coordinator_address: the keyword
# arguments it passes. A version takes the last row whose first version is <= it.
COORDINATOR_ADDRESS_KWARGS = (
    ((0, 6, 0), ("timeout_secs",)),
    ((0, 8, 1), ("timeout_secs", "override_coordinator_port")),
)


def coordinator_address_kwargs(version: tuple[int, int, int] = JAX_VERSION):
    """Return the keywords JAX ``version`` passes to get_coordinator_address."""
    kwargs = COORDINATOR_ADDRESS_KWARGS[0][1]
    for first, names in COORDINATOR_ADDRESS_KWARGS:
        if version >= first:
            kwargs = names
    return kwargs


def register_first(cls) -> None:
    """Move the ClusterEnv subclass ``cls`` to the front of JAX's detection order.

    Subclasses register themselves on definition, at the end of the list: asked last.
    Under an MPI launch the MPI view is the truth, so ours is asked first.
    """
    registry = ClusterEnv._cluster_types
    registry[:] = [cls] + [c for c in registry if c is not cls]


def initialize_accepts(name: str) -> bool:
    """Return True when ``jax.distributed.initialize`` takes the argument ``name``
    (``cluster_detection_method``, ``heartbeat_timeout_seconds``, ...)."""
    return name in inspect.signature(jax.distributed.initialize).parameters


def distributed_state() -> tuple[bool, int, int]:
    """Return ``(initialized, process_id, num_processes)``; starts no backend."""
    state = _distributed.global_state
    return state.client is not None, state.process_id, state.num_processes


def restrict_visible_devices(device_ids) -> None:
    """Make only ``device_ids`` visible to this process, as JAX's own initialize does.

    JAX turns a ClusterEnv's local process id into ``local_device_ids=[id]``: a block
    of several devices per process cannot pass that way, so it is set here.
    """
    visible = ",".join(str(i) for i in device_ids)
    for option in ("jax_cuda_visible_devices", "jax_rocm_visible_devices"):
        try:
            jax.config.update(option, visible)
        except (AttributeError, KeyError, ValueError):  # option not in this jax
            pass


def preemption_service() -> bool | None:
    """Return whether ``jax.distributed.initialize`` will start JAX's preemption
    service (whose notifier catches SIGTERM); None when this JAX has no such
    option."""
    try:
        return bool(jax.config.jax_enable_preemption_service)
    except AttributeError:
        return None


def disable_preemption_service() -> None:
    """Keep the next ``jax.distributed.initialize`` from starting JAX's preemption
    service, so that SIGTERM keeps its default action."""
    try:
        jax.config.update("jax_enable_preemption_service", False)
    except (AttributeError, KeyError, ValueError):  # option not in this jax
        pass


def silence_proxy_check() -> None:
    """Turn off JAX's warning about variables named like proxies (read by
    ``jax.distributed.initialize`` after cluster detection)."""
    try:
        jax.config.update("jax_check_proxy_envs", False)
    except (AttributeError, KeyError, ValueError):  # option not in this jax
        pass


def shard_map(f, *, mesh, in_specs, out_specs, check=False):
    """Return ``shard_map(f)`` with replication checks set to ``check``.

    A ``lax.fori_loop`` that carries the result of ``psum`` fails the varying-manual-
    axes check of current JAX; the callers here turn the check off.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check
        )
    from jax.experimental.shard_map import shard_map as _shard_map

    return _shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check
    )


def make_mesh(devices, axis_name: str, axis_type: str = "auto"):
    """Return a 1-D ``Mesh`` over ``devices``; ``axis_type`` is auto or explicit.

    ``jax.scipy.sparse.linalg.cg`` fails on Explicit axes, hence Auto by default.
    """
    import numpy as np
    from jax.sharding import Mesh

    axis_types = getattr(jax.sharding, "AxisType", None)
    if axis_types is None:
        if axis_type != "auto":
            raise ValueError(
                f"axis_type={axis_type!r} needs jax >= 0.6 with jax.sharding.AxisType."
            )
        return Mesh(np.asarray(devices), (axis_name,))
    kinds = {"auto": axis_types.Auto, "explicit": axis_types.Explicit}
    if axis_type not in kinds:
        raise ValueError(f"axis_type={axis_type!r}: expected 'auto' or 'explicit'.")
    return Mesh(np.asarray(devices), (axis_name,), axis_types=(kinds[axis_type],))
