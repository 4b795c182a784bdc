"""Can a CG's reduction hide behind its matvec? The delay table and an overlap
microbenchmark, for mpi4jax_dist.cg's mpi4jax backend.

Usage::

    mpiexec -bind-to core -n 2 python benchmarks/overlap.py
        [--delays 0,20,50,100,200] [--grids 64,256]
        [--variants classic,single,pipelined,...] [--iters 100] [--samples 5]
        [--micro-latencies 0,50] [--json PATH]

(Open MPI: ``--bind-to core``.) Every case of a table is compiled first and then
timed round-robin with the others, so that a drift of the machine's speed falls on
all alike.

Two ranks on one machine's shared memory have almost no reduction latency to hide,
so the delay table injects what a large machine has: every reduction completes
``delay`` µs after it was posted, as an 8-byte allreduce over 10^4 ranks does: a
PMPI interposer (``pmpi_latency.c``, built and preloaded by the benchmark,
:mod:`_latency`) holds each ``MPI_Allreduce`` and each ``MPI_Iallreduce``'s wait
until then. A blocking reduction pays ``delay``, an overlapped one ``max(delay,
matvec)``. (Settled, and retired from this script: a delay on rank 1 alone, load
imbalance, and on each rank in half the iterations, OS noise, which no variant
hides; docs/benchmarks.rst cites their rows, run by the script as it last was, from
``git archive 9d20368:benchmarks``, as ``--mode rank1,noise``.)

Each variant runs
``--iters`` iterations of the 2-D Poisson problem of ``benchmarks/cg.py`` (tolerance
below reach, so every solve makes the same number), and the table gives the
slowest rank's time per iteration, median of ``--samples`` solves, round-robin.

The microbenchmark times, in jitted loops, one non-blocking allreduce of three
float64 alone (start, wait), the grid's matvec alone, and both overlapped (start,
matvec, wait), and reports the overlap efficiency
``(t_reduce + t_matvec - t_both) / min(t_reduce, t_matvec)``: 1 when the smaller
hides completely, 0 when nothing overlaps.

The extension counts, per wait, whether its first ``MPI_Test`` completed the
reduction (``done``), the time from the post to the wait (``slack``: the work
overlapped) and the time the wait then spent waiting (``blocked``: what the work
did not hide); the CG table gives the same for ``pipelined_nb``'s waits. (Settled,
and retired from this script: the progress table, the reduction overlapped with
work that makes no MPI call, with and without a ``req.test()`` in it, run from
``git archive 819e3f9:benchmarks``.)
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
    parser.add_argument(
        "--micro-iters", type=int, default=200, help="loop trips of the micro cases"
    )
    parser.add_argument(
        "--micro-latencies",
        type=_harness.floats,
        default="0,50",
        help="simulated reduction latencies (us) of the micro cases, comma-sep.",
    )
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


def wait_counts(case, comm, runs: int = 1) -> dict:
    """What the waits of ``case`` found, over all ranks, from the extension's
    counters, the median over ``runs`` runs (untimed): ``done``, the share whose
    first ``MPI_Test`` completed the reduction; ``slack_us``, µs from post to wait,
    and ``blocked_us``, µs the wait then waited, each per wait."""
    import mpi4jax_dist

    names = ("waits", "done_before_wait", "wait_slack_ns", "wait_blocked_ns")
    per_run = []
    for _ in range(runs):
        mpi4jax_dist.op_counts(reset=True)
        comm.Barrier()
        _harness.block(case())
        stats = mpi4jax_dist.op_counts()
        mine = [stats[f"iallreduce_{k}"] for k in names]
        total = dict(zip(names, np.sum(comm.allgather(mine), axis=0), strict=True))
        waits = max(int(total["waits"]), 1)
        per_run.append(
            {
                "done": total["done_before_wait"] / waits,
                "slack_us": total["wait_slack_ns"] / waits / 1e3,
                "blocked_us": total["wait_blocked_ns"] / waits / 1e3,
            }
        )
    return {key: float(np.median([r[key] for r in per_run])) for key in per_run[0]}


def looped(prob, trips: int, latency, bodies):
    """Each ``body(c, v) -> (c, v)`` as a jitted loop of ``trips`` from three
    float64 ones and the grid's right-hand side, compiled under ``latency``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    three, v = jnp.ones(3), jnp.asarray(prob.b)

    def case(body):
        f = jax.jit(
            lambda c, v: lax.fori_loop(0, trips, lambda i, cv: body(*cv), (c, v))
        )
        return warmed(lambda: f(three, v), latency)

    return [case(body) for body in bodies]


