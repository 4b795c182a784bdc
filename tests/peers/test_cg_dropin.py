"""The drop-in for jax.scipy.sparse.linalg.cg: mpiexec -n 2 (and 4) python -m pytest
--with-mpi tests/peers/test_cg_dropin.py.

Each test makes the same call to ``jax.scipy.sparse.linalg.cg`` and to
``mpi4jax_dist.cg`` and compares the answers, on the SR pattern of a variational
Monte Carlo code (parameters replicated, samples split over ranks, one
``mpi4jax.allreduce`` in ``A``), with pytrees, a preconditioner, ``atol``, under
``jit`` and ``grad``; then with vectors split over ranks (``comm=``) and over a mesh
(``mesh=``). The tests at the end need no peers and also run serially.
"""

import numpy as np
import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import cg
from mpi4jax_dist.solvers import counting

mpi = pytest.mark.mpi(min_size=2)
PARAMS, SAMPLES = 40, 24  # per rank: fewer samples than parameters, as in SR
EPS = 1e-3


@pytest.fixture(scope="module")
def float64():
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(scope="module")
def x64(world, float64):
    """float64, in a JAX job of every rank."""


class SR:
    """``(sum_r J_r^T J_r / N + eps) x = f``: J_r this rank's rows, f replicated."""

    def __init__(self, comm):
        import jax.numpy as jnp
        import mpi4jax
        from mpi4py import MPI

        self.comm = comm
        rows = np.random.default_rng(comm.rank).standard_normal((SAMPLES, PARAMS))
        self.J = jnp.asarray(rows / np.sqrt(1 + np.arange(PARAMS)))
        self.f = jnp.asarray(np.random.default_rng(99).standard_normal(PARAMS))
        self.N = SAMPLES * comm.size

        def A_of(J):
            def A(x):
                return mpi4jax.allreduce(J.T @ (J @ x), op=MPI.SUM, comm=comm) / self.N

            return lambda x: A(x) + EPS * x

        self.A_of = A_of

    def dense(self):
        """S as NumPy, from every rank's rows."""
        J = np.concatenate(self.comm.allgather(np.asarray(self.J)))
        return J.T @ J / self.N + EPS * np.eye(PARAMS)


@pytest.fixture(scope="module")
def sr(x64):
    from mpi4py import MPI

    return SR(MPI.COMM_WORLD)


def both(sr, call, **options):
    """Run ``call(solver, J, f)`` under jit with JAX's cg and with the drop-in."""
    import jax

    reference = jax.jit(lambda J, f: call(jax.scipy.sparse.linalg.cg, J, f))
    ours = jax.jit(
        lambda J, f: call(lambda *a, **k: mpi4jax_dist.cg(*a, **k, **options), J, f)
    )
    return reference(sr.J, sr.f), ours(sr.J, sr.f)


@mpi
def test_their_call_gives_jax_answer_bit_for_bit(sr):
    import jax.numpy as jnp

    def call(solver, J, f):
        x0 = jnp.zeros_like(f)
        return solver(sr.A_of(J), f, x0=x0, tol=1e-5, atol=0.0, maxiter=200)

    (x_ref, info_ref), (x, info) = both(sr, call)
    all_ranks(info_ref is None, "JAX's info is None")
    all_ranks(
        bool(jnp.all(x == x_ref)),
        f"classic differs from JAX's cg by {float(jnp.max(jnp.abs(x - x_ref)))}",
    )
    # One reduction per iteration, A's allreduce; the dot products are local.
    it = int(info.iterations)
    all_ranks(0 < it < 200 and bool(info.converged), f"info {info}")
    all_ranks(int(info.reductions) == it == int(info.matvecs), f"info {info}")
    S = sr.dense()
    true = np.linalg.norm(np.asarray(sr.f) - S @ np.asarray(x)) / np.linalg.norm(sr.f)
    all_ranks(abs(true - float(info.rel_residual)) < 1e-12, f"{true} vs {info}")


