"""A job for ``python -m mpi4jax_dist status`` (tests/jobs/test_status.py): its
ranks run allreduces until the file STOP names appears (rank 0 looks; the
allreduce itself says so to all). MODE=straggle: rank 1 sleeps LAG_S before
each. MODE=hang: after 5 calls rank 1 holds its GIL in a C call (ctypes.PyDLL)
until STOP appears, the others waiting in the 6th allreduce."""

import ctypes
import os
import time

import jax
import jax.numpy as jnp
from mpi4py import MPI

import mpi4jax_dist

jax.distributed.initialize()
rank = jax.process_index()
stop, mode = os.environ["STOP"], os.environ["MODE"]
lag_s = float(os.environ.get("LAG_S", "0.1"))
libc = ctypes.PyDLL(None)  # a PyDLL's calls keep the GIL
calls = 0
while True:
    if mode == "straggle" and rank == 1:
        time.sleep(lag_s)  # STRAGGLE LINE
    while mode == "hang" and rank == 1 and calls == 5 and not os.path.exists(stop):
        libc.usleep(500_000)  # HANG LINE
    flag = jnp.ones(1) * (rank == 0 and os.path.exists(stop))
    calls += 1
    if mpi4jax_dist.allreduce(flag, op=MPI.SUM)[0] > 0:
        break
print(f"DONE rank {rank} after {calls} calls", flush=True)