def micro_cases(prob, comm, trips: int, latency):
    """The three micro cases, compiled under ``latency``, as loops of ``trips``:
    the non-blocking allreduce of three float64 alone (start, wait), the grid's
    matvec alone, and both overlapped (start, matvec, wait)."""
    import mpi4jax_dist

    matvec = prob.mpi4jax_matvec()

    def reduce_only(c, v):
        return mpi4jax_dist.iallreduce(c / comm.size).wait(), v

    def matvec_only(c, v):
        return c, matvec(v) * 1e-3

    def both(c, v):
        req = mpi4jax_dist.iallreduce(c / comm.size)
        req, av = req.overlap(matvec, v)
        return req.wait(), av * 1e-3

    return looped(prob, trips, latency, (reduce_only, matvec_only, both))


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
    rows = []
    _harness.say(
        comm,
        "# overlap: one non-blocking allreduce of 3 float64 (with a simulated "
        f"latency, us) and the grid's matvec, in jitted loops of "
        f"{args.micro_iters}; efficiency = (reduce + matvec - both) / "
        f"min(reduce, matvec)",
        "# of the overlapped waits (all ranks): done, the share whose first "
        "MPI_Test completed the reduction; slack, us from post to wait; blocked, "
        "us the wait then waited",
        "#      n  latency   reduce_us   matvec_us     both_us  efficiency    done"
        "  slack_us  blocked_us",
    )
    # Every case of a table is compiled first, then all are timed round-robin, so
    # that a drift of the machine's speed falls on all of them alike.
    for n in args.grids:
        prob = _poisson.Poisson(n, comm)
        cases = []
        for latency in args.micro_latencies:
            cases += micro_cases(prob, comm, args.micro_iters, latency)
        times = _harness.time_rounds(cases, comm, args.samples, warmup=0)
        per_trip = [float(np.median(t)) / args.micro_iters * 1e6 for t in times]
        for i, latency in enumerate(args.micro_latencies):
            t_red, t_mv, t_both = per_trip[3 * i : 3 * i + 3]
            efficiency = (t_red + t_mv - t_both) / min(t_red, t_mv)
            counts = wait_counts(cases[3 * i + 2], comm, args.samples)
            row = {
                "micro": True,
                "n": n,
                "latency_us": latency,
                "reduce_us": t_red,
                "matvec_us": t_mv,
                "both_us": t_both,
                "efficiency": efficiency,
                "done_before_wait": counts["done"],
                "slack_us": counts["slack_us"],
                "blocked_us": counts["blocked_us"],
            }
            rows.append(row)
            _harness.say(
                comm,
                f"  {n:5d}  {latency:7g}  {t_red:10.2f}  {t_mv:10.2f}  "
                f"{t_both:10.2f}  {efficiency:10.2f}  {counts['done']:6.2f}  "
                f"{counts['slack_us']:8.2f}  {counts['blocked_us']:10.2f}",
            )
    mode = "latency"
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
        # The overlapped variant's waits: what its work hid (slack) and did not
        # (blocked), per wait, all ranks (median of --samples more solves, untimed).
        nb = "pipelined_nb" if "pipelined_nb" in variants else None
        _harness.say(
            comm,
            "# mode     n  delay_us  "
            + "  ".join(f"{v:>14}" for v in variants)
            + ("  nb_slack_us  nb_blocked_us" if nb else ""),
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
            if nb:
                counts = wait_counts(
                    cases[i * len(variants) + variants.index(nb)], comm, args.samples
                )
                result["pipelined_nb_waits"] = counts
                line += f"  {counts['slack_us']:11.1f}  {counts['blocked_us']:13.1f}"
            rows.append(result)
            _harness.say(comm, line)
    _harness.save(args, meta, rows, comm=comm)
    return rows


def needs_latency(args) -> bool:
    """Whether ``args`` ask for a reduction latency (the interposer)."""
    return bool(args.delays) or any(args.micro_latencies)


if __name__ == "__main__":
    if needs_latency(parse_args()):
        _latency.preload()  # before MPI starts: runs this script again
    main()
