"""Where an SR step's time goes: mpiexec -n 4 python examples/sr_timeline.py

Ten stochastic-reconfiguration steps of a variational Monte Carlo code, timed by
the package's timeline (docs/timeline.rst): each step samples (here: a chain of
matrix products standing for the walkers' moves; ``SLOW=2`` makes rank 1's twice
as long), forms this rank's rows J_r of the Jacobian, and solves
``(J^T J / N + eps) x = f`` by ``mpi4jax_dist.cg`` with one
``mpi4jax_dist.allreduce`` of the ``N_PARAMS`` floats per matvec (the parameters
are replicated, so the CG's dot products need none). Rank 0 then prints the
timeline's summary (written to ``TIMELINE_DIR``, default ./sr_timeline): how
much of a step the allreduces take, how much of that is waiting for the last
rank, and who it is.
"""

import os

import jax
import jax.numpy as jnp
from mpi4py import MPI

import mpi4jax_dist
from mpi4jax_dist.diagnostics import timeline as timeline_report

jax.config.update("jax_enable_x64", True)
jax.distributed.initialize()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
N_PARAMS, WALKERS, MOVES = 2000, 256, 200
N = WALKERS * size
moves = int(MOVES * (float(os.environ.get("SLOW", "1")) if rank == 1 else 1))


@jax.jit
def sample(key):
    """This rank's walkers after ``moves`` moves, and their rows of J and E_loc."""
    r = jax.random.normal(key, (WALKERS, 64))
    mix = jax.random.normal(jax.random.key(7), (64, 64)) / 8
    r = jax.lax.fori_loop(0, moves, lambda _, r: jnp.tanh(r @ mix), r)
    basis = jax.random.normal(jax.random.key(8), (64, N_PARAMS)) / 8
    J = jnp.tanh(r @ basis)
    return J - mpi4jax_dist.allreduce(J.sum(axis=0), comm=comm) / N, r.sum(axis=1)


@jax.jit
def solve(J, e, eps=1e-3):
    f = mpi4jax_dist.allreduce(J.T @ (e - e.mean()), comm=comm) / N

    def A(x):
        return mpi4jax_dist.allreduce(J.T @ (J @ x), comm=comm) / N + eps * x

    x, info = mpi4jax_dist.cg(A, f, tol=1e-8, atol=0.0, maxiter=50)
    return x


solve(*sample(jax.random.key(rank))).block_until_ready()  # compiled before timing
folder = os.environ.get("TIMELINE_DIR", "sr_timeline")  # on a folder every node sees
with mpi4jax_dist.timeline(folder):
    for step in range(10):
        x = solve(*sample(jax.random.key(100 * step + rank)))
        x.block_until_ready()
comm.Barrier()  # every rank's files written
if rank == 0:
    print(timeline_report.report(folder), flush=True)
