"""Differences between JAX versions, every use of JAX's private modules, and the
optional dependency mpi4jax with the private names of it this package shares, in
one module of each concern:

- ``versions.py``: the table below as data (``CHANGES``), and :func:`since`, by
  which every function here chooses, nowhere else;
- ``jax_api.py``: what the package asks of JAX and calls in it, alike on every
  version (JAX's private modules read there, never changed);
- ``patches.py``: every change made to JAX itself, each with why, for which
  versions, the tests that show it is needed and when to drop it;
- ``extra.py``: mpi4jax, the optional dependency, and its private names.

Callers import the package (``from mpi4jax_dist import _compat``) and use the names
gathered here (``_compat.since``, ``_compat.reuse_runtime_tokens``).

Supported: jax 0.6.0 (``FLOOR``, the floor in setup.cfg) up to today. ``CHANGES``
is the table of what changed since, one row per difference the code meets. The
test of this package (tests/jobs/test_jax_compat.py) checks every row against the JAX
it runs with: CI's runs on the oldest and the newest JAX keep the table true at
both ends.

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

from .extra import (  # noqa: F401
    MPI4JAX_EXTRA,
    has_mpi4jax,
    mpi4jax_missing,
    mpi4jax_ordering,
    one_version_warning,
    require_mpi4jax,
)
from .jax_api import (  # noqa: F401
    ClusterEnv,
    backends_initialized,
    cluster_name,
    cluster_types_after,
    complete_trace_context,
    coordination_client,
    coordination_counters,
    cpu_collectives,
    cpu_devices_per_process,
    distributed_runtime,
    distributed_state,
    enable_x64,
    initialize_accepts,
    make_mesh,
    opaque_trace_state,
    preemption_service,
    raise_config_defaults,
    restrict_visible_devices,
    runtime_heartbeat,
    shard_map,
    silence_proxy_check,
    unregister_event_duration_listener,
)
from .patches import (  # noqa: F401
    TOKEN_REUSE_RAN,
    TOKENS_IN_PROGRAM_RAN,
    cache_on_every_process,
    disable_preemption_service,
    publish_gloo_address,
    published_gloo_address,
    register_first,
    reuse_runtime_tokens,
    tokens_in_program,
)
from .versions import (  # noqa: F401
    CACHE_WRITE_PARAMS,
    CHANGES,
    COORDINATOR_ADDRESS_KWARGS,
    FLOOR,
    JAX_VERSION,
    cache_write_params,
    coordinator_address_kwargs,
    parse_version,
    since,
)
