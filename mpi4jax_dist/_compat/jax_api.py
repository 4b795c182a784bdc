"""What the package asks of JAX and calls in it, one function each, alike on every
JAX supported: JAX's public API where it has one, else its private modules, read
here and never changed (what changes JAX is ``patches.py``'s).
"""

from __future__ import annotations

import inspect
import re

import jax
from jax._src import clusters as _clusters
from jax._src import distributed as _distributed

from .. import _config
from .versions import since

ClusterEnv = _clusters.ClusterEnv


def cluster_name(cls) -> str | None:
    """Return the name a ClusterEnv subclass answers to in
    ``cluster_detection_method``; None for those without one (older JAX sets it on
    some subclasses only: its Kubernetes env has none)."""
    return getattr(cls, "name", None)


def cluster_types_after(cls) -> list:
    """The ClusterEnv subclasses JAX asks after ``cls``, in its order (JAX's
    private registry, read here only)."""
    registry = ClusterEnv._cluster_types
    return list(registry[registry.index(cls) + 1 :])


def complete_trace_context() -> None:
    """Import now the JAX modules whose import adds options to JAX's trace context
    and that this package's first calls would import (mpi4jax imports
    ``jax.extend``).

    Every ``jit`` keys its cache on the trace context: options added after a
    function was traced make its next call trace and compile it again (since jax
    0.12, a first ``allreduce`` inside a ``jit`` did that to every function traced
    before). Imported up front, the context is whole before any user code runs.
    """
    if since("jax.extend registers trace context"):
        import jax.extend  # noqa: F401


def initialize_accepts(name: str) -> bool:
    """Return True when ``jax.distributed.initialize`` takes the argument ``name``
    (``cluster_detection_method``, ``heartbeat_timeout_seconds``, ...)."""
    return name in inspect.signature(jax.distributed.initialize).parameters


def distributed_state() -> tuple[bool, int, int]:
    """Return ``(initialized, process_id, num_processes)``; starts no backend."""
    state = _distributed.global_state
    return state.client is not None, state.process_id, state.num_processes


def coordination_client():
    """Return this process's client of JAX's coordination service once
    ``jax.distributed`` is initialized, else None."""
    return _distributed.global_state.client


def restrict_visible_devices(device_ids) -> None:
    """Make only ``device_ids`` visible to this process, as JAX's own initialize does.

    JAX turns a ClusterEnv's local process id into ``local_device_ids=[id]``: a block
    of several devices per process cannot pass that way, so it is set here. JAX
    applies ``local_device_ids`` to CUDA's and ROCm's options, and to oneAPI's
    only from 0.12: set here for one device too.
    """
    visible = ",".join(str(i) for i in device_ids)
    options = ["jax_cuda_visible_devices", "jax_rocm_visible_devices"]
    if since("jax_oneapi_visible_devices"):  # Intel GPUs (jax-oneapi-plugin)
        options.append("jax_oneapi_visible_devices")
    for option in options:
        try:
            jax.config.update(option, visible)
        except (AttributeError, KeyError, ValueError):  # option not in this jax
            pass


def preemption_service() -> bool:
    """Return whether ``jax.distributed.initialize`` starts (or started) JAX's
    preemption service, whose notifier catches SIGTERM."""
    if since("jax_enable_preemption_service"):
        return bool(jax.config.jax_enable_preemption_service)
    # Always, unless patches.disable_preemption_service replaced the start.
    return "initialize_preemption_sync_manager" not in vars(_distributed.global_state)


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
    if since("jax.shard_map"):
        return jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check
        )
    from jax.experimental.shard_map import shard_map as _shard_map

    return _shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check
    )


def cpu_collectives() -> str | None:
    """Return the cross-process collectives of JAX's CPU client: "gloo", "mpi", ...
    (None: none)."""
    value = jax.config.jax_cpu_collectives_implementation
    if value is None and not since("jax_cpu_collectives_implementation"):
        from jax._src import xla_bridge

        return xla_bridge._DEFAULT_CPU_COLLECTIVES_IMPL
    return value


def cpu_devices_per_process() -> int:
    """Return the CPU devices each process will have: ``jax_num_cpu_devices``, else
    XLA_FLAGS' ``--xla_force_host_platform_device_count``, else 1."""
    configured = jax.config.jax_num_cpu_devices
    if configured is not None and configured > 0:
        return configured
    found = re.findall(
        r"--xla_force_host_platform_device_count[= ](\d+)",
        _config.environ().get("XLA_FLAGS", ""),
    )
    return int(found[-1]) if found else 1


def backends_initialized() -> bool:
    """Return True once JAX has made its backends (jax.devices() and the like)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def raise_config_defaults(values: dict, defaults: dict) -> dict:
    """Set each JAX option of ``values`` that this JAX has and that still holds its
    default (``defaults``: the user set none), where ``values`` asks for more;
    return what was set. Options this JAX lacks (the topology timeouts came after
    0.6.0) are skipped: it then has no such timeout to hit."""
    applied = {}
    for name, value in values.items():
        try:
            current = getattr(jax.config, name)
        except AttributeError:
            continue
        if current == defaults[name] and value > current:
            jax.config.update(name, value)
            applied[name] = value
    return applied


def enable_x64(new_val: bool = True):
    """Return the context manager that turns 64-bit types on (or off) inside it."""
    if since("jax.enable_x64"):
        return jax.enable_x64(new_val)
    from jax.experimental import enable_x64 as _enable_x64

    return _enable_x64(new_val)


def unregister_event_duration_listener(listener) -> None:
    """Undo ``jax.monitoring.register_event_duration_secs_listener(listener)``."""
    if since("jax.monitoring.unregister_event_duration_listener"):
        jax.monitoring.unregister_event_duration_listener(listener)
        return
    from jax._src import monitoring

    monitoring._unregister_event_duration_listener_by_callback(listener)


def distributed_runtime():
    """Return jaxlib's extension module, whose ``get_distributed_runtime_service``
    and ``get_distributed_runtime_client`` make JAX's coordination service and its
    clients."""
    from jax._src import lib

    return lib._jax if since("jaxlib._jax") else lib.xla_extension


def coordination_counters() -> bool:
    """Whether the coordination service's clients have atomic counters
    (``key_value_increment``, from jaxlib 0.7.2 on)."""
    return hasattr(
        distributed_runtime().DistributedRuntimeClient, "key_value_increment"
    )


def runtime_heartbeat(timeout_s: int) -> dict:
    """Return the keyword arguments that give a runtime client or service of
    :func:`distributed_runtime` a heartbeat timeout of ``timeout_s`` seconds."""
    if since("heartbeat_timeout_seconds"):
        return {"heartbeat_timeout": timeout_s}
    # As in JAX 0.6's defaults (10 s, 10 missed heartbeats: 100 s).
    return {"heartbeat_interval": max(1, timeout_s // 10), "max_missing_heartbeats": 10}


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
    kind = axis_type if axis_type in kinds.values() else None
    if isinstance(axis_type, str):
        kind = kinds.get(axis_type)
    if kind is None:
        raise ValueError(
            f"axis_type={axis_type!r}: expected 'auto' or 'explicit' (or "
            f"jax.sharding.AxisType.Auto or .Explicit)."
        )
    return Mesh(np.asarray(devices), (axis_name,), axis_types=(kind,))


def opaque_trace_state():
    """JAX's current trace, opaquely: equal for calls made in the same function."""
    try:
        from jax.extend.core import get_opaque_trace_state
    except ImportError:  # jax < 0.7 has it in jax.core only
        from jax.core import get_opaque_trace_state
    return get_opaque_trace_state(convention="mpi4jax_dist")
