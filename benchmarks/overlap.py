"""Can a CG's reduction hide behind its matvec? The delay table and an overlap
microbenchmark, for mpi4jax_dist.cg's mpi4jax backend.

Usage::

    mpiexec -n 2 python benchmarks/overlap.py [--delays 0,20,50,100,200]
        [--grids 64,256] [--variants classic,single,pipelined,...] [--iters 100]
        [--samples 5] [--json PATH]

Two ranks on one machine's shared memory have almost no reduction latency to hide,
so the delay table injects what a large machine has: rank 1 spins ``delay`` µs
once per CG iteration (a busy loop inside XLA, calibrated here, which its matvec's
input waits for), as OS noise and load imbalance do at scale. Each variant runs
``--iters`` iterations of the 2-D Poisson problem of ``benchmarks/cg.py`` (tolerance
below reach, so every solve makes the same number), and the table gives the
slowest rank's time per iteration, median of ``--samples`` solves, round-robin.

The microbenchmark times, in jitted loops, one non-blocking allreduce of three
float64 alone (start, wait), the grid's matvec alone, and both overlapped (start,
matvec, wait), and reports the overlap efficiency
``(t_reduce + t_matvec - t_both) / min(t_reduce, t_matvec)``: 1 when the smaller
hides completely, 0 when nothing overlaps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="0,20,50,100,200", help="µs, comma-sep.")
    parser.add_argument("--grids", default="64,256", help="grid sides n")
    parser.add_argument(
        "--variants", default=None, help="mpi4jax_dist.cg variants (default all)"
    )
    parser.add_argument(
        "--mode",
        default="rank1,noise",
        help="comma-separated: rank1 (rank 1 every iteration), noise (every rank, "
        "half the iterations, independently)",
    )
    parser.add_argument("--iters", type=int, default=100, help="CG iterations")
    parser.add_argument("--samples", type=int, default=5, help="timed solves each")
    parser.add_argument(
        "--micro-iters", type=int, default=200, help="loop trips of the micro cases"
    )
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.delays = [float(d) for d in args.delays.split(",") if d]
    args.grids = [int(n) for n in args.grids.split(",") if n]
    args.mode = [m for m in args.mode.split(",") if m]
    for mode in args.mode:
        if mode not in ("rank1", "noise"):
            parser.error(f"--mode {mode}: expected rank1 or noise")
    return args


def spin(v, trips):
    """Return ``v`` once a busy loop of ``trips`` trips has run (inside XLA).

    The loop carries a float chain XLA cannot shorten, starting from ``v`` and
    ``v``'s result depends on it through a test XLA cannot decide (``i == trips and
    acc > 0``, always true), so the loop is neither optimised away nor hoisted.
    """
    import jax.numpy as jnp
    from jax import lax

    def body(c):
        i, acc = c
        return i + 1, acc * 1.0000001 + 1e-7

    # The chain starts from v, so that the loop runs where v is computed (inside a
    # CG iteration), not hoisted out of the iteration as loop-invariant.
    first = 1 + v.reshape(-1)[0].astype(jnp.float32) * 0.0
    i, acc = lax.while_loop(lambda c: c[0] < trips, body, (jnp.int32(0), first))
    return v + jnp.where((i == trips) & (acc > 0), 0, 1).astype(v.dtype)


def trips_per_us(samples: int = 5) -> float:
    """Calibrate :func:`spin`: loop trips per microsecond on this rank."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(spin)
    v = jnp.ones(1)
    trips = 2_000_000
    f(v, trips).block_until_ready()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        f(v, trips).block_until_ready()
        times.append(time.perf_counter() - start)
    return trips / (float(np.median(times)) * 1e6)


def delayed(matvec, trips: int, noise: bool = False):
    """``matvec`` whose input first waits for a spin of ``trips`` (0: none).

    ``noise``: only in the iterations where the lowest mantissa bit of the input's
    first element is set, which the iterates make about every other iteration,
    independently on each rank.
    """
    if trips <= 0:
        return matvec
    if not noise:
        return lambda v: matvec(spin(v, trips))
    import jax.numpy as jnp
    from jax import lax

    def noisy(v):
        bits = lax.bitcast_convert_type(v.reshape(-1)[0], jnp.int64)
        return matvec(spin(v, (bits & 1).astype(jnp.int32) * trips))

    return noisy


