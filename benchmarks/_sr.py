"""The stochastic-reconfiguration (SR) problem ``sr.py`` solves (and
tests/peers/test_cg.py's normal equations), and the user's route to it.

A VMC code's SR step keeps the ``params`` parameters on every rank and splits the
``samples`` walkers over the ranks (rows ``J_r`` of the Jacobian); the update solves
``(J^T J / N + eps) x = f``, ``f = J^T e / N``, float64. Row ``i`` of ``J`` and
``e_i`` come from a generator seeded with ``(seed, i)``, so that any rank can make
any rows. ``S = J^T J / N`` has eigenvalues ``~ 1 / (1 + j)`` (``cond=None``, the
tests) or falling exponentially to about ``eps`` with ``(lambda_max + eps) / eps =
cond`` (``sr.py``). The user's route, :func:`jax_scipy_cg`:
``jax.scipy.sparse.linalg.cg`` with :func:`user_matvec`, in one ``jax.jit``.
"""

from __future__ import annotations

import math

import numpy as np


class Jacobian:
    """``(J^T J / N + eps) x = f``: this rank's ``samples / size`` rows of ``J``."""

    def __init__(self, samples, params, eps, comm, *, cond=None, seed=1):
        from mpi4py import MPI

        if samples % comm.size:
            raise ValueError(
                f"--samples {samples} must be a multiple of the {comm.size} ranks."
            )
        self.samples, self.params, self.eps, self.comm = samples, params, eps, comm
        self.seed, self.cond, self.factor = seed, cond, 1.0
        self.walkers = samples // comm.size
        start = comm.rank * self.walkers
        self.J, e = self.rows(start, start + self.walkers)
        if cond is not None:
            # lambda_max(J^T J / N) = (cond - 1) eps, by power iteration (the gap
            # is wide: the column scales fall exponentially).
            v = np.random.default_rng([seed, params]).standard_normal(params)
            lam = 1.0
            for _ in range(40):
                w = self.J.T @ (self.J @ v)
                comm.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
                lam = np.linalg.norm(w) / samples
                v = w / np.linalg.norm(w)
            self.factor = math.sqrt((cond - 1) * eps / lam)
            self.J *= self.factor
        self.f = np.empty(params)
        comm.Allreduce(self.J.T @ e / samples, self.f, op=MPI.SUM)
        self.f_norm = float(np.linalg.norm(self.f))
        self.size = params

    def scales(self) -> np.ndarray:
        """The scales of J's columns, which set S's spectrum."""
        j = np.arange(self.params)
        if self.cond is None:
            return 1 / np.sqrt(1 + j)
        rank = max(min(self.samples, self.params) - 1, 1)
        return 10.0 ** (-0.5 * math.log10(self.cond) * np.minimum(j, rank) / rank)

    def rows(self, start: int, stop: int):
        """Rows ``start:stop`` of J and of the per-sample weights ``e``."""
        gens = [np.random.default_rng([self.seed, i]) for i in range(start, stop)]
        J = np.stack([g.standard_normal(self.params) for g in gens])
        J *= self.scales() * self.factor
        e = np.array([g.standard_normal() for g in gens])
        return J, e

    @property
    def s_bytes(self) -> int:
        return 8 * self.params**2

    def numpy_matvec(self, comm=None):
        """``v -> (J^T J / N + eps) v`` in NumPy, summed over ranks by mpi4py on
        ``comm`` (default the problem's)."""
        from mpi4py import MPI

        comm, J, out = comm or self.comm, self.J, np.empty(self.params)

        def matvec(v):
            comm.Allreduce(J.T @ (J @ v), out, op=MPI.SUM)
            return out / self.samples + self.eps * v

        return matvec

    def residual(self, x) -> float:
        """The true relative residual ``||f - A x|| / ||f||``."""
        x = np.asarray(x, dtype=np.float64)
        return float(np.linalg.norm(self.f - self.numpy_matvec()(x)) / self.f_norm)

    def device(self):
        """``(J, f, x0, eps)`` as JAX arrays, ``x0`` zero."""
        import jax.numpy as jnp

        return (
            jnp.asarray(self.J),
            jnp.asarray(self.f),
            jnp.zeros(self.params),
            jnp.asarray(self.eps),
        )


def user_matvec(J, eps, N, comm, counter=None):
    """The user's ``A``: ``mpi4jax.allreduce(J.T @ (J @ v)) / N + eps v``;
    ``counter`` is called (``jax.debug.callback``) once per call of ``A``."""
    import jax
    import mpi4jax
    from mpi4py import MPI

    def A(v):
        if counter is not None:
            jax.debug.callback(counter)
        total = mpi4jax.allreduce(J.T @ (J @ v), op=MPI.SUM, comm=comm)
        return total / N + eps * v

    return A


def jax_scipy_cg(N, comm, tol, maxiter, counter=None):
    """The user's solve, a jitted function of ``(J, f, x0, eps)``:
    ``jax.scipy.sparse.linalg.cg`` with :func:`user_matvec`, ``atol=0``."""
    import jax

    def solve(J, f, x0, eps):
        A = user_matvec(J, eps, N, comm, counter)
        x, _ = jax.scipy.sparse.linalg.cg(
            A, f, x0=x0, tol=tol, atol=0.0, maxiter=maxiter
        )
        return x

    return jax.jit(solve)
