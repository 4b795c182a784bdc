"""Distributed CG: mpiexec -n 2 (and 4) python -m pytest --with-mpi
tests/peers/test_cg.py.

Every backend x variant (``cg.VARIANT_RECORDS``) solves small problems and is
compared with SciPy/NumPy; asserts gather the outcome over ranks first
(``all_ranks``). The tests at the end need no peers (mpi4jax on COMM_SELF, argument
checks) and also run in the serial session: python -m pytest tests/peers/test_cg.py.
"""

import functools
import logging
import math

import numpy as np
import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import cg

mpi = pytest.mark.mpi(min_size=2)
GRID = 16  # problem A: 16 x 16 grid, 4 grid rows per rank at -n 4
REACTION = 20.0  # A = Laplacian + diag(c), c from 0 to REACTION: Jacobi matters
TOL = 1e-10
COMBOS = [(b, v) for b in cg.BACKENDS for v in cg.VARIANTS]


def load_benchmark():
    """Import benchmarks/cg.py: its Poisson problem, and main()."""
    return util.load_benchmark("cg")


@pytest.fixture(scope="module")
def x64(world):
    """float64 for this module's tests, restored after them."""
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark()


def reaction(first, count):
    """``c`` at global grid points ``first .. first + count - 1`` (jnp)."""
    import jax.numpy as jnp

    return REACTION * (first + jnp.arange(count)) / (GRID * GRID - 1)


class ProblemA:
    """``(L + diag(c)) x = b`` on ``GRID x GRID`` in row blocks, with SciPy's answer."""

    def __init__(self, bench, comm):
        import scipy.sparse as sp
        import scipy.sparse.linalg as spl

        n = GRID
        self.comm, self.poisson = comm, bench.Poisson(n, comm)
        self.local_size = self.poisson.rows * n
        lo = comm.rank * self.local_size
        self.block = slice(lo, lo + self.local_size)
        T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
        c = np.asarray(reaction(0, n * n))
        self.A = (sp.kron(T, sp.eye(n)) + sp.kron(sp.eye(n), T) + sp.diags(c)).tocsr()
        self.b = np.random.default_rng(7).standard_normal(n * n)
        self.x_ref = spl.spsolve(self.A, self.b)
        steps = []
        spl.cg(
            self.A,
            self.b,
            rtol=TOL,
            maxiter=1000,
            M=sp.diags(1 / self.A.diagonal()),
            callback=steps.append,
        )
        self.scipy_iterations = len(steps)

    def solver(self, backend, variant, mesh, hidden=False, **options):
        """Return ``run(b=None, **call_options) -> (x_local, info)``.

        ``b`` is the global right-hand side (default ``self.b``); this rank's block
        of it goes in, in the backend's layout. ``hidden``: the matvec also makes a
        reduction of its own (``v.v`` over ranks), whose result it uses so that XLA
        keeps it: the fault the reduction count must catch.
        """
        import jax.numpy as jnp
        import mpi4jax
        from jax import lax
        from mpi4py import MPI

        def use(total, v, av):
            return jnp.where(total(jnp.vdot(v, v)) >= 0, av, jnp.nan) if hidden else av

        m = self.local_size
        diag = jnp.asarray(self.A.diagonal()[self.block])

        def block(b):
            return jnp.asarray((self.b if b is None else b)[self.block])

        if backend == "mpi4jax":
            laplacian = self.poisson.mpi4jax_matvec()
            c = reaction(self.comm.rank * m, m)

            def matvec(v):
                total = functools.partial(mpi4jax.allreduce, op=MPI.SUM, comm=self.comm)
                return use(total, v, laplacian(v) + c * v)

            solver = cg.make_solver(
                matvec, backend=backend, variant=variant, comm=self.comm, **options
            )
            return lambda b=None, **kw: solver(block(b), diag=diag, **kw)

        laplacian = self.poisson.shard_matvec(mesh)
        axis = mesh.axis_names[0]

        def shard_matvec(v):  # inside shard_map: this device's block only
            av = laplacian(v) + reaction(lax.axis_index(axis) * m, m) * v
            return use(lambda x: lax.psum(x, axis), v, av)

        solver = cg.make_solver(
            shard_matvec, backend=backend, variant=variant, mesh=mesh, **options
        )
        diag = mpi4jax_dist.to_global(diag, mesh)

        def run(b=None, **kw):
            x, info = solver(mpi4jax_dist.to_global(block(b), mesh), diag=diag, **kw)
            return mpi4jax_dist.to_local(x), info

        return run

    def error(self, x_local):
        """``||x - x_ref|| / ||x_ref||`` over all ranks."""
        from mpi4py import MPI

        d = np.asarray(x_local) - self.x_ref[self.block]
        num = self.comm.allreduce(float(d @ d), op=MPI.SUM)
        return np.sqrt(num) / np.linalg.norm(self.x_ref)