@mpi
@pytest.mark.parametrize("variant", cg.VARIANTS)
def test_every_variant_reaches_the_answer(sr, variant):
    x, info = mpi4jax_dist.cg(
        sr.A_of(sr.J), sr.f, tol=1e-10, maxiter=500, variant=variant
    )
    expected = np.linalg.solve(sr.dense(), np.asarray(sr.f))
    error = np.linalg.norm(np.asarray(x) - expected) / np.linalg.norm(expected)
    all_ranks(error < 1e-7 and bool(info.converged), f"error {error:.3g}, {info}")
    # Only A's allreduce communicates: one per matvec in the loop.
    all_ranks(int(info.reductions) == int(info.matvecs), f"info {info}")


@mpi
def test_pytree_preconditioner_and_atol_as_jax(sr):
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    half = PARAMS // 2

    def call(solver, J, f):
        A = sr.A_of(J)

        def A_tree(t):  # the parameters as two named blocks
            y = A(jnp.concatenate([t["a"], t["b"]]))
            return {"a": y[:half], "b": y[half:]}

        # Jacobi: S's diagonal, the same on every rank (as M must be).
        diag = mpi4jax.allreduce(jnp.sum(J * J, axis=0), op=MPI.SUM, comm=sr.comm)
        diag = diag / sr.N + EPS

        def M(t):
            return {"a": t["a"] / diag[:half], "b": t["b"] / diag[half:]}

        b = {"a": f[:half], "b": f[half:]}
        x0 = {"a": jnp.full(half, 0.1), "b": jnp.zeros(PARAMS - half)}
        return solver(A_tree, b, x0, tol=0.0, atol=1e-3, maxiter=300, M=M)

    (x_ref, _), (x, info) = both(sr, call)
    for key in ("a", "b"):  # rounding apart: JAX sums the leaves' dot products
        diff = float(
            jnp.max(jnp.abs(x[key] - x_ref[key])) / jnp.max(jnp.abs(x_ref[key]))
        )
        all_ranks(diff < 1e-6, f"x[{key!r}] differs from JAX's by {diff} (relative)")
    # atol stopped it: the residual's norm, not relative to ||b||.
    norm_b = float(jnp.linalg.norm(sr.f))
    residual = float(info.recurrence_residual) * norm_b
    all_ranks(bool(info.converged) and residual <= 1e-3, f"{residual}, {info}")


@mpi
def test_gradient_as_jax(sr):
    import jax
    import jax.numpy as jnp

    def loss(solver):
        def value(J, f):
            x, _ = solver(sr.A_of(J), f, tol=1e-12, maxiter=500)
            return jnp.sum(x**2)

        return jax.jit(jax.grad(value, argnums=(0, 1)))

    ref = loss(jax.scipy.sparse.linalg.cg)(sr.J, sr.f)
    ours = loss(mpi4jax_dist.cg)(sr.J, sr.f)
    for name, r, o in zip(("dJ", "df"), ref, ours, strict=True):
        diff = float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r)))
        all_ranks(diff < 1e-6, f"{name} differs from JAX's by {diff:.3g} (relative)")


class Split:
    """``(diag(d) + c 1 1^T) x = b`` with ``x`` split over ranks in blocks: ``A``'s
    rank-one part sums over ranks (one reduction), the dot products must too."""

    BLOCK = 12

    def __init__(self, comm):
        n = self.BLOCK * comm.size
        self.d = 1.0 + np.arange(n) / n
        self.c = 0.5
        self.b = np.random.default_rng(3).standard_normal(n)
        self.x = np.linalg.solve(np.diag(self.d) + self.c, self.b)
        self.block = slice(comm.rank * self.BLOCK, (comm.rank + 1) * self.BLOCK)


