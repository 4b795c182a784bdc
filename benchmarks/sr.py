"""The stochastic-reconfiguration (SR) solve as VMC codes write it: three routes.

    mpiexec -n 2 python benchmarks/sr.py [--params 1824,9245,50000]
        [--walkers 256,1024] [--variants ...] [--repeat 3] [--json PATH]

The problem is a variational Monte Carlo user's SR step, ``(J^T J / N + eps) x =
f`` (``_sr.py``: ``N_p`` parameters replicated, ``--walkers`` per rank, float64,
``maxiter=200``, conditioned as the user's deuteron, so that CG stops at
``maxiter``), solved inside ``jax.jit`` by three routes, one row each per ``(N_p,
walkers)``: (a) ``jax.scipy`` (their code: ``jax.scipy.sparse.linalg.cg`` with
``mpi4jax.allreduce`` in ``A``); (b) ``dropin/<variant>`` (the same ``A`` in
``mpi4jax_dist.cg``) and ``solve_normal``; (c) ``cholesky`` (``S`` summed with the
in-place allreduce, then ``cho_factor``/``cho_solve``; skipped where S would exceed
4 GiB per rank). Timed round-robin (``_harness.time_rounds``), the slowest rank per
round, the median; allreduces per solve counted from what ran (the compiled loop,
``_hlo.loop_reductions``; ``info``; a debug callback); residuals recomputed in
NumPy. Run with ``OMP_NUM_THREADS=1`` where the ranks fill the cores.
docs/benchmarks.rst, *The stochastic-reconfiguration solve*, gives the runs;
settled questions: docs/benchmarks-settled.rst.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
from _sr import Jacobian, jax_scipy_cg, user_matvec  # noqa: E402

DEFAULT_PARAMS = "1824,9245,50000"
DEFAULT_WALKERS = "256,1024"
ROUTE_A = "jax.scipy"
DROPIN = "dropin"
NORMAL = "solve_normal"
CHOL = "cholesky"

# The problem, and what is too large to run here.
EPS, COND, TOL, MAXITER, REPLACE_EVERY = 1e-3, 1.7e7, 1e-5, 200, 50
MAX_J_MIB, MAX_S_GIB = 64, 4.0


def cg_module():
    """The module ``mpi4jax_dist.cg`` (solve_normal, VARIANTS)."""
    return importlib.import_module("mpi4jax_dist.cg")


# --- The routes, as jitted functions of (J, f, x0, eps) -------------------------------


def problem(params, walkers, comm, seed=0) -> Jacobian:
    """The SR problem of ``params`` parameters, ``walkers`` per rank."""
    return Jacobian(walkers * comm.size, params, EPS, comm, cond=COND, seed=seed)


def route_dropin(N, comm, tol, maxiter, variant, replace_every, counter=None):
    """(b): the one changed line, ``mpi4jax_dist.cg(A, f, ...)``, in one jit."""
    import jax

    import mpi4jax_dist

    def solve(J, f, x0, eps):
        A = user_matvec(J, eps, N, comm, counter)
        return mpi4jax_dist.cg(
            A,
            f,
            x0=x0,
            tol=tol,
            atol=0.0,
            maxiter=maxiter,
            variant=variant,
            replace_every=replace_every,
        )

    return jax.jit(solve)


def route_normal(comm, tol, maxiter, variant="classic", replace_every=50):
    """(b): ``mpi4jax_dist.cg.solve_normal`` with a fresh solver."""
    solver = cg_module().make_normal_solver(
        variant=variant, comm=comm, replace_every=replace_every
    )
    return lambda J, f, x0, eps: solver(J, f, eps, x0, tol=tol, maxiter=maxiter)


class Cholesky:
    """(c): three jitted stages; ``reduce`` in place (``mpi4jax_dist.allreduce``,
    donated)."""

    def __init__(self, N, comm):
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI

        import mpi4jax_dist

        # (J / N)^T J: one S-sized result, no scaled copy of S.
        self.form = jax.jit(lambda J: (J / N).T @ J)
        self.reduce = jax.jit(
            lambda S: mpi4jax_dist.allreduce(S, MPI.SUM, comm=comm), donate_argnums=0
        )

        def factor_solve(S, f, eps):
            # The factor is returned (and dropped by the caller) so that the
            # donated S has an output to alias: the shift and the factorization
            # then run in S's buffer, not in a copy.
            i = jnp.arange(S.shape[0])
            S = S.at[i, i].add(eps)
            factor = jax.scipy.linalg.cho_factor(S)
            return jax.scipy.linalg.cho_solve(factor, f), factor[0]

        self.factor = jax.jit(factor_solve, donate_argnums=0)
        self.stage_times = {"form": [], "allreduce": [], "factor": []}

    def compile(self, J, f, eps):
        """Compile the stages: form and factor ahead of time; the allreduce by one
        call on zeros (a program with an MPI effect takes a token that the
        ahead-of-time executable does not get passed)."""
        import jax
        import jax.numpy as jnp

        P = J.shape[1]
        spec = jax.ShapeDtypeStruct((P, P), J.dtype)
        self.form = self.form.lower(J).compile()
        self.factor = self.factor.lower(spec, f, eps).compile()
        jax.block_until_ready(self.reduce(jnp.zeros((P, P), J.dtype)))

    def __call__(self, J, f, x0, eps):
        """Solve, timing each stage."""
        import jax

        marks = [time.perf_counter()]
        S = jax.block_until_ready(self.form(J))
        marks.append(time.perf_counter())
        S = jax.block_until_ready(self.reduce(S))
        marks.append(time.perf_counter())
        x, factor = jax.block_until_ready(self.factor(S, f, eps))
        del S, factor
        marks.append(time.perf_counter())
        for name, start, stop in zip(
            self.stage_times, marks[:-1], marks[1:], strict=True
        ):
            self.stage_times[name].append(stop - start)
        return x


def chunks(s_bytes: int) -> int:
    """MPI calls ``mpi4jax_dist.allreduce`` makes for ``s_bytes``."""
    chunk = _chunk_bytes()
    return 1 if chunk <= 0 else max(1, math.ceil(s_bytes / chunk))


def loop_allreduces(jitted, args) -> int | None:
    """The reductions per iteration of the one while loop ``jitted`` compiles to
    (None when not exactly one, or the count is in doubt)."""
    import _hlo

    text = jitted.lower(*args).compile().as_text()
    try:
        found = _hlo.loop_reductions(text)
    except LookupError:
        return None
    return found.body if found.exact else None


def count_calls(make, args, comm) -> int:
    """Run ``make(counter)(*args)`` once untimed; return rank 0's counter calls."""
    import jax

    calls = [0]

    def counter():
        calls[0] += 1

    jax.block_until_ready(make(counter)(*args))
    jax.effects_barrier()
    return comm.bcast(calls[0], root=0)


