"""Ranks that wait in calls MPI cannot match (tests/jobs/test_standstill.py).

Every rank first makes one matching jitted ``mpi4jax_dist.allreduce`` on
``COMM_WORLD`` and prints ``READY``; then ``CASE`` decides what the ranks do, the
last rank (``odd``) the other thing:

- ``padding``: 4 float32 against ``LARGE`` (default 32): messages padded to
  different sizes, one blocking, one not;
- ``kind``: ``allreduce`` against ``iallreduce`` and its wait, of ``LARGE``
  (default 4) float32;
- ``extra``: one more call on the others, none on the odd rank, which ends;
- ``trips``: a ``fori_loop`` of 3 calls against one of 5, in one jit;
- ``comm``: the odd rank calls on a duplicate of the world, the others on it;
- ``helper``: in one jit, two calls of one helper (one source line) on two new
  duplicates of the world, in the other order on the odd rank: every rank waits
  in call #1 of that line, on another communicator;
- ``exit``: the odd rank calls ``sys.exit(0)`` while the others call;
- ``live``: every rank alike, ``STEPS`` allreduces, each started late where
  the test preloads tests/pmpi/slow_own.c (a long transfer); with ``SPLIT=1`` on
  two halves of the world at once (two communicators, each call complete on its
  own);
- ``ahead``: every rank alike, jitted steps of ``WORK`` trips of compute and one
  allreduce, as many as take ``SECONDS``, dispatched ahead, the result read at the
  end, at a line that differs between odd and even ranks (the main thread waits
  in C throughout).

Each rank prints ``RESULT <rank> <values>`` for what it got, and ``DONE``.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpi4jax_dist

jax.distributed.initialize()

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
odd = rank == size - 1
case = os.environ.get("CASE", "")
x = jnp.arange(4, dtype=jnp.float32) + rank


def allreduce(v, on=comm):
    return mpi4jax_dist.allreduce(v, op=MPI.SUM, comm=on)


def iallreduce(v):
    return mpi4jax_dist.iallreduce(v, op=MPI.SUM, comm=comm).wait()


jax.jit(allreduce)(x).block_until_ready()
print(f"READY {rank}", flush=True)
out = x
if case == "padding":
    n = int(os.environ.get("LARGE", "32")) if odd else 4
    out = jax.jit(allreduce)(jnp.ones(n, jnp.float32))
elif case == "kind":
    v = jnp.ones(int(os.environ.get("LARGE", "4")), jnp.float32)
    out = jax.jit(iallreduce if odd else allreduce)(v)
elif case == "extra":
    if not odd:
        out = jax.jit(allreduce)(x)
elif case == "trips":
    trips = 5 if odd else 3
    out = jax.jit(lambda v: lax.fori_loop(0, trips, lambda i, w: allreduce(w), v))(x)
elif case == "comm":
    other = comm.Dup()
    out = jax.jit(lambda v: allreduce(v, other if odd else comm))(x)
elif case == "helper":
    rows, cols = comm.Dup(), comm.Dup()

    def helper(v, on):
        return mpi4jax_dist.allreduce(v, comm=on)

    first, second = (cols, rows) if odd else (rows, cols)
    out = jax.jit(lambda v: helper(helper(v, first), second))(x)
elif case == "exit":
    if odd:
        sys.exit(0)
    out = jax.jit(allreduce)(x)
elif case == "live":
    on = comm.Split(rank % 2) if os.environ.get("SPLIT") else comm
    step = jax.jit(lambda v: allreduce(v, on))
    for _ in range(int(os.environ.get("STEPS", "2"))):
        out = step(out)
elif case == "ahead":
    import math
    import time

    work = int(os.environ.get("WORK", "600"))

    @jax.jit
    def step(v):
        v = lax.fori_loop(0, work, lambda i, w: jnp.sin(w) + 1.0, v)
        return allreduce(v) / size

    v = jnp.ones(1 << 16, jnp.float32)
    # As many steps as fill SECONDS on the slowest rank (one step timed after its
    # compile), so that the main thread waits in C that long whatever the machine.
    v = step(v).block_until_ready()
    start = time.monotonic()
    v = step(v).block_until_ready()
    slowest = comm.allreduce(time.monotonic() - start, op=MPI.MAX)
    steps = math.ceil(float(os.environ.get("SECONDS", "10")) / slowest)
    start = time.monotonic()
    for _ in range(steps):
        v = step(v)  # returns at once, or waits in C where the queue is full
    dispatched = time.monotonic()
    # Each rank waits at a line of its own: one place shared by every rank would be
    # no hang anyway; here only the calls that end say that the job moves on.
    if rank % 2:
        v.block_until_ready()
    else:
        np.asarray(v)
    end = time.monotonic()
    print(
        f"WAITED {rank} {end - dispatched:.1f} DISPATCH {dispatched - start:.1f}"
        f" STEPS {steps}",
        flush=True,
    )
    out = v[:4]
else:
    raise SystemExit(f"standstill.py: CASE={case!r} is not one it knows")
values = np.asarray(out)
print(f"RESULT {rank} {values.dtype}{values.ravel().tolist()}", flush=True)
print(f"DONE {rank}", flush=True)