# At 4 ranks, classic alone: the drop-in's comm= over four blocks (every variant's
# reductions over four ranks are test_cg.py's problem A).
@mpi
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(v, marks=util.more_ranks) if v == "classic" else v
        for v in cg.VARIANTS
    ],
)
def test_split_vectors_reduce_their_dot_products(x64, variant):
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = Split(comm)
    d = jnp.asarray(p.d[p.block])

    def A(v):
        return d * v + p.c * mpi4jax.allreduce(jnp.sum(v), op=MPI.SUM, comm=comm)

    x, info = mpi4jax_dist.cg(
        A, jnp.asarray(p.b[p.block]), tol=1e-12, comm=comm, variant=variant
    )
    error = np.max(np.abs(np.asarray(x) - p.x[p.block]))
    all_ranks(error < 1e-9 and bool(info.converged), f"error {error}, {info}")
    per = cg.REDUCTIONS_PER_ITERATION[variant] + 1  # the dot products', A's
    # A residual replacement (pipelined) applies A four times, one reduction each.
    expected = int(info.iterations) * per + int(info.matvecs - info.iterations)
    all_ranks(int(info.reductions) == expected, f"expected {expected}: {info}")


@mpi
@util.more_ranks  # psum over a mesh of four
def test_sharded_vectors_reduce_over_the_mesh(x64):
    import jax.numpy as jnp
    from jax import lax
    from mpi4py import MPI

    p = Split(MPI.COMM_WORLD)
    mesh = mpi4jax_dist.global_mesh()
    axis = mesh.axis_names[0]
    d = mpi4jax_dist.to_global(jnp.asarray(p.d[p.block]), mesh)

    def A(v):  # inside shard_map: this device's block
        block = jnp.asarray(p.d).reshape(-1, Split.BLOCK)[lax.axis_index(axis)]
        return block * v + p.c * lax.psum(jnp.sum(v), axis)

    b = mpi4jax_dist.to_global(jnp.asarray(p.b[p.block]), mesh)
    x, info = mpi4jax_dist.cg(A, b, x0=jnp.zeros_like(d), tol=1e-12, mesh=mesh)
    error = np.max(np.abs(np.asarray(mpi4jax_dist.to_local(x)) - p.x[p.block]))
    all_ranks(error < 1e-9 and bool(info.converged), f"error {error}, {info}")
    expected = int(info.iterations) * 3  # classic's two, A's psum
    all_ranks(int(info.reductions) == expected, f"expected {expected}: {info}")


# ---------------------------------------------------------------------------------
# No peers needed


def test_the_module_is_the_function(float64):
    import jax.numpy as jnp

    A = jnp.diag(jnp.arange(1.0, 6.0))
    b = jnp.ones(5)
    x, info = mpi4jax_dist.cg(A, b)  # a matrix, as jax.scipy takes it
    np.testing.assert_allclose(np.asarray(x), 1 / np.arange(1.0, 6.0), rtol=1e-5)
    assert isinstance(info, cg.CGInfo)
    assert int(info.reductions) == 0  # nothing communicates
    assert callable(mpi4jax_dist.cg) and mpi4jax_dist.cg.cg is cg.cg


def test_comm_self_reduces_nothing(float64):
    import jax.numpy as jnp
    from mpi4py import MPI

    x, info = mpi4jax_dist.cg(
        lambda v: 2.0 * v, jnp.ones(4), comm=MPI.COMM_SELF, variant="classic"
    )
    np.testing.assert_allclose(np.asarray(x), 0.5)
    assert int(info.reductions) == 0 and int(info.iterations) == 1


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda A, b: mpi4jax_dist.cg(np.ones((2, 3)), b), "A has shape"),
        (lambda A, b: mpi4jax_dist.cg("A", b), "not a linear operator"),
        (lambda A, b: mpi4jax_dist.cg(A, b, M=np.ones(3)), "M has shape"),
        (lambda A, b: mpi4jax_dist.cg(A, b, x0=[b]), "same tree structure"),
        (lambda A, b: mpi4jax_dist.cg(A, b, x0=b[:2]), "must match"),
        (lambda A, b: mpi4jax_dist.cg(A, b, atol=-1.0), "atol=-1.0"),
        (lambda A, b: mpi4jax_dist.cg(A, b, variant="cgs"), "variant='cgs'"),
        (lambda A, b: mpi4jax_dist.cg(A, b, backend="nccl"), "backend='nccl'"),
        (lambda A, b: mpi4jax_dist.cg(A, b, backend="local", mesh=1), "mesh= is for"),
        (lambda A, b: mpi4jax_dist.cg(A, b, comm=1, mesh=1), "exclude each other"),
        (lambda A, b: mpi4jax_dist.cg(A, {}), "holds no array"),
    ],
)
def test_bad_calls_are_named(call, match):
    import jax.numpy as jnp

    with pytest.raises((ValueError, TypeError), match=match):
        call(lambda v: v, jnp.ones(3))