@pytest.fixture(scope="module")
def problem_a(x64, bench):
    from mpi4py import MPI

    return ProblemA(bench, MPI.COMM_WORLD)


@pytest.fixture(scope="module")
def solutions(problem_a):
    """Every backend x variant on problem A with Jacobi, once per module."""
    mesh = mpi4jax_dist.global_mesh()
    out = {}
    for backend, variant in COMBOS:
        x, info = problem_a.solver(backend, variant, mesh)(tol=TOL, maxiter=500)
        out[backend, variant] = np.asarray(x), {
            k: np.asarray(v).item() for k, v in info._asdict().items()
        }
    return out


def info_text(info):
    return ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()
    )


# Problem A's row blocks: at 4 ranks, ranks 1 and 2 exchange halos with two
# neighbours, and every variant's dot products sum over more than a pair.
@mpi
@util.more_ranks
@pytest.mark.parametrize("backend,variant", COMBOS)
def test_reaches_scipy_solution(problem_a, solutions, backend, variant):
    x, info = solutions[backend, variant]
    error = problem_a.error(x)
    all_ranks(info["converged"], f"not converged: {info_text(info)}")
    all_ranks(info["rel_residual"] <= 10 * TOL, f"true residual: {info_text(info)}")
    all_ranks(error < 1e-8, f"error vs SciPy {error:.3g}: {info_text(info)}")


@mpi
@util.more_ranks  # problem A's solves, as above
def test_iteration_counts_agree(problem_a, solutions):
    counts = {f"{b}/{v}": info["iterations"] for (b, v), (_, info) in solutions.items()}
    spread = max(counts.values()) - min(counts.values())
    all_ranks(spread <= 3, f"iterations differ by {spread}: {counts}")
    scipy_n = problem_a.scipy_iterations
    off = {k: n for k, n in counts.items() if abs(n - scipy_n) > 3}
    all_ranks(not off, f"SciPy's cg took {scipy_n}; these differ: {off}")


