"""A bare mpi4py Allreduce loop: the yardstick for the allreduce benchmark's floor.

    mpiexec -n 2 python benchmarks/bare_mpi4py.py [--sizes 4,4096,512KiB,16MiB]
        [--compare] [--json PATH]

Per size: K back-to-back ``Comm.Allreduce(x, y)`` on float32 NumPy buffers, nothing
else (no buffer swap, no data update, no check), timed by ``_harness.time_rounds``
(one warm-up, a barrier before each sample, the slowest rank per sample) with the
same K as benchmarks/allreduce.py. With ``--compare`` the ``mpi4py`` loop of
benchmarks/allreduce.py (its registered implementation, from _allreduce_impls.py,
buffers swapped every step) is timed in the same rounds, interleaved with the bare
loop, and ``ratio`` is its median over the bare median: the harness's own overhead,
which should be ~1.
``--json PATH`` writes the rows with their provenance.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

TABLE = _harness.Table(
    [
        _harness.Column("bytes", "bytes", "per rank", 10),
        _harness.Column("what", "what", "", 14, left=True),
        _harness.Column("steps", "K", "", 4),
        _harness.Column("t_min_s", "t_min", "us", 9, ".1f", 1e6),
        _harness.Column("t_median_s", "t_median", "us", 9, ".1f", 1e6),
        _harness.Column("t_max_s", "t_max", "us", 9, ".1f", 1e6),
        _harness.Column("ratio", "ratio", "to bare", 7, ".2f"),
    ]
)


def main(argv=None) -> list[dict]:
    """Time the bare loop per size (and the benchmark's mpi4py loop with
    ``--compare``); return the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=_harness.parse_sizes,
        default=_harness.parse_sizes("4,4096,512KiB,16MiB"),
        help="bytes per rank, comma-separated",
    )
    parser.add_argument(
        "--iters", type=int, default=50, help="K for small messages, as allreduce.py"
    )
    parser.add_argument("--samples", type=int, default=10, help="timed samples")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also time allreduce.py's mpi4py loop, interleaved",
    )
    parser.add_argument("--json", metavar="PATH", help="write meta and results here")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from mpi4jax_dist import _mpi

    comm = MPI.COMM_WORLD
    _harness.say(
        comm,
        f"# bare mpi4py Allreduce(x, y), {comm.Get_size()} ranks, float32; "
        "time per allreduce, slowest rank per sample",
        TABLE.header(),
    )
    rows = []
    for nbytes in args.sizes:
        x = np.ones(max(1, nbytes // 4), dtype=np.float32)
        y = np.empty_like(x)
        steps = _harness.steps_for(x.nbytes, args.iters)

        def bare(x=x, y=y, steps=steps):
            for _ in range(steps):
                comm.Allreduce(x, y)

        cases, names = [bare], ["bare"]
        if args.compare:
            import _allreduce_impls

            impl = _allreduce_impls.IMPLS["mpi4py"](x.size, np.float32, comm)
            cases.append(lambda impl=impl, steps=steps: impl.loop(steps))
            names.append("mpi4py loop")
        times = _harness.time_rounds(cases, comm, args.samples)
        found = []
        for name, sample in zip(names, times, strict=True):
            found.append(
                {
                    "bytes": x.nbytes,
                    "what": name,
                    "steps": steps,
                    "samples": args.samples,
                    **_harness.summary(t / steps for t in sample),
                }
            )
        for row in found:
            row["ratio"] = row["t_median_s"] / found[0]["t_median_s"]
        _harness.say(comm, *(TABLE.row(r) for r in found))
        rows += found
    # No JAX here: the MPI fields of meta() are filled in by hand.
    meta = _harness.meta(
        mpi_library=_mpi.mpi_library(),
        world_size=comm.Get_size(),
        dtype="float32",
        args=vars(args),
        timing="median over --samples rounds (round-robin) of the slowest rank's "
        "time per allreduce, one warm-up excluded",
    )
    _harness.save(args, meta, rows, comm=comm)
    return rows


if __name__ == "__main__":
    main()
