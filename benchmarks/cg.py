"""Distributed CG: mpi4jax against shard_map/psum, classic against one reduction.

    mpiexec -n N python benchmarks/cg.py [--n GRID] [--tol T] [--maxiter K]
        [--backends ...] [--variants ...] [--replace-every K] [--repeat R]
        [--json PATH]

Problem A (``_poisson.py``, the 2-D Poisson operator on an ``n x n`` grid in row
blocks) solved by every ``--variants`` of :mod:`mpi4jax_dist.cg` with each backend,
the floor ``mpi4py+numpy`` and the reference ``jax.scipy``; float64, timed
round-robin (``_harness.time_rounds``); residuals recomputed in NumPy; reductions
per iteration counted from what ran (the compiled loop, ``_hlo.py``; a debug
callback; the floor's communicator). Where the ranks fill the cores, run with
``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``. docs/benchmarks.rst, *Distributed
conjugate gradients*, gives the runs; settled questions: docs/benchmarks-settled.rst.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
from _poisson import Poisson  # noqa: E402  (problem A)

FLOOR = "mpi4py+numpy"
JAX_SCIPY = "jax.scipy"
#: The methods --backends chooses from; mpi4jax_dist.cg's backends run every
#: --variants, the others classic CG (their own).
METHODS = _harness.Registry("CG method")
METHODS.register(FLOOR, "classic CG in NumPy, reductions by mpi4py")
METHODS.register("mpi4jax", "mpi4jax_dist.cg, backend mpi4jax")
METHODS.register("psum", "mpi4jax_dist.cg, backend psum")
METHODS.register(JAX_SCIPY, "jax.scipy.sparse.linalg.cg on global sharded arrays")


# --- Counting and timing --------------------------------------------------------------


class CountingComm:
    """An mpi4py communicator that counts its ``Allreduce`` and ``allreduce``
    calls in :attr:`reductions` (the halo's ``Sendrecv`` is no reduction)."""

    def __init__(self, comm):
        self._comm, self.reductions = comm, 0

    def Allreduce(self, *args, **kwargs):
        self.reductions += 1
        return self._comm.Allreduce(*args, **kwargs)

    def allreduce(self, *args, **kwargs):
        self.reductions += 1
        return self._comm.allreduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def numpy_cg(matvec, b, comm, tol, maxiter):
    """The floor: classic unpreconditioned CG reducing through ``comm`` (a
    :class:`CountingComm`); ``(x, iterations, reductions in the loop, recurrence
    residual)``."""
    from mpi4py import MPI

    def dot(a, c):
        return comm.allreduce(float(a @ c), op=MPI.SUM)

    x, r = np.zeros_like(b), b.copy()
    p = r.copy()
    bb = rr = dot(r, r)
    before = comm.reductions
    k = 0
    while k < maxiter and rr > tol * tol * bb:
        q = matvec(p)
        alpha = rr / dot(p, q)
        x += alpha * p
        r -= alpha * q
        rr, rr_old = dot(r, r), rr
        p = r + (rr / rr_old) * p
        k += 1
    return x, k, comm.reductions - before, np.sqrt(rr / (bb if bb > 0 else 1.0))


def compiled_loop(jitted, args, *scopes):
    """Return the reductions of the CG loop that ``jitted`` compiles to for ``args``
    (``_hlo.loop_reductions``: the loop in the named ``scopes``, else the one while
    loop), or None where it is not found. Compiles it, so that the next call finds
    the executable in jit's cache."""
    import _hlo

    text = jitted.lower(*args).compile().as_text()
    try:
        return _hlo.loop_reductions(text, *scopes)
    except LookupError:
        return None


TABLE = _harness.Table(
    [
        _harness.Column("problem", "problem", width=7, left=True),
        _harness.Column("backend", "backend", width=17, left=True),
        _harness.Column("variant", "variant", width=14, left=True),
        _harness.Column("iterations", "iters", width=6),
        _harness.Column("rel_residual", "rel.res", "true", 9, ".2e"),
        _harness.Column("recurrence_residual", "rel.res", "recur.", 9, ".2e"),
        _harness.Column("error", "error", "", 9, ".2e"),
        _harness.Column("t_iter_s", "t/iter", "[us]", 10, ".1f", 1e6),
        _harness.Column("reductions_per_iter", "red/it", "design", 6),
        _harness.Column("reductions_per_iter_counted", "red/it", "counted", 7, ".2f"),
        _harness.Column("bytes_per_iter", "B/iter", "[bytes]", 8),
    ]
)


class Bench:
    """Runs and records the methods of one benchmark invocation."""

    def __init__(self, args, comm, mesh):
        self.args, self.comm, self.mesh = args, comm, mesh
        self.results, self.queue = [], []

    def say(self, *lines):
        _harness.say(self.comm, *lines)

    def wants(self, method):
        return method in self.args.backends

    def record(
        self,
        backend,
        variant,
        *,
        samples,
        iterations,
        x_local,
        check,
        design,
        counted,
        bytes_per_iter,
        recurrence=None,
        extra=None,
    ):
        """Check ``x_local`` and add one row: ``samples`` the timed rounds,
        ``counted`` the loop's reductions from what ran (None: not known)."""
        rel_residual, error = check(np.asarray(x_local, dtype=np.float64))
        timing = _harness.summary(samples, "t_solve")
        t_solve = timing["t_solve_median_s"]
        t_iter = t_solve / max(iterations, 1)
        per_iter = None if counted is None else counted / max(iterations, 1)
        row = {
            "problem": "A",  # the one problem left (B is settled)
            "backend": backend,
            "variant": variant,
            "iterations": int(iterations),
            "rel_residual": float(rel_residual),
            "recurrence_residual": None if recurrence is None else float(recurrence),
            "error": float(error),
            "t_iter_s": t_iter,
            "t_solve_s": t_solve,
            **timing,
            "reductions_per_iter": design,
            "reductions_per_iter_counted": per_iter,
            "reductions_counted": counted,
            "bytes_per_iter": int(bytes_per_iter),
        }
        row.update(extra or {})
        self.results.append(row)
        self.say(TABLE.row(row))
        return row

    # Measuring: every method of a problem round-robin ------------------------------

    def add(self, run, finish):
        """Queue a method: ``run()`` solves, ``finish(samples, output)`` records."""
        self.queue.append((run, finish))

    def measure(self):
        """Time the queued methods round-robin (``_harness.time_rounds``), then
        record them in order, each with the output of its last run."""
        outputs = []
        cases = [run for run, _ in self.queue]
        times = _harness.time_rounds(cases, self.comm, self.args.repeat, 1, outputs)
        for (_, finish), samples, output in zip(
            self.queue, times, outputs, strict=True
        ):
            finish(samples, output)
        self.queue = []

    # The kinds of methods ----------------------------------------------------------

    def add_floor(self, prob, check):
        b, tol, maxiter, comm = prob.b, self.tol, self.maxiter, self.comm

        def run():
            counting = CountingComm(comm)
            matvec = prob.numpy_matvec(counting)
            return numpy_cg(matvec, b, counting, tol, maxiter)

        def finish(samples, output):
            x, k, reductions, recurrence = output
            self.record(
                FLOOR,
                "classic",
                samples=samples,
                iterations=k,
                x_local=x,
                check=check,
                design=2,
                counted=reductions,
                bytes_per_iter=16,
                recurrence=recurrence,
            )

        self.add(run, finish)

    def add_ours(
        self,
        backend,
        label,
        solve,
        check,
        design,
        nbytes,
        program,
        extra=None,
    ):
        """Queue a solve of mpi4jax_dist.cg. ``program`` is ``(jitted, args)``: the
        solver called inside a ``jit``, whose compiled loop the reductions are
        counted in (``info.reductions`` counts the traced one, before XLA could
        combine psums: in the JSON as ``reductions_counted_traced``)."""
        from mpi4jax_dist import to_local
        from mpi4jax_dist.solvers.core import LOOP_SCOPE, REPLACE_SCOPE

        # The solver called inside a jit: its loop, marked by its named scope.
        loop = compiled_loop(*program, LOOP_SCOPE, REPLACE_SCOPE)

        def finish(samples, output):
            x, info = output
            k, matvecs = int(info.iterations), int(info.matvecs)
            counted = None
            if loop is not None and loop.exact:
                # Each residual replacement makes four matvecs beside the
                # iteration's one (pipelined variants).
                counted = int(loop.total(k, (matvecs - k) // 4))
            traced = int(info.reductions)
            self.record(
                backend,
                label,
                samples=samples,
                iterations=int(info.iterations),
                x_local=to_local(x) if backend == "psum" else x,
                check=check,
                design=design,
                counted=counted,
                bytes_per_iter=nbytes,
                recurrence=float(info.recurrence_residual),
                extra={
                    "rel_residual_info": float(info.rel_residual),
                    "converged": bool(info.converged),
                    "matvecs": matvecs,
                    "reductions_counted_traced": None if traced < 0 else traced,
                    **(extra or {}),
                },
            )

        self.add(solve, finish)

    def add_jax_cg(self, backend, make, args_, check, design, nbytes, to_numpy):
        """Queue a ``jax.scipy.sparse.linalg.cg`` reference: ``make(counter)``
        returns the jitted solve, whose matvec calls ``counter`` through
        ``jax.debug.callback`` (an untimed run: one call for the initial residual,
        one per iteration); the reductions per iteration are those of the timed
        program's (``make(None)``) compiled while loop."""
        import jax

        solve = make(None)
        loop = compiled_loop(solve, args_)

        def finish(samples, x):
            calls = [0]

            def count():
                calls[0] += 1

            jax.block_until_ready(make(count)(*args_))
            iterations = self.comm.bcast(calls[0] - 1, root=0)
            counted = None
            if loop is not None and loop.exact:
                counted = loop.total(iterations)
            self.record(
                backend,
                "cg",
                samples=samples,
                iterations=iterations,
                x_local=to_numpy(x),
                check=check,
                design=design,
                counted=counted,
                bytes_per_iter=nbytes,
            )

        self.add(lambda: solve(*args_), finish)

    # Problems ------------------------------------------------------------------

    def problem_a(self):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from mpi4jax_dist import cg, to_global, to_local

        args, comm, mesh = self.args, self.comm, self.mesh
        prob = Poisson(args.n, comm)
        self.tol = tol = args.tol
        self.maxiter = maxiter = args.maxiter or 10 * args.n * args.n
        check_matvec = prob.numpy_matvec()
        norms = self._norms(prob.b, prob.x_true)

        def check(x):
            r = prob.b - check_matvec(x)
            return self._ratio(r, norms[0]), self._ratio(x - prob.x_true, norms[1])

        self.say(
            f"# A: 2D Poisson {args.n} x {args.n}, {prob.rows} grid rows per "
            f"rank, tol {self.tol:g}, maxiter {self.maxiter}"
        )
        if self.wants(FLOOR):
            self.add_floor(prob, check)
        b_local = jnp.asarray(prob.b)
        b_global = to_global(b_local, mesh)
        for backend in (b for b in cg.BACKENDS if self.wants(b)):
            if backend == "mpi4jax":
                matvec, b = prob.mpi4jax_matvec(), b_local
            else:
                matvec, b = prob.shard_matvec(mesh), b_global
            for variant in args.variants:
                record = cg.VARIANT_RECORDS[variant]
                solver = cg.make_solver(
                    matvec,
                    backend=backend,
                    variant=variant,
                    comm=comm,
                    mesh=mesh,
                    replace_every=args.replace_every,
                )
                solve = functools.partial(solver, b, tol=tol, maxiter=maxiter)
                program = jax.jit(functools.partial(solver, tol=tol, maxiter=maxiter))
                self.add_ours(
                    backend,
                    variant,
                    solve,
                    check,
                    record.reductions_by_design,
                    8 * record.scalars,
                    (program, (b,)),
                    extra={"replace_every": solver.replace_every},
                )

        if self.wants(JAX_SCIPY):
            rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
            global_matvec = prob.global_matvec()

            def make(counter):
                def matvec(v):
                    if counter is not None:
                        jax.debug.callback(counter)
                    return global_matvec(v)

                return jax.jit(
                    lambda b: jax.scipy.sparse.linalg.cg(
                        matvec, b, tol=tol, maxiter=maxiter
                    )[0],
                    out_shardings=rows,
                )

            self.add_jax_cg(
                JAX_SCIPY,
                make,
                (b_global,),
                check,
                2,
                16,
                lambda x: np.asarray(to_local(x)),
            )
        self.measure()

    # Helpers --------------------------------------------------------------------

    def _norms(self, *vectors):
        return [self._ratio(v, 1.0) for v in vectors]

    def _ratio(self, v, norm):
        from mpi4py import MPI

        return np.sqrt(self.comm.allreduce(float(v @ v), op=MPI.SUM)) / norm

    def speedups(self):
        """Add and print t/iter and solve-time speedups over classic."""
        from mpi4jax_dist import cg

        lines = []
        for backend in cg.BACKENDS:
            mine = {r["variant"]: r for r in self.results if r["backend"] == backend}
            base = mine.get("classic")
            parts = []
            for variant, row in mine.items():
                if base is not None and variant != "classic":
                    row["speedup_vs_classic"] = base["t_iter_s"] / row["t_iter_s"]
                    row["solve_speedup_vs_classic"] = (
                        base["t_solve_s"] / row["t_solve_s"]
                    )
                    parts.append(
                        f"{variant} {row['speedup_vs_classic']:.2f}x "
                        f"({row['solve_speedup_vs_classic']:.2f}x)"
                    )
            if parts:
                lines.append(
                    f"# speedup over classic, t/iter (solve): A {backend}: "
                    + ", ".join(parts)
                )
        self.say(*lines)


def parse(argv):
    from mpi4jax_dist import cg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="grid side of problem A")
    parser.add_argument(
        "--tol", type=float, default=1e-6, help="relative residual of problem A"
    )
    parser.add_argument(
        "--maxiter",
        type=int,
        default=None,
        help="iterations cap of problem A (default 10 n^2)",
    )
    METHODS.option(parser, "--backends")
    variants = _harness.Registry("variant of mpi4jax_dist.cg")
    for name in cg.VARIANTS:
        variants.register(name, cg.VARIANT_RECORDS[name])
    variants.option(parser, "--variants")
    parser.add_argument(
        "--replace-every",
        type=int,
        default=cg.DEFAULT_REPLACE_EVERY,
        help="residual replacement period of the variants that replace "
        f"(pipelined; 0: none; default {cg.DEFAULT_REPLACE_EVERY})",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed solves each")
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.replace_every < 0 or args.repeat < 1:
        parser.error("--replace-every must be >= 0, --repeat >= 1")
    return args


def main(argv=None) -> list[dict]:
    # Before anything imports jax (parse imports mpi4jax_dist.cg).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args = parse(argv)
    import jax
    import scipy

    import mpi4jax_dist
    from mpi4jax_dist import _compat

    with _harness.float64_world() as comm:
        bench = Bench(args, comm, mpi4jax_dist.global_mesh())
        bench.say(
            f"# distributed CG, {comm.size} ranks, jax {jax.__version__} "
            f"({jax.default_backend()}, CPU collectives "
            f"{_compat.cpu_collectives()}), float64, no preconditioner; "
            f"replace_every {args.replace_every} (pipelined)",
            _harness.threads_line(),
            f"# t/iter: median over {args.repeat} rounds of the slowest rank's solve "
            f"wall, compile excluded, / iterations; methods timed round-robin",
            "# red/it counted: from what ran (the compiled loop body x iterations; "
            "the floor: a counter in its communicator)",
            TABLE.header(),
        )
        bench.problem_a()
        bench.speedups()
        meta = _harness.meta(
            comm,
            args=vars(args),
            timing="median over --repeat solves (round-robin) of the slowest "
            "rank's wall time, compilation and one warm-up solve excluded; "
            "t_iter_s = that / iterations",
            reductions_counted="mpi4jax_dist.cg: its compiled loop (body x "
            "iterations + replacement branch x replacements; "
            "reductions_counted_traced: info.reductions, from the traced loop); "
            "jax.scipy references: their compiled while body x iterations; floor: "
            "a counter in the communicator",
        )
        meta["versions"]["scipy"] = scipy.__version__
        _harness.save(args, meta, bench.results, comm=comm)
        comm.Barrier()
        return bench.results


if __name__ == "__main__":
    with _harness.results_on_stdout():  # the tables alone on stdout, no [Gloo] lines
        main()
