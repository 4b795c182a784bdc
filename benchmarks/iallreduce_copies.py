"""What the non-blocking allreduce's two copies cost, against the blocking one.

Usage::

    mpiexec -n 2 python benchmarks/iallreduce_copies.py [--sizes 4,1MiB,64MiB]
        [--samples 30] [--json PATH]

``mpi4jax_dist.iallreduce`` copies its operand into memory the extension owns and
the wait copies the result out (MPI must never write into a buffer XLA may free
while the request is pending); ``mpi4jax_dist.allreduce`` reduces XLA's buffer in
place. Both run jitted with their input donated, on ``MPI.COMM_WORLD``, float32, the
pair's start and wait back to back; the samples of the two alternate (one of each
per round, each after a barrier), so that a drift of the machine's speed falls on
both alike. Rank 0 prints the median microseconds per call of each and their
ratio, one row per size; ``--json PATH`` writes the rows with their provenance.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

SIZES = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes of ``4``, ``1MiB``, ``64mib``..."""
    lower = text.strip().lower()
    for unit in ("kib", "mib", "gib"):
        if lower.endswith(unit):
            return int(lower[: -len(unit)]) * SIZES[unit]
    return int(lower)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,1MiB,64MiB")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--json", metavar="PATH", help="write meta and results here")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    import mpi4jax_dist
    from mpi4jax_dist import _mpi

    comm = MPI.COMM_WORLD
    results = []
    impls = {
        "iallreduce+wait": jax.jit(
            lambda x: mpi4jax_dist.iallreduce(x, comm=comm).wait(),
            donate_argnums=0,
        ),
        "allreduce": jax.jit(
            lambda x: mpi4jax_dist.allreduce(x, comm=comm), donate_argnums=0
        ),
    }
    if comm.rank == 0:
        print(
            f"# {comm.size} ranks, float32, jitted, donated; median of "
            f"{args.samples} alternating samples per call"
        )
        header = ("bytes", "iallreduce+wait us", "allreduce us", "ratio")
        print(
            " ".join(f"{h:>{w}}" for h, w in zip(header, (12, 19, 14, 7), strict=True))
        )
    for size in (parse_size(s) for s in args.sizes.split(",")):
        n = max(1, size // 4)
        xs = {name: jnp.ones(n, jnp.float32) for name in impls}
        for name, fn in impls.items():  # compile and warm up
            xs[name] = fn(xs[name]).block_until_ready()
        times = {name: [] for name in impls}
        for _ in range(args.samples):
            for name, fn in impls.items():
                comm.Barrier()
                start = time.perf_counter()
                xs[name] = fn(xs[name]).block_until_ready()
                times[name].append(time.perf_counter() - start)
        # The slowest rank's median: the job waits for it.
        med = {
            name: comm.allreduce(float(np.median(t)) * 1e6, op=MPI.MAX)
            for name, t in times.items()
        }
        a, b = med["iallreduce+wait"], med["allreduce"]
        if comm.rank == 0:
            print(f"{n * 4:>12} {a:>19.1f} {b:>14.1f} {a / b:>7.2f}")
        results.append(
            {
                "bytes": n * 4,
                "iallreduce_wait_median_us": a,
                "allreduce_median_us": b,
                "ratio": a / b,
                "samples": args.samples,
            }
        )
    # jax.distributed is not initialized here: the MPI fields by hand.
    meta = _harness.meta(
        mpi_library=_mpi.mpi_library(),
        world_size=comm.Get_size(),
        backend=jax.default_backend(),
        dtype="float32",
        args=vars(args),
        timing="per size, the slowest rank's median over --samples alternating "
        "samples of one jitted, donated call",
    )
    _harness.save(args, meta, results, comm=comm)


if __name__ == "__main__":
    main()
