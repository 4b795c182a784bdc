"""The failure paths of the compiled ops, one per run (tests/jobs/test_fail_safe.py).

    mpiexec -n 2 python tests/scripts/fail_safe.py SCENARIO

Each scenario makes one mistake a user can make, or one failure that can happen
between a start and its wait, and prints ``rank R: ...`` lines saying what it
saw; the test reads them, the exit status and how long the job took.

- ``callback-raises``: the work overlapped with a non-blocking allreduce raises
  (a ``pure_callback``), so the wait never runs; the donated 32 MiB buffer is
  freed by XLA while MPI's request is still pending.
- ``kept-out``: a request appended to a global list while tracing; the program
  returns the right value and exits with the request pending (32 MiB).
- ``rank0-only``: rank 0 alone starts an eager non-blocking allreduce and drops
  it: it can never complete.
- ``mismatch-first``: the ranks reduce 1,000 and 2,000 floats in 400-byte chunks
  (MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES=400, set by the test): the first call on
  the communicator.
- ``mismatch-later``: one matched call, then the same mismatch.
- ``imismatch``: the ranks start non-blocking allreduces of 1,000 and 2,000
  floats (the first on their communicator) and wait.
- ``freed-comm``: a function compiled for a 2-rank Split, called after that
  communicator was freed and a 1-rank one took its Fortran handle.
"""

import gc
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpi4jax_dist

RANK = MPI.COMM_WORLD.rank
BIG = 8 << 20  # float32 elements: 32 MiB, mmap'ed by any allocator


def say(text: str) -> None:
    # One write per line: the ranks' lines do not interleave.
    sys.stdout.write(f"rank {RANK}: {text}\n")
    sys.stdout.flush()


def churn() -> None:
    """Allocate and free memory, so that freed buffers are unmapped or reused."""
    for _ in range(4):
        a = jnp.zeros(BIG // 2) + 1.0
        a.block_until_ready()
        del a
    gc.collect()


def callback_raises():
    def boom(v):
        raise RuntimeError("injected failure in the overlapped work")

    def work(w):
        return jax.pure_callback(boom, jax.ShapeDtypeStruct(w.shape, w.dtype), w)

    def f(x, w):
        req = mpi4jax_dist.iallreduce(x)
        req, y = req.overlap(work, w)
        return req.wait(), y

    g = jax.jit(f, donate_argnums=0)
    try:
        out, _ = g(jnp.ones(BIG), jnp.ones(4))
        out.block_until_ready()
        say("run: no error")
    except Exception as err:  # noqa: BLE001 - any failure of the run will do
        say(f"run failed: {type(err).__name__}")
    churn()
    say("done")


KEPT = []


def kept_out():
    def leaks(a):
        KEPT.append(mpi4jax_dist.iallreduce(a))
        return a + 1

    out = jax.jit(leaks, donate_argnums=0)(jnp.ones(BIG))
    say(f"value {float(out[0])}")
    del out
    churn()
    say("done")


def rank0_only():
    if RANK == 0:
        req = mpi4jax_dist.iallreduce(jnp.ones(3), comm=MPI.COMM_WORLD)
        say("started")
        del req
    say("done")


def mismatch(first: bool):
    def reduce(n):
        return mpi4jax_dist.allreduce(jnp.ones(n))

    if not first:
        value = float(reduce(1000)[0])
        say(f"matched call {value}")
    n = 1000 if RANK == 0 else 2000
    try:
        out = reduce(n).block_until_ready()
        say(f"mismatched call: no error, {float(out[0])}")
    except Exception as err:  # noqa: BLE001
        say(f"mismatched call failed: {err}")


def imismatch():
    n = 1000 if RANK == 0 else 2000
    try:
        req = mpi4jax_dist.iallreduce(jnp.ones(n), comm=MPI.COMM_WORLD)
        out = req.wait().block_until_ready()
        say(f"mismatched wait: no error, {float(out[-1])}")
    except Exception as err:  # noqa: BLE001
        say(f"mismatched wait failed: {err}")


def freed_comm():
    world = MPI.COMM_WORLD
    pair = world.Split(0, RANK)
    handle = pair.py2f()
    f = jax.jit(lambda x: mpi4jax_dist.allreduce(x, comm=pair))
    say(f"before free {float(f(jnp.ones(1) * (RANK + 1))[0])}")
    pair.Free()
    alone = world.Split(RANK, 0)  # a 1-rank communicator per rank
    say(f"handle reused {alone.py2f() == handle}")
    try:
        out = f(jnp.ones(1) * (RANK + 1)).block_until_ready()
        say(f"after free: no error, {float(out[0])}")
    except Exception as err:  # noqa: BLE001
        say(f"after free failed: {err}")
    # The new communicator works as itself.
    g = jax.jit(lambda x: mpi4jax_dist.allreduce(x, comm=alone))
    say(f"new comm {float(g(jnp.ones(1) * (RANK + 1))[0])}")
    world.Barrier()


SCENARIOS = {
    "callback-raises": callback_raises,
    "kept-out": kept_out,
    "rank0-only": rank0_only,
    "mismatch-first": lambda: mismatch(True),
    "mismatch-later": lambda: mismatch(False),
    "imismatch": imismatch,
    "freed-comm": freed_comm,
}

if __name__ == "__main__":
    start = time.perf_counter()
    SCENARIOS[sys.argv[1]]()
    np.asarray(0)  # nothing pending on the host side
    say(f"main ended after {time.perf_counter() - start:.1f} s")