# --- Tables ---------------------------------------------------------------------------

ROUTE_TABLE = _harness.Table(
    [
        _harness.Column("params", "N_p", "", 6),
        _harness.Column("walkers", "walkers", "/rank", 7),
        _harness.Column("route", "route", "", 22, left=True),
        _harness.Column("iterations", "iters", "", 5),
        _harness.Column("converged", "conv", "", 4, lambda v: "y" if v else "n"),
        _harness.Column("t_solve_s", "t_solve", "ms", 9, ".1f", 1e3),
        _harness.Column("t_iter_s", "t/iter", "us", 8, ".0f", 1e6),
        _harness.Column("allreduces_loop", "allred", "loop", 6),
        _harness.Column("allreduces", "allred", "all", 6),
        _harness.Column("mpi_calls", "mpi", "calls", 5),
        _harness.Column("bytes_per_allreduce", "B/allred", "", 9, _harness.human_bytes),
        _harness.Column("bytes_per_solve", "B/solve", "", 9, _harness.human_bytes),
        _harness.Column("rel_residual", "rel.res", "true", 8, ".2e"),
        _harness.Column("diff_vs_a", "|x-x_a|", "/|x_a|", 8, ".1e"),
        _harness.Column("note", "note", "", 1, left=True),
    ]
)


