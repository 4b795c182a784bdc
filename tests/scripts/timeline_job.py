"""A job for the timeline's tests: ``CALLS`` allreduces of float32[4] (rank
``LATE_RANK`` sleeping ``BOOT_LATE_S`` before ``jax.distributed.initialize()``
and ``LATE_S`` before each), then one iallreduce; with
``REGION=DIR`` only the allreduces are timed (``with mpi4jax_dist.timeline``),
else MPI4JAX_DIST_TIMELINE decides. Prints ``DONE``."""

import os
import time

import jax
import jax.numpy as jnp
from mpi4py import MPI

import mpi4jax_dist

late_rank = int(os.environ.get("LATE_RANK", "-1"))
late_s = float(os.environ.get("LATE_S", "0"))
if MPI.COMM_WORLD.Get_rank() == late_rank:
    time.sleep(float(os.environ.get("BOOT_LATE_S", "0")))
jax.distributed.initialize()
rank = jax.process_index()
calls = int(os.environ.get("CALLS", "10"))
step = jax.jit(lambda x: mpi4jax_dist.allreduce(x))
x = jnp.ones(4, jnp.float32)
step(x).block_until_ready()  # compiled, and the communicator set up, before timing


def steps():
    for _ in range(calls):
        if rank == late_rank:
            time.sleep(late_s)
        step(x).block_until_ready()


if os.environ.get("REGION"):
    with mpi4jax_dist.timeline(os.environ["REGION"]):
        steps()
else:
    steps()
mpi4jax_dist.iallreduce(x).wait().block_until_ready()
print("DONE", flush=True)
