"""A bare mpi4py Allreduce loop, outside the harness: the yardstick for its overhead.

    mpiexec -n 2 python benchmarks/bare_mpi4py.py [--sizes 4,4096,512KiB,16MiB]

Per size: ``--samples`` samples of K back-to-back ``Comm.Allreduce(x, y)`` on
float32 NumPy buffers (no data update, no check), a barrier before each sample,
the slowest rank per sample, the median. Compare with the ``mpi4py loop`` rows of
benchmarks/allreduce.py, which also update and check the data every step.
"""

import argparse
import statistics
import time

import numpy as np
from allreduce import iterations, parse_sizes
from mpi4py import MPI


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=parse_sizes, default=parse_sizes("4,4096,512KiB,16MiB")
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--samples", type=int, default=10)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# bare mpi4py Allreduce, {comm.size} ranks, float32")
        print(f"# {'bytes':>10} {'t_median us':>12}")
    rows = []
    for nbytes in args.sizes:
        x = np.ones(max(1, nbytes // 4), dtype=np.float32)
        y = np.empty_like(x)
        k = iterations(x.nbytes, args.iters)
        comm.Allreduce(x, y)
        times = []
        for _ in range(args.samples):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                comm.Allreduce(x, y)
            times.append((time.perf_counter() - t0) / k)
        slowest = np.empty(len(times))
        comm.Allreduce(np.asarray(times), slowest, op=MPI.MAX)
        median = statistics.median(slowest)
        rows.append({"bytes": x.nbytes, "t_median_s": median})
        if comm.rank == 0:
            print(f"  {x.nbytes:>10} {median * 1e6:>12.1f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
