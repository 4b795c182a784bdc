"""Differences between JAX versions, every use of JAX's private modules, and the
optional dependency mpi4jax with the private names of it this package shares.

Supported: jax 0.6.0 (``FLOOR``, the floor in setup.cfg) up to today. ``CHANGES``
is the table of what changed since, one row per difference the code meets; the
functions here choose by it (:func:`since`), nowhere else. The test of this module
(tests/test_jax_compat.py) checks every row against the JAX it runs with: CI's runs
on the oldest and the newest JAX keep the table true at both ends.

=========  ==========================================================================
version    change
=========  ==========================================================================
0.6.0      ``ClusterEnv.get_coordinator_address(cls, timeout_secs)``, called with
           ``timeout_secs`` by keyword; older bases have no ``name`` (ours sets it).
0.6.1      ``jax.shard_map`` with ``check_vma`` (before: jax.experimental.shard_map
           with ``check_rep``); jaxlib's extension is ``jaxlib._jax`` (before:
           ``jaxlib.xla_extension``); ``jax_cpu_collectives_implementation`` is
           "gloo" by default (before: None, which the CPU client took for gloo).
0.7.0      ``jax.distributed.initialize(heartbeat_timeout_seconds=)``; the runtime
           client and service take ``heartbeat_timeout`` (before: an interval and
           a number of missed heartbeats, which initialize did not pass on).
0.8.0      ``jax.enable_x64`` (before: jax.experimental.enable_x64, gone in 0.10).
0.8.1      ``get_coordinator_address(cls, timeout_secs, override_coordinator_port)``,
           the port passed by keyword from ``JAX_COORDINATOR_PORT``;
           ``jax.monitoring.unregister_event_duration_listener`` (before: only
           jax._src.monitoring's).
0.8.2      ``jax_enable_preemption_service`` (before: ``jax.distributed.initialize``
           always started the preemption service and its SIGTERM handler).
0.10.0     ``jax_oneapi_visible_devices``, the option of Intel GPUs' visible devices
           (jax-oneapi-plugin); JAX's initialize applies ``local_device_ids`` to it
           only from 0.12 (before 0.10: no such option).
0.11.0     ``cache host callbacks``: the persistent compilation cache holds
           programs with host callbacks, and ``compiler._cache_write`` takes no
           ``host_callbacks`` (before: it took them, and wrote none of those).
0.12.0     ``jax.extend registers trace context``: importing ``jax.extend`` (as
           mpi4jax does) adds Pallas' two options to the trace context, which
           every ``jit``'s cache key holds (before: it added none).
=========  ==========================================================================
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import threading

import jax
from jax._src import clusters as _clusters
from jax._src import distributed as _distributed

ClusterEnv = _clusters.ClusterEnv


def parse_version(version: str) -> tuple[int, int, int]:
    """Return ``(major, minor, patch)`` of a version string such as ``0.8.1.dev1``."""
    numbers = [int(x) for x in re.findall(r"\d+", version)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


JAX_VERSION = parse_version(jax.__version__)

# The oldest JAX supported: install_requires in setup.cfg says the same.
FLOOR = (0, 6, 0)

# The table above: what the code uses, and the first JAX version that has it.
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
    kwargs = COORDINATOR_ADDRESS_KWARGS[0][1]
    for first, names in COORDINATOR_ADDRESS_KWARGS:
        if version >= first:
            kwargs = names
    return kwargs


def cluster_name(cls) -> str | None:
    """Return the name a ClusterEnv subclass answers to in
    ``cluster_detection_method``; None for those without one (older JAX sets it on
    some subclasses only: its Kubernetes env has none)."""
    return getattr(cls, "name", None)


def register_first(cls) -> None:
    """Move the ClusterEnv subclass ``cls`` to the front of JAX's detection order.

    Subclasses register themselves on definition, at the end of the list: asked last.
    Under an MPI launch the MPI view is the truth, so ours is asked first.
    """
    registry = ClusterEnv._cluster_types
    registry[:] = [cls] + [c for c in registry if c is not cls]


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
    # Always, unless disable_preemption_service replaced the start.
    return "initialize_preemption_sync_manager" not in vars(_distributed.global_state)


def disable_preemption_service() -> None:
    """Keep the next ``jax.distributed.initialize`` from starting JAX's preemption
    service, so that SIGTERM keeps its default action."""
    if since("jax_enable_preemption_service"):
        jax.config.update("jax_enable_preemption_service", False)
        return
    # No option: the state's start of the service becomes a no-op, as the option's
    # False makes it in later JAX (multihost_utils.reached_preemption_sync_point
    # then raises, as there).
    _distributed.global_state.initialize_preemption_sync_manager = lambda: None


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


def publish_gloo_address(address: str) -> bool:
    """Make JAX's CPU client give its Gloo collectives ``address``; return whether
    this JAX allows it.

    JAX makes Gloo's TCP collectives without an address, and Gloo then publishes the
    one its host name resolves to (127.0.1.1 on Debian-like hosts: no other node
    reaches it). jaxlib's ``make_gloo_tcp_collectives`` takes a ``hostname`` and
    JAX's CPU backend factory takes ready ``collectives`` (both since jax 0.6.0), so
    the factory is wrapped: where the collectives are gloo and a distributed client
    exists when the CPU backend is made, Gloo gets ``address``; otherwise JAX's own
    factory runs as it would. Must run before the CPU backend exists.
    """
    import dataclasses

    from jax._src import xla_bridge

    registration = xla_bridge._backend_factories.get("cpu")
    if registration is None or backends_initialized():
        return False
    own = registration.factory
    original = getattr(own, "jax_factory", own)  # ours already: wrap JAX's again
    if "collectives" not in inspect.signature(original).parameters:
        return False

    def make_cpu_client(**kwargs):
        client = _distributed.global_state.client
        if kwargs or client is None or cpu_collectives() != "gloo":
            return original(**kwargs)
        gloo = distributed_runtime().make_gloo_tcp_collectives(
            distributed_client=client, hostname=address
        )
        return original(collectives=gloo)

    make_cpu_client.jax_factory = original
    make_cpu_client.gloo_address = address
    xla_bridge._backend_factories["cpu"] = dataclasses.replace(
        registration, factory=make_cpu_client
    )
    return True


def published_gloo_address() -> str | None:
    """Return the address :func:`publish_gloo_address` gave Gloo, or None."""
    from jax._src import xla_bridge

    registration = xla_bridge._backend_factories.get("cpu")
    return getattr(registration.factory, "gloo_address", None) if registration else None


def cpu_devices_per_process() -> int:
    """Return the CPU devices each process will have: ``jax_num_cpu_devices``, else
    XLA_FLAGS' ``--xla_force_host_platform_device_count``, else 1."""
    configured = jax.config.jax_num_cpu_devices
    if configured is not None and configured > 0:
        return configured
    import os

    found = re.findall(
        r"--xla_force_host_platform_device_count[= ](\d+)",
        os.environ.get("XLA_FLAGS", ""),
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


def coordination_client():
    """Return this process's client of JAX's coordination service once
    ``jax.distributed`` is initialized, else None."""
    return _distributed.global_state.client


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


# Whether the program being compiled on this thread runs on this process's devices
# alone (set by cache_on_every_process's wrapper of compile_or_get_cached).
_compiling = threading.local()


# The parameters of JAX's ``compiler._cache_write``, which the wrapper below takes
# and hands on: a version takes the last row whose first version is <= it.
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
    params = CACHE_WRITE_PARAMS[0][1]
    for first, names in CACHE_WRITE_PARAMS:
        if version >= first:
            params = names
    return params


def cache_on_every_process() -> bool:
    """Let every process write the persistent compilation cache entries of the
    programs that run on its devices alone; return whether this JAX allows it.

    JAX's ``compiler._cache_write`` writes only where
    ``distributed.global_state.process_id == 0`` (jax 0.6.0 to today), made for SPMD
    programs that every process compiles alike: process 0's entry serves all. A
    program of one process's devices (an mpi4jax code's per-rank ``jit``) is another
    key on every process, as the key holds the device assignment (stripped on GPU
    only), so after ``jax.distributed.initialize`` the other processes' programs
    are never written and never found. Wrapped here: ``compile_or_get_cached``
    notes whether the devices are all of one process, and ``_cache_write`` then
    writes on any process, with JAX's other conditions (no host callbacks before
    jax 0.11, the minimum compile time; the minimum entry size is checked by the
    write itself). Programs over several processes keep JAX's rule. Idempotent.
    A JAX whose ``_cache_write`` takes other parameters than
    :func:`cache_write_params` says keeps its own rule (False).
    """
    from jax._src import compiler

    if hasattr(compiler._cache_write, "jax_original"):
        return True
    own_compile = compiler.compile_or_get_cached
    own_write = compiler._cache_write
    compile_params = inspect.signature(own_compile).parameters
    write_params = tuple(inspect.signature(own_write).parameters)
    if "devices" not in compile_params or write_params != cache_write_params():
        return False  # another JAX: its own rule stays
    bind = inspect.signature(own_compile).bind
    bind_write = inspect.signature(own_write).bind

    def compile_or_get_cached(*args, **kwargs):
        devices = bind(*args, **kwargs).arguments["devices"]
        flat = getattr(devices, "flat", devices)
        previous = getattr(_compiling, "one_process", False)
        _compiling.one_process = len({d.process_index for d in flat}) == 1
        try:
            return own_compile(*args, **kwargs)
        finally:
            _compiling.one_process = previous

    def cache_write(*args, **kwargs):
        if _distributed.global_state.process_id == 0 or not getattr(
            _compiling, "one_process", False
        ):
            return own_write(*args, **kwargs)
        return _write_cache_entry(**bind_write(*args, **kwargs).arguments)

    compile_or_get_cached.jax_original = own_compile
    cache_write.jax_original = own_write
    compiler.compile_or_get_cached = compile_or_get_cached
    compiler._cache_write = cache_write
    return True


def _write_cache_entry(
    cache_key, compile_time_secs, module_name, backend, executable, host_callbacks=()
) -> None:
    """JAX's ``_cache_write`` less its ``process_id != 0`` check (``host_callbacks``
    before jax 0.11 only: since, programs with them are cached)."""
    import warnings

    from jax._src import compilation_cache, compiler
    from jax._src import config as _jax_config

    if host_callbacks:
        return  # before jax 0.11: baked into the executable, never cached
    if compile_time_secs < _jax_config.persistent_cache_min_compile_time_secs.value:
        return
    try:
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs)
        )
    except Exception as err:
        check = getattr(compiler, "_should_raise_persistent_cache_error", None)
        # Older JAX (0.6.0) has no such function: the option alone decides.
        if check(err) if check else _jax_config.raise_persistent_cache_errors.value:
            raise
        warnings.warn(
            f"Error writing persistent compilation cache entry for "
            f"'{module_name}': {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=2,
        )