# --- The routes study -----------------------------------------------------------------


class Bench:
    def __init__(self, args, comm):
        self.args, self.comm = args, comm
        self.results: list[dict] = []

    def say(self, *lines):
        _harness.say(self.comm, *lines)

    def slowest(self, value: float) -> float:
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MAX)

    def sizes(self):
        """The ``(params, walkers)`` to run, and the skipped ones with why."""
        args, run, skipped = self.args, [], []
        for params in args.params:
            for index, walkers in enumerate(sorted(args.walkers)):
                j_mib = 8 * params * walkers / 2**20
                if index and j_mib > MAX_J_MIB:
                    skipped.append(
                        f"# skipped N_p {params} x {walkers} walkers/rank: J_r "
                        f"{j_mib:.0f} MiB > {MAX_J_MIB} MiB"
                    )
                else:
                    run.append((params, walkers))
        return run, skipped

    def routes(self):
        args, comm = self.args, self.comm
        run, skipped = self.sizes()
        self.say(
            f"# routes: (J^T J/N + eps) x = f, float64, tol {TOL:g}, atol 0, "
            f"maxiter {MAXITER}, x0 zero, eps {EPS:g}, "
            f"cond {COND:.3g}, {comm.size} ranks; median of {args.repeat} "
            f"rounds, slowest rank",
            *skipped,
        )
        self.say(ROUTE_TABLE.header())
        for params, walkers in run:
            self.one_size(params, walkers)

    def one_size(self, params, walkers):
        import jax

        args, comm = self.args, self.comm
        prob = problem(params, walkers, comm)
        dev = prob.device()
        N, tol, maxiter, every = prob.samples, TOL, MAXITER, REPLACE_EVERY
        base = {"section": "routes", "params": params, "walkers": walkers}
        cases, finish = [], []
        vec_bytes = 8 * params

        solve = jax_scipy_cg(N, comm, tol, maxiter)
        per_loop = loop_allreduces(solve, dev)

        def done_a(output, per_loop=per_loop, dev_=dev):
            calls = count_calls(
                lambda c: jax_scipy_cg(N, comm, tol, maxiter, counter=c), dev_, comm
            )
            k = calls - 1
            return {
                "route": ROUTE_A,
                "iterations": k,
                "converged": None,
                "allreduces_loop": None if per_loop is None else per_loop * k,
                "allreduces": calls,
                "x": output,
            }

        cases.append(functools.partial(solve, *dev))
        finish.append(done_a)

        for variant in args.variants:
            solve = route_dropin(N, comm, tol, maxiter, variant, every)

            def done_b(output, variant=variant, dev_=dev):
                x, info = output
                calls = count_calls(
                    lambda c: route_dropin(N, comm, tol, maxiter, variant, every, c),
                    dev_,
                    comm,
                )
                return {
                    "route": f"{DROPIN}/{variant}",
                    "variant": variant,
                    **info_fields(info),
                    "allreduces": calls,
                    "x": x,
                }

            cases.append(functools.partial(solve, *dev))
            finish.append(done_b)

        solve = route_normal(comm, tol, maxiter)

        def done_n(output):
            x, info = output
            fields = info_fields(info)
            return {
                "route": NORMAL,
                **fields,
                "allreduces": fields["matvecs"] + 2,
                "note": "all = matvecs + 2",
                "x": x,
            }

        cases.append(functools.partial(solve, *dev))
        finish.append(done_n)

        chol = None
        s_gib = prob.s_bytes / 2**30
        if s_gib > MAX_S_GIB:
            self.say(
                f"# skipped cholesky at N_p {params}: S is {s_gib:.1f} GiB per "
                f"rank (> {MAX_S_GIB:g} GiB; and held with its "
                f"factor)"
            )
        else:
            chol = Cholesky(N, comm)
            chol.compile(dev[0], dev[1], dev[3])

            def done_c(output):
                return {
                    "route": CHOL,
                    "iterations": None,
                    "allreduces_loop": None,
                    "allreduces": 1,
                    "mpi_calls": chunks(prob.s_bytes),
                    "bytes_per_allreduce": prob.s_bytes,
                    "note": "1 allreduce of S (by construction)",
                    "x": output,
                }

            cases.append(functools.partial(chol, *dev))
            finish.append(done_c)

        outputs = []
        times = _harness.time_rounds(cases, comm, args.repeat, 1, outputs)
        rows = [done(out) for done, out in zip(finish, outputs, strict=True)]
        x_a = None
        for row, samples in zip(rows, times, strict=True):
            x = np.asarray(row.pop("x"), dtype=np.float64)
            if row["route"] == ROUTE_A:
                x_a = x
            row.update(base)
            row.update(_harness.summary(samples, "t_solve"))
            row["t_solve_s"] = row["t_solve_median_s"]
            if row.get("iterations"):
                row["t_iter_s"] = row["t_solve_s"] / row["iterations"]
            row.setdefault("mpi_calls", row["allreduces"])
            row.setdefault("bytes_per_allreduce", vec_bytes)
            row["bytes_per_solve"] = row["bytes_per_allreduce"] * row["allreduces"]
            row["rel_residual"] = prob.residual(x)
            row["fx"] = float(prob.f @ x)
            row["_x"] = x
        for row in rows:
            x = row.pop("_x")
            if x_a is not None:
                row["diff_vs_a"] = float(
                    np.linalg.norm(x - x_a) / max(np.linalg.norm(x_a), 1e-300)
                )
            if row["route"] == CHOL:
                stages = {
                    name: self.slowest(statistics.median(t[1:] or t))
                    for name, t in chol.stage_times.items()
                }
                row["stage_s"] = stages
                row["note"] += (
                    f": form {1e3 * stages['form']:.0f}, allreduce "
                    f"{1e3 * stages['allreduce']:.0f}, factor "
                    f"{1e3 * stages['factor']:.0f} ms"
                )
            self.results.append(row)
            self.say(ROUTE_TABLE.row(row))
        del dev, chol
        jax.clear_caches()


