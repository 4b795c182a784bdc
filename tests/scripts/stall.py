"""A job with one stalled rank (tests/test_hangs.py, tests/test_slurm_cluster.py).

Every rank makes 3 jitted ``mpi4jax_dist.allreduce`` calls, prints ``READY``; then
rank ``STALL_RANK`` (default the last) prints ``STALL <epoch seconds>`` and sleeps
``STALL_S`` seconds in ``stalled_compute`` while the others enter a 4th call
(``MODE=allreduce``, the default) or wait on an ``iallreduce`` (``MODE=iallreduce``).
With ``GIL=1`` the stalled rank holds Python's GIL instead of sleeping (a C call
that never releases it: ``time.sleep`` inside ``ctypes.pythonapi``). Prints
``DONE`` at the end.
"""

import ctypes
import os
import time

import jax
import jax.numpy as jnp

import mpi4jax_dist

jax.distributed.initialize()

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
stall = int(os.environ.get("STALL_RANK", size - 1))
mode = os.environ.get("MODE", "allreduce")

step = jax.jit(lambda x: mpi4jax_dist.allreduce(x, comm=comm) / size)


def overlapped(x):
    request = mpi4jax_dist.iallreduce(x, comm=comm)
    return request.wait()


later = step if mode == "allreduce" else jax.jit(overlapped)
x = jnp.ones(4)
for _ in range(3):
    x = step(x)
x.block_until_ready()
print(f"READY {rank}", flush=True)


def stalled_compute():
    seconds = float(os.environ.get("STALL_S", "600"))
    if os.environ.get("GIL") == "1":
        # usleep through the C API with the GIL held: no Python thread runs.
        ctypes.PyDLL(None).usleep(int(seconds * 1e6))
    else:
        time.sleep(seconds)


if rank == stall:
    print(f"STALL {time.time():.3f}", flush=True)
    stalled_compute()
x = later(x).block_until_ready()
print(f"DONE {rank}", flush=True)
