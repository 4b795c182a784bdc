"""Each jitted function is traced once, also one traced before the package's first
calls: those calls leave JAX's trace context as importing mpi4jax_dist made it.

(jax 0.12: a first allreduce imported mpi4jax, whose import of jax.extend added
Pallas' options to the trace context that every jit's cache key holds; each
function traced before was then traced and compiled again on its next call.)

Prints one ``RESULT {json}`` per rank: the trace context's size after import and at
the end, and how often each function was traced over its calls.
"""

import json

import jax
import jax.numpy as jnp
from jax._src import config
from mpi4py import MPI

import mpi4jax_dist

CALLS = 3
before = len(config.trace_context())
traces: dict = {}


def counted(name, fn):
    """``jax.jit(fn)`` that counts its traces under ``name``."""
    traces[name] = 0

    def traced(*args):
        traces[name] += 1
        return fn(*args)

    return jax.jit(traced)


x = jnp.arange(4.0)
plain = counted("plain", lambda v: v + 1)
plain(x).block_until_ready()  # traced before the package's first calls
functions = {
    "allreduce": counted("allreduce", mpi4jax_dist.allreduce),
    "iallreduce": counted("iallreduce", lambda v: mpi4jax_dist.iallreduce(v).wait()),
    "cg": counted("cg", lambda v: mpi4jax_dist.cg(lambda u: 2.0 * u, v)[0]),
    "plain": plain,
}
for _ in range(CALLS):
    for fn in functions.values():
        fn(x).block_until_ready()
print(
    "RESULT "
    + json.dumps(
        {
            "rank": MPI.COMM_WORLD.rank,
            "before": before,
            "after": len(config.trace_context()),
            "traces": traces,
        }
    ),
    flush=True,
)
