"""First-call cost of a CG solve inside the caller's jit: JAX's cg against ours.

    python benchmarks/first_compile.py [--procs 2] [--params 1824] [--samples 256]
        [--repeat 5] [--cases jax_cg,dropin,...] [--json PATH]

The stochastic-reconfiguration step of a variational Monte Carlo code: ``x0``
and ``f`` replicated, this rank's Jacobian rows ``J`` (``--samples`` per rank x
``--params``), ``A(x) = mpi4jax.allreduce(J^T (J x)) / N + eps x``, a solve of 200
iterations at most, all inside one ``jax.jit``, float64. Cases:

``jax_cg``
    ``jax.scipy.sparse.linalg.cg(A, f, x0=x0, tol=1e-5, atol=0.0, maxiter=200)``,
    the user's line;
``dropin``, ``dropin_pipelined``
    ``mpi4jax_dist.cg(...)``, the same line (classic; pipelined);
``solve_normal``
    ``mpi4jax_dist.cg.solve_normal(J, f, eps, x0=x0)``, which builds ``A`` itself.

Each case runs ``--repeat`` times, each time in a fresh ``mpiexec -n P`` job
(``_harness.run_job``) so that no cache of an earlier case helps it (JAX's
persistent compilation cache is off unless the environment turns it on). In the
job, every rank times ``jax.jit(step).lower(...)`` (tracing, the package's
counting of reductions included), ``.compile()``, the first call (after a
barrier), and a second call (the solve alone). A row gives the medians over the
jobs of the slowest rank's times; ``first = lower + compile``, and its ratio to
``jax_cg``'s. The processes' start-up (imports, ``jax.distributed.initialize``)
is not in any figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The harness beside this script, also under PYTHONSAFEPATH=1 (how CI runs the
# installed copies), which leaves the script's folder off sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

CASES = ("jax_cg", "dropin", "dropin_pipelined", "solve_normal")


def job(case: str, params: int, samples: int) -> None:
    """One case in this job: print the slowest rank's times."""
    import jax

    import mpi4jax_dist  # registers the cluster env

    jax.distributed.initialize()
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import mpi4jax
    import numpy as np
    from mpi4py import MPI

    from mpi4jax_dist import cg

    comm = MPI.COMM_WORLD
    N = samples * comm.size
    rng = np.random.default_rng(comm.rank)
    J = jnp.asarray(rng.standard_normal((samples, params)))
    f = jnp.asarray(np.random.default_rng(1).standard_normal(params))
    eps = 1e-3

    def step(J, f, x0):
        def A(x):
            return mpi4jax.allreduce(J.T @ (J @ x), op=MPI.SUM, comm=comm) / N + eps * x

        options = dict(x0=x0, tol=1e-5, atol=0.0, maxiter=200)
        if case == "jax_cg":
            return jax.scipy.sparse.linalg.cg(A, f, **options)[0]
        if case == "solve_normal":
            return cg.solve_normal(J, f, eps, x0=x0, num_samples=N)[0]
        variant = "pipelined" if case == "dropin_pipelined" else "classic"
        return mpi4jax_dist.cg(A, f, variant=variant, **options)[0]

    x0 = jnp.zeros(params)
    comm.Barrier()
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(J, f, x0)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    del compiled  # the call below goes through jit, which finds it in its cache
    comm.Barrier()
    t3 = time.perf_counter()
    jax.jit(step)(J, f, x0).block_until_ready()
    t4 = time.perf_counter()
    comm.Barrier()
    t5 = time.perf_counter()
    jax.jit(step)(J, f, x0).block_until_ready()
    t6 = time.perf_counter()
    times = dict(lower_s=t1 - t0, compile_s=t2 - t1, call1_s=t4 - t3, call2_s=t6 - t5)
    slowest = {k: comm.allreduce(v, op=MPI.MAX) for k, v in times.items()}
    if comm.rank == 0:
        _harness.report(case=case, **slowest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--params", type=int, default=1824)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.job:
        job(args.job, args.params, args.samples)
        return 0
    cases = args.cases.split(",")
    for case in cases:
        if case not in CASES:
            parser.error(f"--cases: {case!r} is not one of {', '.join(CASES)}")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    runs = {case: [] for case in cases}
    for _ in range(args.repeat):  # round-robin: drift hits every case alike
        for case in cases:
            argv_ = [__file__, "--job", case, "--params", str(args.params)]
            result = _harness.run_job(
                args.procs,
                argv_ + ["--samples", str(args.samples)],
                timeout=args.timeout,
            )
            if not result.ok or not result.results:
                print(f"{case}: job failed\n{result.tail}", file=sys.stderr)
                return 1
            runs[case].append(result.results[0])
    rows = []
    for case in cases:
        row = {"case": case}
        for key in ("lower_s", "compile_s", "call1_s", "call2_s"):
            row[key] = statistics.median(r[key] for r in runs[case])
        row["first_s"] = statistics.median(
            r["lower_s"] + r["compile_s"] for r in runs[case]
        )
        rows.append(row)
    base = next((r["first_s"] for r in rows if r["case"] == "jax_cg"), None)
    print(
        f"first compile inside jit: {args.procs} ranks, {args.params} params, "
        f"{args.samples} samples per rank, median of {args.repeat} fresh jobs"
    )
    print(
        f"{'case':18} {'lower s':>8} {'compile s':>10} {'first s':>8} "
        f"{'x jax_cg':>9} {'call1 s':>8} {'call2 s':>8}"
    )
    for r in rows:
        ratio = f"{r['first_s'] / base:.2f}" if base else "-"
        print(
            f"{r['case']:18} {r['lower_s']:8.3f} {r['compile_s']:10.3f} "
            f"{r['first_s']:8.3f} {ratio:>9} {r['call1_s']:8.3f} {r['call2_s']:8.3f}"
        )
    _harness.save(args, _harness.meta(params=args.params, samples=args.samples), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