def opaque_trace_state():
    """JAX's current trace, opaquely: equal for calls made in the same function."""
    try:
        from jax.extend.core import get_opaque_trace_state
    except ImportError:  # jax < 0.7 has it in jax.core only
        from jax.core import get_opaque_trace_state
    return get_opaque_trace_state(convention="mpi4jax_dist")


# --- mpi4jax: the ``mpi4jax`` extra ---------------------------------------------
# The cluster env, the diagnostics and the psum paths run without it. What needs it
# asks by name (require_mpi4jax): the compiled ops share its ordered effect and
# default communicator, and cg's backend="mpi4jax" reduces with it.

MPI4JAX_EXTRA = "mpi4jax_dist[mpi4jax]"


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


# The JAX minors whose suites (the ordering, desync, fail-fast and iallreduce
# tests, mpi4jax's calls mixed with ours) ran with the runtime token reused: on
# others JAX's own path stays. Add a minor when its sweep row passes with it.
TOKEN_REUSE_RAN = ((0, 6), (0, 12))


def reuse_runtime_tokens(enabled: bool = True) -> bool:
    """Hand an ordered-effect program the last one's runtime token as it is, where
    it already sits on the program's one device; return whether that is in force.

    Why: on every call of a program with an ordered effect (mpi4jax's, which the
    package's ops share) JAX's ``RuntimeTokenSet.get_token_input`` (jax 0.6.0 to
    today) ``device_put`` s the last token onto a ``Mesh``/``NamedSharding`` built
    afresh, and the token's shard handler first waits for the last program to end
    and then copies an empty array to the device: half of a 4-byte call's 220 µs
    (docs/design.rst, the compiled op's *Dispatch*). Returning the token as it is
    keeps program order (the runtime waits on the token buffer as on any input)
    and gives up only where the last program's error is raised: at the next
    ``block_until_ready`` instead of the next dispatch (jax#25671).
    For: the JAX minors in :data:`TOKEN_REUSE_RAN`; programs over one device per
    process (several devices keep JAX's resharding). Test:
    tests/test_jax_compat.py's token tests (same token, same results, JAX's own
    method restored when turned off). Drop it when JAX's own method returns the
    token it holds (the change in docs/design.rst, ready to send). Idempotent;
    ``enabled=False`` (``MPI4JAX_DIST_TOKEN_REUSE=0``) restores JAX's method.
    """
    from jax._src import core, dispatch

    tokens = dispatch.RuntimeTokenSet
    current = tokens.get_token_input
    original = getattr(current, "jax_original", current)
    if not enabled or JAX_VERSION[:2] not in TOKEN_REUSE_RAN:
        tokens.get_token_input = original
        return False
    if current is not original:
        return True

    def get_token_input(self, eff, devices):
        token = self.current_tokens.get(eff)
        if isinstance(token, core.Token) and len(devices) == 1:
            buf = token._buf
            if not buf.is_deleted() and buf.devices() == {devices[0]}:
                return token
        return original(self, eff, devices)

    get_token_input.jax_original = original
    tokens.get_token_input = get_token_input
    return True


