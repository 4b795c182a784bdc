"""What a program of the compiled ops looks like to JAX and PJRT, with mpi4jax's
tokens made inside it or taken from JAX's runtime
(tests/jobs/test_tokens_in_program.py).

    MPI4JAX_DIST_TOKENS_IN_PROGRAM=1 \
        mpiexec -n 2 python tests/scripts/tokens_in_program.py

Prints ``rank R: key value`` lines:

- ``token-params N``: the ``!stablehlo.token`` parameters of the lowered main
  function of a program holding ours and mpi4jax's allreduces;
- ``ordered-effects N``: the ordered effects its executable was built with;
- ``python-dispatches N``: how many of 10 calls after the first went through
  JAX's Python dispatch (``pxla.ExecuteReplicated.__call__``), not its C++ path;
- ``crossed N``: results of 4 x ROUNDS (150) programs dispatched back to back (a slow
  one, whose allreduce waits for a loop that one rank runs long, then quick
  ones on independent data, the same communicator) that are not their own
  reduction: one program's allreduce met another's on the other rank;
  ``SWAP=1`` makes the last rank dispatch two of them the other way round;
- ``barrier-waited B``: whether ``jax.effects_barrier()`` returned only after a
  program still running on this rank ended.
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from jax import lax
from jax._src.interpreters import pxla
from mpi4py import MPI

import mpi4jax_dist

comm = MPI.COMM_WORLD
RANK, SIZE = comm.rank, comm.size
# Fault injection (SWAP=1): the last rank dispatches the first two programs of
# each round the other way round, as a lost order between programs would: the
# count of crossed results must see it.
SWAP = os.environ.get("SWAP") == "1" and RANK == SIZE - 1
ROUNDS = int(os.environ.get("ROUNDS", "150"))


def say(key, value):
    # One write a line: the ranks' lines then do not interleave.
    sys.stdout.write(f"rank {RANK}: {key} {value}\n")
    sys.stdout.flush()


def both(x):
    return mpi4jax.allreduce(
        mpi4jax_dist.allreduce(x, comm=comm), op=MPI.SUM, comm=comm
    )


x = jnp.arange(4.0) + RANK
lowered = jax.jit(both).lower(x)
main = re.search(r"func\.func public @main\(([^)]*)\)", lowered.as_text())[1]
say("token-params", main.count("!stablehlo.token"))
say("ordered-effects", len(lowered.compile()._executable.unsafe_call.ordered_effects))

calls = []
python_call = pxla.ExecuteReplicated.__call__


def counted(self, *args):
    calls.append(self)
    return python_call(self, *args)


f = jax.jit(both)
f(x).block_until_ready()
pxla.ExecuteReplicated.__call__ = counted
try:
    for _ in range(10):
        f(x).block_until_ready()
finally:
    pxla.ExecuteReplicated.__call__ = python_call
say("python-dispatches", len(calls))

# The matmul makes the program not "cheap" to PJRT CPU (1,000 flops or more):
# launched asynchronously, not run on the dispatching thread before it returns.
M = jnp.ones((64, 64), jnp.float32)


def slow(v, trips):
    y = lax.fori_loop(0, trips, lambda i, y: jnp.sin(y) * 1.0000001 + 0.5, v)
    return v + 0.0 * y + 0.0 * jnp.sum(M @ M)


# One site for both: their calls cross (SWAP=1) in the values this script counts,
# not as a disagreement of their lines, which the checks would raise instead.
slow_ours = jax.jit(
    lambda v, n: mpi4jax_dist.allreduce(slow(v, n), comm=comm, site="round")
)
quick_ours = jax.jit(lambda v: mpi4jax_dist.allreduce(v, comm=comm, site="round"))
quick_theirs = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))
a = jnp.full(4, float(RANK + 1), jnp.float32)
b = jnp.full(4, float(100 * (RANK + 1)), jnp.float32)
sum_a = float(sum(r + 1 for r in range(SIZE)))
sum_b = float(sum(100 * (r + 1) for r in range(SIZE)))
slow_ours(a, 0).block_until_ready()
quick_ours(b).block_until_ready()
quick_theirs(b).block_until_ready()
TRIPS = (0, 1000, 20_000, 200_000, 2_000_000)
crossed = 0
for i in range(ROUNDS):
    trips = (
        (0, 1000, 20_000, 200_000, 2_000_000)[i // SIZE % 5] if i % SIZE == RANK else 0
    )
    programs = [
        (lambda trips=trips: slow_ours(a, trips), sum_a),
        (lambda: quick_ours(b), sum_b),
        (lambda: quick_theirs(b), sum_b),
        (lambda: slow_ours(a, 0), sum_a),
    ]
    if SWAP:
        programs[0], programs[1] = programs[1], programs[0]
    outs = [(program(), expected) for program, expected in programs]
    crossed += sum(not np.all(np.asarray(o) == s) for o, s in outs)
say("crossed", crossed)

comm.Barrier()
running = slow_ours(a, 5_000_000 if RANK == 0 else 0)
jax.effects_barrier()
say("barrier-waited", running.is_ready())
sys.stdout.flush()
