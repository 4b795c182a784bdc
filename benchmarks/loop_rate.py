"""One implementation's jitted loop at one size, for a while: a steady load to look
at with ``perf`` (the in-place allreduce and huge pages, docs/benchmarks.rst).

    mpiexec -n 2 python benchmarks/loop_rate.py IMPL BYTES SECONDS [--trips 20]

Runs ``loop(trips)`` of the allreduce implementation ``IMPL`` (the benchmarks'
``_allreduce_impls.IMPLS``, as ``allreduce.py --impls`` names them) on an
all-zero message of ``BYTES`` per rank until ``SECONDS`` have passed on every rank,
and prints on rank 0 the allreduces run and the time per allreduce, dispatch
included. Under ``perf record`` or ``perf stat`` (per rank: ``sh -c 'exec perf stat
-o out-$PMI_RANK.txt python ...'``) it shows where that time goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impl", help="an implementation of allreduce.py")
    parser.add_argument("bytes", type=int, help="bytes per rank")
    parser.add_argument("seconds", type=float, help="how long to run")
    parser.add_argument("--trips", type=int, default=20, help="trips per loop call")
    args = parser.parse_args(argv)

    import mpi4jax_dist  # noqa: F401, I001

    import jax

    if not jax.distributed.is_initialized():
        jax.distributed.initialize()
    import _allreduce_impls
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = max(1, args.bytes // 4)
    impl = _allreduce_impls.IMPLS[args.impl](n, np.float32, comm)
    impl.load(np.zeros(n, np.float32))
    impl.loop(args.trips)  # warm-up: compiled, pages touched
    comm.Barrier()
    start, calls = time.perf_counter(), 0
    while True:
        impl.loop(args.trips)
        calls += 1
        if comm.allreduce(time.perf_counter() - start > args.seconds, op=MPI.LOR):
            break
    took = time.perf_counter() - start
    row = {"impl": args.impl, "bytes": 4 * n, "allreduces": calls * args.trips}
    row["us_per_allreduce"] = took / row["allreduces"] * 1e6
    if comm.Get_rank() == 0:
        print(
            f"{row['impl']} {row['bytes']} B: {row['allreduces']} allreduces, "
            f"{row['us_per_allreduce']:.1f} us each (dispatch included)",
            flush=True,
        )
    return row


if __name__ == "__main__":
    main()
