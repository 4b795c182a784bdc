"""The 2-D Poisson problem, in row blocks: problem A of ``cg.py``, and the solve
``overlap.py`` delays.

The 5-point Laplacian (Dirichlet) on an ``n x n`` grid, each rank holding ``n / P``
grid rows, ``b = A x_true`` with a known random ``x_true``; its matvec for each
route the benchmarks take (mpi4py, mpi4jax, ``shard_map``, the global array).
"""

from __future__ import annotations

import numpy as np


def stencil(u, above, below, xp):
    """Return the 5-point Laplacian ``4u - neighbours`` of the row block ``u``;
    ``above``/``below``: the rows just outside it (zeros at the boundary)."""
    zero = xp.zeros_like(u[:, :1])
    up = xp.concatenate([above[None], u[:-1]])
    down = xp.concatenate([u[1:], below[None]])
    left = xp.concatenate([zero, u[:, :-1]], axis=1)
    right = xp.concatenate([u[:, 1:], zero], axis=1)
    return 4 * u - up - down - left - right


class Poisson:
    """The Poisson problem on ``n x n``, this rank's ``n / size`` grid rows."""

    def __init__(self, n: int, comm, seed: int = 0):
        if n % comm.size:
            raise ValueError(f"--n {n} must be a multiple of the {comm.size} ranks.")
        self.n, self.comm, self.seed = n, comm, seed
        self.rows = n // comm.size
        self.row0 = comm.rank * self.rows
        grid = self.x_true_rows(self.row0 - 1, self.row0 + self.rows + 1)
        self.x_true = grid[1:-1].reshape(-1)
        self.b = stencil(grid[1:-1], grid[0], grid[-1], np).reshape(-1)
        self.size = n * n

    def x_true_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the known solution (zero outside the grid)."""
        rows = [
            (
                np.random.default_rng([self.seed, i]).standard_normal(self.n)
                if 0 <= i < self.n
                else np.zeros(self.n)
            )
            for i in range(start, stop)
        ]
        return np.stack(rows)

    def numpy_matvec(self, comm=None):
        """The floor's matvec: halo rows through mpi4py ``Sendrecv`` on ``comm``
        (default the problem's)."""
        from mpi4py import MPI

        comm, n = comm or self.comm, self.n
        up = comm.rank - 1 if comm.rank > 0 else MPI.PROC_NULL
        down = comm.rank + 1 if comm.rank < comm.size - 1 else MPI.PROC_NULL
        above, below = np.zeros(n), np.zeros(n)

        def matvec(v):
            u = v.reshape(-1, n)
            comm.Sendrecv(np.ascontiguousarray(u[-1]), down, 0, above, up, 0)
            comm.Sendrecv(np.ascontiguousarray(u[0]), up, 1, below, down, 1)
            return stencil(u, above, below, np).reshape(-1)

        return matvec

    def mpi4jax_matvec(self):
        """The mpi4jax backend's matvec: halo rows through ``mpi4jax.sendrecv``."""
        import jax.numpy as jnp
        import mpi4jax
        from mpi4py import MPI

        comm, n, rank, size = self.comm, self.n, self.comm.rank, self.comm.size
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL

        def matvec(v):
            u = v.reshape(-1, n)
            above = mpi4jax.sendrecv(u[-1], u[-1], up, down, comm=comm)
            below = mpi4jax.sendrecv(u[0], u[0], down, up, comm=comm)
            # A receive from PROC_NULL leaves the buffer undefined: zero it.
            if rank == 0:
                above = jnp.zeros_like(above)
            if rank == size - 1:
                below = jnp.zeros_like(below)
            return stencil(u, above, below, jnp).reshape(-1)

        return matvec

    def shard_matvec(self, mesh):
        """The psum backend's matvec, inside shard_map: halos by ``lax.ppermute``."""
        import jax.numpy as jnp
        from jax import lax

        axis, size, n = mesh.axis_names[0], mesh.devices.size, self.n
        to_next = [(i, i + 1) for i in range(size - 1)]
        to_previous = [(i + 1, i) for i in range(size - 1)]

        def matvec(v):
            u = v.reshape(-1, n)
            above = lax.ppermute(u[-1], axis, to_next)  # zeros on the first block
            below = lax.ppermute(u[0], axis, to_previous)
            return stencil(u, above, below, jnp).reshape(-1)

        return matvec

    def global_matvec(self):
        """The matvec on the global sharded vector (XLA partitions it)."""
        import jax.numpy as jnp

        n = self.n

        def matvec(v):
            zero = jnp.zeros((n,), v.dtype)
            return stencil(v.reshape(n, n), zero, zero, jnp).reshape(-1)

        return matvec