def micro(prob, comm, trips: int, samples: int):
    """Seconds per loop trip of: the non-blocking allreduce of three float64 alone,
    the grid's matvec alone, and both overlapped (start, matvec, wait); the
    slowest rank's median over ``samples`` runs of ``trips`` trips each."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import mpi4jax_dist

    matvec = prob.mpi4jax_matvec()
    three = jnp.ones(3)

    def reduce_only(c, v):
        return mpi4jax_dist.wait(mpi4jax_dist.iallreduce(c / comm.size)), v

    def matvec_only(c, v):
        return c, matvec(v) * 1e-3

    def both(c, v):
        req = mpi4jax_dist.iallreduce(c / comm.size)
        req, av = mpi4jax_dist.overlap(req, matvec, v)
        return mpi4jax_dist.wait(req), av * 1e-3

    def looped(body):
        return jax.jit(
            lambda c, v: lax.fori_loop(0, trips, lambda i, cv: body(*cv), (c, v))
        )

    v = jnp.asarray(prob.b)
    compiled = [looped(f) for f in (reduce_only, matvec_only, both)]
    cases = [lambda f=f: f(three, v) for f in compiled]
    times = _harness.time_rounds(cases, comm, samples)
    return [float(np.median(t)) / trips for t in times]


def main(argv=None):
    args = parse_args(argv)
    import mpi4jax_dist  # noqa: I001  (before jax: it registers the cluster env)

    import cg as cg_bench
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    from mpi4jax_dist import cg

    jax.config.update("jax_enable_x64", True)
    mpi4jax_dist.initialize()

    comm = MPI.COMM_WORLD
    rate = comm.allreduce(trips_per_us(), op=MPI.MIN)
    variants = args.variants.split(",") if args.variants else list(cg.VARIANTS)
    meta = _harness.meta(comm, spin_trips_per_us=rate, iters=args.iters)
    _harness.say(
        comm,
        f"# CG iteration time under an injected delay, {comm.size} ranks, "
        f"{meta['mpi_library']}, jax {meta['versions']['jax']}; mpi4jax backend, "
        f"float64, {args.iters} iterations per solve",
        f"# delay: a rank spins d us before its matvec ({rate:.0f} spin trips per "
        f"us): rank1, rank 1 every iteration; noise, every rank in about half the "
        f"iterations, independently; t/iter: slowest rank, median of "
        f"{args.samples} solves",
    )
    rows = []
    _harness.say(
        comm,
        "# overlap: one non-blocking allreduce of 3 float64 and the grid's matvec, "
        f"in jitted loops of {args.micro_iters}; efficiency = (reduce + matvec - "
        "both) / min(reduce, matvec)",
        "#      n   reduce_us   matvec_us     both_us  efficiency",
    )
    for n in args.grids:
        t_red, t_mv, t_both = micro(
            cg_bench.Poisson(n, comm), comm, args.micro_iters, args.samples
        )
        efficiency = (t_red + t_mv - t_both) / min(t_red, t_mv)
        rows.append(
            {
                "micro": True,
                "n": n,
                "reduce_us": t_red * 1e6,
                "matvec_us": t_mv * 1e6,
                "both_us": t_both * 1e6,
                "efficiency": efficiency,
            }
        )
        _harness.say(
            comm,
            f"  {n:5d}  {t_red * 1e6:10.2f}  {t_mv * 1e6:10.2f}  "
            f"{t_both * 1e6:10.2f}  {efficiency:10.2f}",
        )
    for n in args.grids:
        prob = cg_bench.Poisson(n, comm)
        b = jnp.asarray(prob.b)
        _harness.say(
            comm,
            "# mode     n  delay_us  " + "  ".join(f"{v:>14}" for v in variants),
        )
        for mode, delay in [(m, d) for m in args.mode for d in args.delays]:
            trips = int(round(delay * rate))
            if mode == "rank1" and comm.rank != 1:
                trips = 0
            solves = []
            for variant in variants:
                solver = cg.make_solver(
                    delayed(prob.mpi4jax_matvec(), trips, noise=mode == "noise"),
                    backend="mpi4jax",
                    variant=variant,
                    comm=comm,
                )
                solves.append(
                    lambda solver=solver, b=b: solver(b, tol=1e-300, maxiter=args.iters)
                )
            times = _harness.time_rounds(solves, comm, args.samples)
            per_iter = [float(np.median(t)) / args.iters * 1e6 for t in times]
            rows.append(
                {
                    "mode": mode,
                    "n": n,
                    "delay_us": delay,
                    **dict(zip(variants, per_iter, strict=True)),
                }
            )
            _harness.say(
                comm,
                f"  {mode:6s}{n:5d}  {delay:8g}  "
                + "  ".join(f"{t:14.1f}" for t in per_iter),
            )
    _harness.save(args, meta, rows, comm=comm)
    return rows


if __name__ == "__main__":
    main()
