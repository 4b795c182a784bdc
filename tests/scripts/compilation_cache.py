"""Per-rank programs (an mpi4jax code's: each rank jits for its own device) under
``jax.distributed`` with JAX's persistent compilation cache in ``cache_dir``.

Usage: python compilation_cache.py cache_dir
Prints one ``RESULT`` line per rank: the cache's lookups (``requests``) and hits,
counted from JAX's monitoring events, and the seconds the first calls took.
"""

import sys
import time

import jax
from launch_common import report

import mpi4jax_dist  # noqa: F401  (registers the cluster env)

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

events: dict[str, int] = {}


def count(name, **_):
    events[name] = events.get(name, 0) + 1


jax.monitoring.register_event_listener(count)
jax.distributed.initialize()

import jax.numpy as jnp  # noqa: E402

rank = jax.process_index()
device = jax.local_devices()[0]
# A program every rank compiles alike, and one whose shape is the rank's own (a
# boundary rank's halo, say): keys differ per rank either way (device ids).
x = jax.device_put(jnp.ones((32, 32)), device)
edge = jax.device_put(jnp.ones(8 + rank), device)
start = time.perf_counter()
jax.jit(lambda a: jnp.sin(a) @ a.T)(x).block_until_ready()
jax.jit(lambda a: jnp.cumsum(a * 2.0))(edge).block_until_ready()
seconds = time.perf_counter() - start
report(
    rank=rank,
    requests=events.get("/jax/compilation_cache/compile_requests_use_cache", 0),
    hits=events.get("/jax/compilation_cache/cache_hits", 0),
    seconds=round(seconds, 3),
)
