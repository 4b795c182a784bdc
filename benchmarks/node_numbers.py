"""Node numbers two ways: a ``Split`` of the node leaders against an exclusive scan
and an allreduce of "I lead a node" flags (what the bootstrap does).

    mpiexec -n P python benchmarks/node_numbers.py [--samples 100] [--json PATH]

Both give each node leader (local rank 0 of ``Split_type(COMM_TYPE_SHARED)``) its
node's index, in order of lowest rank, and the node count. MPICH's ``Comm_split``
allgathers every rank's (color, key): O(P) bytes per rank; the scan and the
allreduce are O(log P) with 8 bytes per rank, posted together. Each sample is one
call after a barrier, the slowest rank's time; the two ways alternate, round-robin.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leader = node.rank == 0
    answers = {}

    def by_split():
        leaders = comm.Split(0 if leader else MPI.UNDEFINED, key=comm.rank)
        if leaders:
            answers["split"] = (leaders.rank, leaders.size)
            leaders.Free()

    def by_scan():
        flag = np.array([1 if leader else 0], dtype=np.int64)
        below = np.zeros(1, dtype=np.int64)
        count = np.zeros(1, dtype=np.int64)
        MPI.Request.Waitall(
            [
                comm.Iexscan(flag, below, op=MPI.SUM),
                comm.Iallreduce(flag, count, op=MPI.SUM),
            ]
        )
        if leader:
            answers["scan"] = (0 if comm.rank == 0 else int(below[0]), int(count[0]))

    times = _harness.time_rounds([by_split, by_scan], comm, args.samples)
    agree = comm.allreduce(answers.get("split") == answers.get("scan"), op=MPI.LAND)
    rows = [
        {"way": way, "procs": comm.size, **_harness.summary(samples)}
        for way, samples in zip(("split", "scan+allreduce"), times, strict=True)
    ]
    nodes = comm.allreduce(1 if leader else 0)
    _harness.say(
        comm,
        f"# P={comm.size} on {nodes} node(s); median of {args.samples} samples, "
        f"slowest rank; same node numbers: {agree}",
        *(f"  {r['way']:<16} {r['t_median_s'] * 1e6:10.1f} us" for r in rows),
    )
    _harness.save(args, _harness.meta(), rows, comm=comm)
    if not agree:
        sys.exit("WRONG: the two ways gave different node numbers")
    return rows


if __name__ == "__main__":
    main()