@mpi
@pytest.mark.parametrize("backend,variant", COMBOS)
def test_reductions_counted_per_iteration(solutions, backend, variant):
    _, info = solutions[backend, variant]
    record = cg.VARIANT_RECORDS[variant]
    k, per = info["iterations"], record.reductions_by_design
    all_ranks(
        k > 10 and info["reductions"] == per * k,
        f"{info['reductions']} reductions in {k} iterations, expected {per} each",
    )
    every = cg.DEFAULT_REPLACE_EVERY if record.replaces else 0
    matvecs = k + (4 * (k // every) if every else 0)
    all_ranks(
        info["matvecs"] == matvecs,
        f"{info['matvecs']} matvecs, expected " f"{matvecs} in {k} iterations",
    )


@mpi
@pytest.mark.parametrize("backend,variant", COMBOS)
def test_reduction_hidden_in_matvec_is_counted(problem_a, backend, variant):
    """Fault injection: a reduction inside the user's matvec, which no declaration
    announces, shows in info.reductions: one more per matvec made in the loop
    (pipelined: also the four of each residual replacement, every 5 here)."""
    mesh = mpi4jax_dist.global_mesh()
    run = problem_a.solver(backend, variant, mesh, hidden=True, replace_every=5)
    x, info = run(tol=TOL, maxiter=500)
    k, matvecs = int(info.iterations), int(info.matvecs)
    record = cg.VARIANT_RECORDS[variant]
    design, counted = record.reductions_by_design * k, int(info.reductions)
    all_ranks(problem_a.error(x) < 1e-8, f"{info}")
    what = f"{counted} reductions counted in {k} iterations, {matvecs} matvecs"
    if backend == "psum" and record.overlaps:
        # The matvec's psum does not depend on the dot products' (by design), and
        # XLA combines independent all-reduces into one collective: fewer run, and
        # fewer are counted. Still more than the design's alone.
        all_ranks(k > 10 and design < counted <= design + matvecs, what)
    else:
        all_ranks(k > 10 and counted == design + matvecs, what)


@mpi
@pytest.mark.parametrize("variant", ["pipelined", "pipelined_nb"])
@pytest.mark.parametrize("backend", cg.BACKENDS)
def test_pipelined_residual_replacement(problem_a, backend, variant):
    mesh = mpi4jax_dist.global_mesh()
    run = problem_a.solver(backend, variant, mesh, replace_every=5)
    x, info = run(tol=TOL, maxiter=500)
    k = int(info.iterations)
    error = problem_a.error(x)
    all_ranks(bool(info.converged) and float(info.rel_residual) <= 10 * TOL, f"{info}")
    all_ranks(error < 1e-8, f"error {error:.3g}")
    all_ranks(int(info.reductions) == k, f"{info}")
    all_ranks(int(info.matvecs) == k + 4 * (k // 5), f"{info}")


@mpi
@util.more_ranks  # the partial sums' order may differ beyond 2 ranks
@pytest.mark.parametrize("replace_every", [cg.DEFAULT_REPLACE_EVERY, 0])
def test_nonblocking_pipelined_is_the_blocking_one(problem_a, replace_every):
    """pipelined_nb (MPI_Iallreduce overlapping the matvec) makes pipelined's
    iterations: the same count, residuals and solution to rounding (summing the same
    partial sums, only possibly in another order at more than 2 ranks)."""
    mesh = mpi4jax_dist.global_mesh()
    out = {}
    for variant in ("pipelined", "pipelined_nb"):
        run = problem_a.solver("mpi4jax", variant, mesh, replace_every=replace_every)
        x, info = run(tol=TOL, maxiter=500)
        out[variant] = np.asarray(x), {
            k: np.asarray(v).item() for k, v in info._asdict().items()
        }
    (xb, blocking), (xn, nonblocking) = out["pipelined"], out["pipelined_nb"]
    what = f"blocking: {info_text(blocking)}; non-blocking: {info_text(nonblocking)}"
    same = ("iterations", "matvecs", "reductions", "converged")
    all_ranks(all(blocking[k] == nonblocking[k] for k in same), what)
    for key in ("rel_residual", "recurrence_residual"):
        close = math.isclose(blocking[key], nonblocking[key], rel_tol=1e-6)
        all_ranks(close, f"{key}: {what}")
    gap = np.linalg.norm(xn - xb) / np.linalg.norm(xb)
    all_ranks(gap < 1e-10, f"solutions differ by {gap:.3g} (relative)")
    all_ranks(problem_a.error(xn) < 1e-8, f"error vs SciPy {problem_a.error(xn)}")


@mpi
@pytest.mark.parametrize("backend", cg.BACKENDS)
def test_zero_rhs_and_maxiter(problem_a, backend):
    run = problem_a.solver(backend, "single", mpi4jax_dist.global_mesh())
    _, info = run(tol=TOL, maxiter=3)
    all_ranks(int(info.iterations) == 3 and not bool(info.converged), f"{info}")
    x, info = run(np.zeros(GRID * GRID), tol=TOL)
    all_ranks(int(info.iterations) == 0 and bool(info.converged), f"{info}")
    all_ranks(not np.any(x) and float(info.rel_residual) == 0, f"{x}, {info}")


# ---------------------------------------------------------------------------------
# Shape B: (J^T J / Ns + eps I) x = f

SAMPLES_PER_RANK, PARAMS, EPS = 6, 30, 1e-2  # Ns < params at -n 2 and 4


class ProblemB:
    """sr.py's synthetic Jacobian (benchmarks/_sr.py), tiny, with NumPy's dense
    answer."""

    def __init__(self, bench, comm, seed=1):
        self.comm = comm
        self.jac = util.load_benchmark("_sr").Jacobian(
            SAMPLES_PER_RANK * comm.size, PARAMS, EPS, comm, seed=seed
        )
        full, _ = self.jac.rows(0, self.jac.samples)
        self.A = full.T @ full / self.jac.samples + EPS * np.eye(PARAMS)

    def solve(self, backend, variant, f=None, **kwargs):
        import jax.numpy as jnp

        J = jnp.asarray(self.jac.J)
        f = jnp.asarray(self.jac.f if f is None else f)
        if backend == "psum":
            J = mpi4jax_dist.to_global(J)
        else:
            kwargs["comm"] = self.comm
        x, info = cg.solve_normal(J, f, EPS, backend=backend, variant=variant, **kwargs)
        if backend == "psum":
            x = mpi4jax_dist.to_local(x)
        return np.asarray(x), info

    def error(self, x, f=None):
        ref = np.linalg.solve(self.A, self.jac.f if f is None else f)
        return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.fixture(scope="module")
def problem_b(x64, bench):
    from mpi4py import MPI

    return ProblemB(bench, MPI.COMM_WORLD)


# At 4 ranks, classic alone: what more ranks add is the backend's reduction of the
# matvec and of Jacobi's diagonal over the samples, the same in every variant.
@mpi
@pytest.mark.parametrize("jacobi", [False, True])
@pytest.mark.parametrize(
    "backend,variant",
    [
        pytest.param(b, v, marks=util.more_ranks) if v == "classic" else (b, v)
        for b, v in COMBOS
    ],
)
def test_normal_equations_match_numpy(problem_b, backend, variant, jacobi):
    x, info = problem_b.solve(backend, variant, tol=TOL, maxiter=300, jacobi=jacobi)
    error = problem_b.error(x)
    k = int(info.iterations)
    all_ranks(bool(info.converged) and float(info.rel_residual) <= 10 * TOL, f"{info}")
    all_ranks(error < 1e-8, f"error vs NumPy {error:.3g}: {info}")
    # One allreduce of the parameter vector per matvec; dots are local.
    all_ranks(int(info.reductions) == int(info.matvecs), f"{info}")
    replaces = cg.VARIANT_RECORDS[variant].replaces  # + 4 matvecs per replacement
    all_ranks(replaces or int(info.matvecs) == k, f"{info}")


@mpi
@pytest.mark.parametrize("backend", cg.BACKENDS)
@pytest.mark.parametrize("variant", ["classic", "single"])
def test_float32_reductions_converge_looser(problem_b, backend, variant):
    import jax.numpy as jnp

    x, info = problem_b.solve(
        backend, variant, tol=1e-5, maxiter=300, reduce_dtype=jnp.float32
    )
    error = problem_b.error(x)
    all_ranks(x.dtype == np.float64, f"iterated in {x.dtype}")
    all_ranks(bool(info.converged) and float(info.rel_residual) < 1e-4, f"{info}")
    all_ranks(error < 1e-3, f"error vs NumPy {error:.3g}: {info}")


@mpi
def test_reduce_dtype_wider_than_working_dtype_is_refused(problem_b):
    import jax.numpy as jnp

    J = jnp.asarray(problem_b.jac.J, dtype=jnp.float32)
    f = jnp.asarray(problem_b.jac.f, dtype=jnp.float32)
    with pytest.raises(ValueError, match="reduce_dtype=float64 is wider"):
        cg.solve_normal(J, f, EPS, reduce_dtype=jnp.float64)


@mpi
@pytest.mark.parametrize("backend", cg.BACKENDS)
def test_warm_start_takes_fewer_iterations(problem_b, backend):
    x1, _ = problem_b.solve(backend, "classic", tol=1e-8, maxiter=300)
    # The next optimization step's right-hand side: close to the last one.
    rng = np.random.default_rng(3)
    f2 = problem_b.jac.f + 1e-3 * np.linalg.norm(problem_b.jac.f) * rng.standard_normal(
        PARAMS
    ) / np.sqrt(PARAMS)
    _, cold = problem_b.solve(backend, "classic", f=f2, tol=1e-8, maxiter=300)
    x2, warm = problem_b.solve(backend, "classic", f=f2, x0=x1, tol=1e-8, maxiter=300)
    all_ranks(bool(warm.converged) and problem_b.error(x2, f2) < 1e-6, f"{warm}")
    all_ranks(
        int(warm.iterations) < int(cold.iterations),
        f"warm {int(warm.iterations)} vs cold {int(cold.iterations)}",
    )


# ---------------------------------------------------------------------------------
# The benchmark


@pytest.fixture
def shared_dir(world):
    """A directory rank 0 creates and removes, the same path on every rank.

    (pytest-mpi's mpi_tmp_path has every rank clean pytest's temporary root at
    once, which races and warns.)
    """
    import shutil
    import tempfile
    from pathlib import Path

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="test_cg_") if comm.rank == 0 else None)
    yield Path(path)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@mpi
@util.same_under_every_jax  # the benchmark's report; the solvers run below
def test_benchmark_reports_every_method(world, shared_dir):
    bench = load_benchmark()
    out = shared_dir / "cg.json"
    results = bench.main(
        [
            "--n",
            "16",
            "--repeat",
            "1",
            "--json",
            str(out),
        ]
    )
    fields = {
        "problem",
        "backend",
        "variant",
        "iterations",
        "rel_residual",
        "error",
        "t_iter_s",
        "reductions_per_iter",
        "reductions_per_iter_counted",
        "recurrence_residual",
    }
    missing = [sorted(fields - set(r)) for r in results if not fields <= set(r)]
    all_ranks(not missing, f"fields missing: {missing}")
    seen = {(r["problem"], r["backend"], r["variant"]) for r in results}
    expected = {("A", b, v) for b, v in COMBOS}
    expected |= {("A", bench.FLOOR, "classic"), ("A", bench.JAX_SCIPY, "cg")}
    all_ranks(expected <= seen, f"methods missing: {sorted(expected - seen)}")
    bad = [
        r
        for r in results
        if not (r["t_iter_s"] > 0 and r["iterations"] > 0 and r["rel_residual"] < 1e-4)
    ]
    all_ranks(not bad, f"rows out of range: {bad}")
    # Counted from what ran, for every method: ours from the compiled loop, the
    # references from theirs, the floor by its communicator.
    wrong = [
        (r["problem"], r["backend"], r["variant"], r["reductions_per_iter_counted"])
        for r in results
        if r["reductions_per_iter_counted"] != r["reductions_per_iter"]
    ]
    all_ranks(not wrong, f"counted reductions differ from the design: {wrong}")
    one = bench.main(
        "--n 16 --backends mpi4jax --variants pipelined "
        "--replace-every 0 --repeat 1".split()
    )
    chosen = [(r["backend"], r["variant"], r["replace_every"]) for r in one]
    all_ranks(chosen == [("mpi4jax", "pipelined", 0)], f"rows {chosen}")
    if world.rank == 0:
        import json

        saved = json.loads(out.read_text())
        assert {"meta", "results"} <= set(saved)
        assert saved["meta"]["world_size"] == world.size
        assert len(saved["results"]) == len(results)


# ---------------------------------------------------------------------------------
# Argument checks: raised before anything communicates, so they also run serially


def test_unknown_variant_and_backend_are_named():
    with pytest.raises(ValueError, match="variant='fast'.*'classic', 'single'"):
        cg.make_solver(lambda v: v, variant="fast")
    with pytest.raises(ValueError, match="backend='nccl'.*'mpi4jax', 'psum'"):
        cg.solve(lambda v: v, np.ones(4), backend="nccl")
    with pytest.raises(ValueError, match="variant='cgs'"):
        cg.solve_normal(np.ones((2, 3)), np.ones(3), 1e-3, variant="cgs")
    with pytest.raises(ValueError, match="backend='gloo'"):
        cg.make_normal_solver(backend="gloo")


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="replace_every=-1"):
        cg.make_solver(lambda v: v, variant="pipelined", replace_every=-1)
    with pytest.raises(TypeError, match="matvec=3 is not callable"):
        cg.make_solver(3)
    with pytest.raises(ValueError, match="reduce_dtype='int32'"):
        cg.make_normal_solver(reduce_dtype="int32")


# ---------------------------------------------------------------------------------
# Reductions counted from the compiled program, in one process: mpi4jax on
# COMM_SELF keeps its custom calls in the program, so the count sees them.


def self_allreduce(x):
    import mpi4jax
    from mpi4py import MPI

    return mpi4jax.allreduce(x, op=MPI.SUM, comm=MPI.COMM_SELF)


def self_solver(variant, extra=None, **options):
    """Return ``run(**call_options)``: CG on a small SPD tridiagonal system on
    COMM_SELF; ``extra(v, av)`` may add communication to the matvec."""
    import jax.numpy as jnp
    from mpi4py import MPI

    n = 32
    d = 2.0 + jnp.arange(n) / n

    def matvec(v):
        av = d * v + 0.1 * (jnp.roll(v, 1) + jnp.roll(v, -1))
        return av if extra is None else extra(v, av)

    solver = cg.make_solver(matvec, variant=variant, comm=MPI.COMM_SELF, **options)
    b = jnp.ones(n)
    return lambda **kw: solver(b, **{"tol": 1e-5, **kw})


@util.serial_only
@pytest.mark.parametrize("variant", cg.VARIANTS)
def test_hidden_reduction_is_counted_in_one_process(variant):
    import jax.numpy as jnp

    def hidden(v, av):  # used, so that XLA keeps it
        return jnp.where(self_allreduce(jnp.vdot(v, v)) >= 0, av, jnp.nan)

    design = cg.VARIANT_RECORDS[variant].reductions_by_design
    _, clean = self_solver(variant, replace_every=3)()
    assert int(clean.reductions) == design * int(clean.iterations), clean
    _, info = self_solver(variant, hidden, replace_every=3)()
    k, matvecs = int(info.iterations), int(info.matvecs)
    assert k > 3 and int(info.reductions) == design * k + matvecs, info
    if cg.VARIANT_RECORDS[variant].replaces:
        assert matvecs == k + 4 * (k // 3), info  # replacements ran, and counted


@util.serial_only
def test_reductions_that_depend_on_the_data_are_not_guessed(caplog):
    from jax import lax

    def sometimes(v, av):
        return lax.cond(v[0] > 0, self_allreduce, lambda a: a, av)

    with caplog.at_level(logging.WARNING, logger="mpi4jax_dist"):
        _, info = self_solver("classic", sometimes)()
    assert int(info.reductions) == -1 and int(info.iterations) > 3, info
    assert "reduce differently" in caplog.text


@util.serial_only
def test_inner_loop_reductions_count_times_its_trip_count():
    from jax import lax

    def thrice(v, av):
        return lax.fori_loop(0, 3, lambda i, a: self_allreduce(a), av)

    _, info = self_solver("single", thrice)()
    expected = int(info.iterations) + 3 * int(info.matvecs)
    assert int(info.reductions) == expected, info


@util.serial_only
@pytest.mark.parametrize("variant", ["pipelined", "pipelined_nb"])
def test_the_program_read_is_the_program_run(caplog, variant):
    """One compilation per input signature: the call after the ahead-of-time
    compile whose HLO was counted runs that executable, not a new one (also with
    the non-blocking start, whose parameters hold a trace-time id)."""
    run = self_solver(variant)
    # JAX logs each XLA compilation by name (its compile events name it only from
    # jax 0.6.1 on).
    with caplog.at_level(logging.DEBUG, logger="jax._src.dispatch"):
        run()
        run(tol=1e-4, maxiter=7)  # new values, same signature
    prefix = "Finished XLA compilation of "
    names = [
        r.getMessage()[len(prefix) :].split(" in ")[0]
        for r in caplog.records
        if r.getMessage().startswith(prefix)
    ]
    assert [n for n in names if "local" in n] == ["jit(local)"], names


def test_variants_are_their_records():
    assert cg.VARIANTS == tuple(cg.VARIANT_RECORDS)
    for name, record in cg.VARIANT_RECORDS.items():
        assert record.name == name and callable(record.init) and callable(record.step)
        assert cg.REDUCTIONS_PER_ITERATION[name] == record.reductions_by_design
        assert cg.SCALARS_PER_ITERATION[name] == record.scalars


def test_matvec_reductions_is_deprecated():
    with pytest.warns(DeprecationWarning, match="matvec_reductions=1 is deprecated"):
        cg.make_solver(lambda v: v, matvec_reductions=1)


def test_benchmark_options_are_checked(bench):
    args = bench.parse(["--variants", "pipelined", "--backends", "mpi4jax,psum"])
    assert args.variants == ["pipelined"] and args.backends == ["mpi4jax", "psum"]
    for bad in (["--variants", "fast"], ["--backends", "nccl"]):
        with pytest.raises(SystemExit):
            bench.parse(bad)
