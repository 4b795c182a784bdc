"""One stochastic-reconfiguration (SR) step with mpi4jax_dist.cg: mpiexec -n 2 python
examples/sr_step.py

Variational Monte Carlo as codes such as JAX_QMC run it: the parameters theta are
the same on every rank, the walkers are split over the ranks, and each rank holds
its rows J_r of the Jacobian J = d log psi / d theta. The SR update x solves

    (S + eps) x = f,   S = J^T J / N,   f = J^T (E_loc - <E_loc>) / N

(J centred, N all walkers) by CG; the matvec sums over the ranks with one
mpi4jax.allreduce. Moving to mpi4jax_dist.cg is one changed line: the same
arguments, and an info (iterations, reductions, converged, ...) where
jax.scipy.sparse.linalg.cg returns None.
"""

import jax
import jax.numpy as jnp
import mpi4jax
from mpi4py import MPI

import mpi4jax_dist  # registers the MPI cluster env with JAX; starts nothing

jax.config.update("jax_enable_x64", True)  # float64, as VMC codes solve SR
jax.distributed.initialize()  # coordinator, process count and id from MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# A toy log-wavefunction of one particle in 3D: a one-layer network times a
# Gaussian. theta packs W (HIDDEN x 3), a (HIDDEN) and v (HIDDEN).
HIDDEN = 32
N_PARAMS = 5 * HIDDEN


def log_psi(theta, r):
    W = theta[: 3 * HIDDEN].reshape(HIDDEN, 3)
    a, v = theta[3 * HIDDEN : 4 * HIDDEN], theta[4 * HIDDEN :]
    return jnp.sum(v * jnp.tanh(W @ r + a)) - 0.5 * r @ r


def local_energy(theta, r):
    """E_loc = (H psi) / psi for H = -1/2 laplacian + 1/2 r^2."""
    grad = jax.grad(log_psi, argnums=1)
    laplacian = jnp.trace(jax.jacfwd(grad, argnums=1)(theta, r))
    g = grad(theta, r)
    return -0.5 * (laplacian + g @ g) + 0.5 * r @ r


WALKERS_PER_RANK = 64  # on 2 ranks fewer walkers than parameters: S is singular
N = WALKERS_PER_RANK * size  # and eps makes the system definite, as in VMC
theta = 0.5 * jax.random.normal(jax.random.key(0), (N_PARAMS,))  # same on all ranks
# This rank's walkers (a real run draws them by Metropolis sampling of |psi|^2).
walkers = jax.random.normal(jax.random.key(1 + rank), (WALKERS_PER_RANK, 3))


def total(x):
    """Sum over the ranks (mpi4jax 0.9 returns the array alone)."""
    return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)


@jax.jit
def sr_step(theta, walkers, x0, eps=1e-3):
    # This rank's rows of the Jacobian, one per walker: (walkers, N_PARAMS).
    J = jax.vmap(jax.grad(log_psi), in_axes=(None, 0))(theta, walkers)
    e = jax.vmap(local_energy, in_axes=(None, 0))(theta, walkers)
    J = J - total(J.sum(axis=0)) / N  # centred over all walkers
    e = e - total(e.sum()) / N
    f = total(J.T @ e) / N  # the energy gradient (up to a factor 2)

    def A(x):  # (S + eps) x: one allreduce of N_PARAMS floats per call
        return total(J.T @ (J @ x)) / N + eps * x

    # Before:  x, _ = jax.scipy.sparse.linalg.cg(A, f, x0=x0, tol=1e-5, atol=0.0,
    #                                            maxiter=200)
    x, info = mpi4jax_dist.cg(A, f, x0=x0, tol=1e-5, atol=0.0, maxiter=200)

    # Only to show that the update is JAX's: the same solve by jax.scipy.
    x_jax, _ = jax.scipy.sparse.linalg.cg(A, f, x0=x0, tol=1e-5, atol=0.0, maxiter=200)
    return x, info, x_jax


x0 = jnp.zeros(N_PARAMS)  # a real run warm-starts from the previous update
x, info, x_jax = sr_step(theta, walkers, x0)
theta = theta - 0.05 * x  # the SR step (learning rate 0.05)

difference = float(jnp.linalg.norm(x - x_jax) / jnp.linalg.norm(x_jax))
print(
    f"rank {rank}/{size}: iterations {int(info.iterations)}, "
    f"reductions {int(info.reductions)} (A's allreduce, one per iteration), "
    f"converged {bool(info.converged)}, rel. residual "
    f"{float(info.rel_residual):.2e}, |x - x_jax.scipy| / |x| = {difference:.1e}",
    flush=True,
)
assert difference < 1e-8, "mpi4jax_dist.cg's update differs from jax.scipy's"