def mpi4jax_ordering():
    """Return ``(ordered_effect, abstract_token)``: mpi4jax's ordered effect, which
    the compiled ops carry so that one token orders mpi4jax's calls and theirs
    (mpi4jax registered it as allowed in loops and custom_vjp), and the abstract
    token its lowerings use (private in JAX 0.10; mpi4jax follows JAX's moves)."""
    from mpi4jax._src.jax_compat import abstract_token
    from mpi4jax._src.utils import ordered_effect

    return ordered_effect, abstract_token


# --- Prototype (issue 48, item 2): mpi4jax's tokens made inside the program ----------
# Self-contained: this block, config's MPI4JAX_DIST_TOKENS_IN_PROGRAM and the two
# calls beside reuse_runtime_tokens's are the whole change.

_in_program = {"main": threading.local(), "lowered": False, "drain": None}


def tokens_in_program(enabled: bool = True) -> bool:
    """Lower a one-device CPU program's main function so that the tokens of
    mpi4jax's ordered effect (the package's ops carry it) are made inside it
    (``create_token`` at entry, dropped at return), and build its executable with
    that effect in neither its ordered nor its unordered effects; return whether
    that is in force.

    Why: JAX refuses its C++ dispatch for any program with effects
    (``pjit._get_fastpath_data``), and for ordered ones adds runtime tokens to its
    inputs and outputs; a 4-byte jitted allreduce then costs ~15x ``jit(v + 1)``.
    Inside the program nothing changes: JAX still threads the effect's token
    through every effectful equation, loops, conds and nested calls included.
    Across programs, order rests on PJRT CPU: a program launched on a device waits
    for the last one launched there (``stream_event_map``'s last enqueue event) as
    it waited for its token before. ``jax.effects_barrier()`` (and JAX's exit
    clean-up, which calls it) no longer sees these programs through tokens: once
    one was lowered, it also runs an empty program on each local CPU device and
    waits for it (PJRT's launch order again: per dispatching thread, as JAX's
    runtime tokens are).
    For: CPU programs over one device (``num_partitions == 1``), in processes
    with one CPU device, whose ordered effects include mpi4jax's; any other ordered effect in the program keeps its
    runtime token. Idempotent; ``enabled=False`` restores JAX's functions (read
    before the first lowering: executables already built keep their convention).
    """
    from jax._src import dispatch
    from jax._src.interpreters import mlir

    state = _in_program
    current = (
        mlir.lower_jaxpr_to_module,
        mlir.jaxpr_subcomp,
        dispatch.RuntimeTokenSet.block_until_ready,
    )
    originals = tuple(getattr(f, "jax_original", f) for f in current)
    lower_module, subcomp, block = originals
    if not enabled:
        mlir.lower_jaxpr_to_module, mlir.jaxpr_subcomp = lower_module, subcomp
        dispatch.RuntimeTokenSet.block_until_ready = block
        return False
    if current != originals:
        return True
    if not has_mpi4jax():
        return False
    effect, _ = mpi4jax_ordering()

    def lower_jaxpr_to_module(*args, ordered_effects, **kwargs):
        platforms = tuple(kwargs.get("platforms") or ())
        # One CPU device in the process: PJRT orders launches per device, where
        # JAX's token also ordered one device's programs after another's.
        mine = (
            effect in ordered_effects
            and platforms == ("cpu",)
            and kwargs.get("num_partitions", 1) == 1
            and len(jax.local_devices(backend="cpu")) == 1
        )
        if not mine:
            return lower_module(*args, ordered_effects=ordered_effects, **kwargs)
        # The caller (pxla's lowering) returns this very list as the
        # executable's ordered effects: removed here, it is removed there.
        ordered_effects.remove(effect)
        state["main"].pending = True
        try:
            result = lower_module(*args, ordered_effects=ordered_effects, **kwargs)
        finally:
            state["main"].pending = False
        state["lowered"] = True
        return result

    def jaxpr_subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs):
        # The first subcomputation of a module lowered above is its main
        # function's body: its token for the effect starts there.
        main = state["main"]
        if getattr(main, "pending", False):
            main.pending = False
            if effect in jaxpr.effects and effect not in tokens.effects():
                tokens = mlir.TokenSet(
                    {**dict(tokens.items()), effect: mlir.hlo.create_token()}
                )
        return subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs)

    def block_until_ready(self):
        try:
            block(self)
        finally:
            if state["lowered"]:
                _drain_cpu_devices()

    wrappers = (lower_jaxpr_to_module, jaxpr_subcomp, block_until_ready)
    for new, old in zip(wrappers, originals, strict=True):
        new.jax_original = old
    mlir.lower_jaxpr_to_module = lower_jaxpr_to_module
    mlir.jaxpr_subcomp = jaxpr_subcomp
    dispatch.RuntimeTokenSet.block_until_ready = block_until_ready
    return True


def _drain_cpu_devices() -> None:
    """Run an empty program on each local CPU device and wait for it: PJRT CPU
    starts it after the last program launched there ends."""
    import jax.numpy as jnp

    if _in_program["drain"] is None:
        _in_program["drain"] = jax.jit(lambda: jnp.zeros((), jnp.bool_))
    for device in jax.local_devices(backend="cpu"):
        with jax.default_device(device):
            _in_program["drain"]().block_until_ready()