def test_traced_reductions_are_those_that_communicate():
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from jax import lax
    from mpi4py import MPI

    world, one = MPI.COMM_WORLD, MPI.COMM_SELF
    many = world.Get_size() > 1

    def count(fn):
        return counting.reductions(jax.make_jaxpr(fn)(jnp.ones(3)))

    def two(v):  # two allreduces over the world, one over COMM_SELF
        v = mpi4jax.allreduce(v, op=MPI.SUM, comm=world)
        v = mpi4jax.allreduce(v, op=MPI.SUM, comm=one)
        return mpi4jax_dist.allreduce(v, op=MPI.SUM, comm=world)

    assert count(two) == (2 * many, ())
    assert count(jax.jit(two)) == (2 * many, ())  # inside a nested jit
    scanned = count(lambda v: lax.scan(lambda c, _: (two(c), None), v, None, 3)[0])
    assert scanned == (6 * many, ())

    def looped(v):  # how often it reduces depends on the data
        return lax.while_loop(lambda c: c[0] < 5, lambda c: two(c), v)

    if many:
        assert count(looped)[1] == ("a while loop inside reduces",)


# ---------------------------------------------------------------------------------
# solve_normal: their shapes, and no second compile inside their jit


@mpi
def test_solve_normal_takes_a_column_and_a_vector_eps(sr):
    import jax.numpy as jnp

    eps = EPS * (1 + jnp.arange(PARAMS) / PARAMS)  # one shift per parameter
    x, info = cg.solve_normal(sr.J, sr.f[:, None], eps, tol=1e-10, maxiter=500)
    S = sr.dense() + np.diag(np.asarray(eps)) - EPS * np.eye(PARAMS)
    expected = np.linalg.solve(S, np.asarray(sr.f))
    error = np.max(np.abs(np.asarray(x)[:, 0] - expected)) / np.max(np.abs(expected))
    all_ranks(x.shape == (PARAMS, 1) and error < 1e-7, f"{x.shape}, error {error}")


@mpi
def test_solve_normal_inside_jit_counts_as_outside_and_compiles_once(sr, caplog):
    import logging

    import jax

    def solve(J, f):  # options no other test uses: nothing compiled yet
        return cg.solve_normal(J, f, EPS, variant="pipelined", replace_every=7)

    with caplog.at_level(logging.DEBUG, logger="jax._src.dispatch"):
        inside = jax.jit(solve)(sr.J, sr.f)[1]
    outside = solve(sr.J, sr.f)[1]
    compiled = [r.getMessage() for r in caplog.records]
    compiled = [m for m in compiled if m.startswith("Finished XLA compilation of")]
    all_ranks(
        int(inside.reductions) == int(outside.reductions) > int(outside.iterations),
        f"inside jit {inside}, outside {outside}",
    )
    all_ranks(
        not any("jit(local)" in m for m in compiled),
        f"the solve compiled apart: {compiled}",
    )


def test_solve_normal_eps_is_checked():
    import jax.numpy as jnp

    J, f = jnp.ones((3, 4)), jnp.ones(4)
    with pytest.raises(ValueError, match=r"eps has shape \(3,\)"):
        cg.solve_normal(J, f, jnp.ones(3), comm=None)
    with pytest.raises(ValueError, match="eps must be > 0"):
        cg.solve_normal(J, f, jnp.array([1.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"f of shape \(params,\) or \(params, 1\)"):
        cg.solve_normal(J, jnp.ones((4, 2)), 1e-3)