def info_fields(info) -> dict:
    """A CGInfo's fields as Python numbers (``allreduces_loop`` its reductions)."""
    reductions = int(info.reductions)
    return {
        "iterations": int(info.iterations),
        "converged": bool(info.converged),
        "allreduces_loop": None if reductions < 0 else reductions,
        "matvecs": int(info.matvecs),
        "recurrence_residual": float(info.recurrence_residual),
        "rel_residual_info": float(info.rel_residual),
    }


# --- Command line ---------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=_harness.ints, default=DEFAULT_PARAMS)
    parser.add_argument(
        "--walkers",
        type=_harness.ints,
        default=DEFAULT_WALKERS,
        help="walkers per rank, comma-separated",
    )
    parser.add_argument("--variants", default=None, help="of the drop-in (default all)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds")
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    with _harness.float64_world() as comm:
        import jax

        if args.variants is None:
            args.variants = list(cg_module().VARIANTS)
        elif isinstance(args.variants, str):
            args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bench = Bench(args, comm)
        start = time.perf_counter()
        bench.say(
            f"# SR solve, {comm.size} ranks, jax {jax.__version__} "
            f"({jax.default_backend()})",
            _harness.threads_line(),
        )
        bench.routes()
        elapsed = time.perf_counter() - start
        bench.say(f"# total {elapsed:.0f} s")
        meta = _harness.meta(
            comm,
            args=vars(args),
            seconds=elapsed,
            command=" ".join(sys.argv),
            timing="median over --repeat rounds (round-robin) of the slowest rank's "
            "solve, compilation and one warm-up solve excluded",
            allreduce_chunk_bytes=_chunk_bytes(),
        )
        _harness.save(args, meta, bench.results, comm=comm)
        comm.Barrier()
        return bench.results


def _chunk_bytes() -> int:
    from mpi4jax_dist import _config

    return _config.allreduce_chunk_bytes()


if __name__ == "__main__":
    with _harness.results_on_stdout():  # the tables alone on stdout, no [Gloo] lines
        main()
