"""Can a CG's reduction hide behind its matvec? The delay table, for
mpi4jax_dist.cg's mpi4jax backend.

    mpiexec -bind-to core -n 2 python benchmarks/overlap.py
        [--delays 0,20,50,100,200] [--grids 64,256]
        [--variants classic,single,pipelined,...] [--iters 100] [--samples 5]
        [--json PATH]

(Open MPI: ``--bind-to core``.) Two ranks on shared memory have almost no
reduction latency to hide, so every reduction completes ``delay`` µs after it was
posted, as an 8-byte allreduce over 10^4 ranks does: a PMPI interposer
(``pmpi_latency.c``, built and preloaded, :mod:`_latency`) holds each
``MPI_Allreduce`` and each ``MPI_Iallreduce``'s wait until then. A blocking
reduction pays ``delay``, an overlapped one ``max(delay, matvec)``. Each variant
runs ``--iters`` iterations of the 2-D Poisson problem (``_poisson.py``; tolerance
below reach, so every solve makes as many), compiled first, then timed round-robin
per grid; the table gives the slowest rank's time per iteration, the median of
``--samples`` solves.

What this script no longer asks (settled): docs/benchmarks-settled.rst.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
import _latency  # noqa: E402
import _poisson  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--delays", type=_harness.floats, default="0,20,50,100,200", help="µs"
    )
    parser.add_argument(
        "--grids", type=_harness.ints, default="64,256", help="grid sides n"
    )
    parser.add_argument(
        "--variants", default=None, help="mpi4jax_dist.cg variants (default all)"
    )
    parser.add_argument("--iters", type=int, default=100, help="CG iterations")
    parser.add_argument("--samples", type=int, default=5, help="timed solves each")
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    return args


def warmed(case, latency):
    """``case`` that first sets the interposer's delay to ``latency`` (µs; None:
    none), after one untimed call of it (compiling it)."""

    def run():
        if latency is not None or _latency.preloaded():
            _latency.set_us(latency or 0)
        return case()

    _harness.block(run())
    return run


def main(argv=None):
    args = parse_args(argv)
    import mpi4jax_dist  # noqa: I001  (before jax: it registers the cluster env)

    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    from mpi4jax_dist import cg

    jax.config.update("jax_enable_x64", True)
    mpi4jax_dist.initialize()

    comm = MPI.COMM_WORLD
    variants = args.variants.split(",") if args.variants else list(cg.VARIANTS)
    # Unbound, each rank's XLA splits its loops over every core, and the two ranks
    # then take each other's: bind them (mpiexec -bind-to core, Open MPI's
    # default for 2 ranks), which the header shows.
    cores = comm.allgather(sorted(os.sched_getaffinity(0)))
    meta = _harness.meta(comm, iters=args.iters, cores=cores)
    _harness.say(
        comm,
        f"# CG iteration time under an injected delay, {comm.size} ranks, "
        f"{meta['mpi_library']}, jax {meta['versions']['jax']}; mpi4jax backend, "
        f"float64, {args.iters} iterations per solve; cores of each rank: "
        f"{cores}",
        f"# delay d: every reduction completes d us after its post (simulated); "
        f"t/iter: slowest rank, median of {args.samples} solves",
    )
    rows, mode = [], "latency"
    for n in args.grids:
        prob = _poisson.Poisson(n, comm)
        b = jnp.asarray(prob.b)
        cases = []
        for delay, variant in [(d, v) for d in args.delays for v in variants]:
            solver = cg.make_solver(
                prob.mpi4jax_matvec(),
                backend="mpi4jax",
                variant=variant,
                comm=comm,
            )
            cases.append(
                warmed(
                    lambda solver=solver, b=b: solver(
                        b, tol=1e-300, maxiter=args.iters
                    ),
                    delay,
                )
            )
        times = _harness.time_rounds(cases, comm, args.samples, warmup=0)
        per_iter = [float(np.median(t)) / args.iters * 1e6 for t in times]
        _harness.say(
            comm,
            "# mode     n  delay_us  " + "  ".join(f"{v:>14}" for v in variants),
        )
        for i, delay in enumerate(args.delays):
            row = per_iter[i * len(variants) : (i + 1) * len(variants)]
            result = {
                "mode": mode,
                "n": n,
                "delay_us": delay,
                **dict(zip(variants, row, strict=True)),
            }
            line = f"  {mode:6s}{n:5d}  {delay:8g}  " + "  ".join(
                f"{t:14.1f}" for t in row
            )
            rows.append(result)
            _harness.say(comm, line)
    _harness.save(args, meta, rows, comm=comm)
    return rows


if __name__ == "__main__":
    if parse_args().delays:
        _latency.preload()  # before MPI starts: runs this script again
    with _harness.results_on_stdout():  # the tables alone on stdout, no [Gloo] lines
        main()
