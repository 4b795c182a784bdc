"""Time jax.distributed.initialize(): JAX's own mpi4py method against mpi4jax_dist.

    python benchmarks/bootstrap.py [--procs 2,4,8] [--repeat 5]
        [--methods jax-mpi4py,mpi4jax_dist/multiple,...] [--json PATH]

For each P, starts ``mpiexec -n P`` jobs, ``--repeat`` of each method, round-robin
(a drifting load touches every method alike): ``jax-mpi4py``
(``cluster_detection_method="mpi4py"``) and ``mpi4jax_dist/<level>``, this package's
at each MPI thread level (``MPI4PY_RC_THREAD_LEVEL``). In every job MPI starts first
(timed as "MPI init"), then ``jax.distributed.initialize()`` is timed on every rank
after a barrier, the slowest rank counting: per P and method the median and worst
job, the ratio to ``jax-mpi4py`` and this package's phases (docs/benchmarks-scale.rst,
*jax.distributed.initialize()*).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

LEVELS = ("multiple", "serialized", "funneled", "single")
PHASES = ("init_s", "bootstrap_s", "listening_s", "released_s", "mpi_init_s")

METHODS = _harness.Registry("initialization method")
METHODS.register("jax-mpi4py", {"detection": "mpi4py", "level": "multiple"})
for _level in LEVELS:
    METHODS.register(f"mpi4jax_dist/{_level}", {"detection": None, "level": _level})


def worker(method: str) -> None:
    """One MPI job: initialize JAX one way; rank 0 prints the slowest ranks' times."""
    import jax

    import mpi4jax_dist
    from mpi4jax_dist.launch import bootstrap

    t_mpi0 = time.perf_counter()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    t_mpi1 = time.perf_counter()
    comm.Barrier()
    t0 = time.perf_counter()
    detection = METHODS[method]["detection"]
    if detection:
        jax.distributed.initialize(cluster_detection_method=detection)
    else:
        jax.distributed.initialize()
    t1 = time.perf_counter()
    assert jax.process_index() == comm.rank and jax.process_count() == comm.size
    current = None if detection else bootstrap.current()
    stamps = current.timestamps if current else {}

    def since(name):
        return stamps[name] - t0 if name in stamps else None

    mine = {
        "init_s": t1 - t0,
        "mpi_init_s": t_mpi1 - t_mpi0,
        "bootstrap_s": since("bootstrap_done"),
        "listening_s": since("service_listening"),
        "released_s": since("released"),
    }
    rows = comm.gather(mine)
    if comm.rank == 0:

        def slowest(key):
            values = [r[key] for r in rows if r[key] is not None]
            return max(values) if values else None

        _harness.report(
            method=method,
            procs=comm.size,
            thread_level=MPI.Query_thread(),
            release=current.release_mode if current else None,
            coordinator=(
                mpi4jax_dist.topology().coordinator_address if current else None
            ),
            listening_s=rows[0]["listening_s"],
            **{k: slowest(k) for k in PHASES if k != "listening_s"},
        )


def _seconds(value) -> str:
    return f"{value * 1e3:.1f} ms"


TABLE = _harness.Table(
    [
        _harness.Column("procs", "P", "", 3, "d"),
        _harness.Column("method", "method", "", 24, left=True),
        _harness.Column("release", "release", "", 7),
        _harness.Column("init_s", "init", "median", 10, _seconds),
        _harness.Column("init_max_s", "init", "worst job", 10, _seconds),
        _harness.Column("ratio", "ratio", "to JAX's", 8, ".3f"),
        _harness.Column("bootstrap_s", "bootstrap", "done", 10, _seconds),
        _harness.Column("listening_s", "listening", "rank 0", 10, _seconds),
        _harness.Column("released_s", "released", "others", 10, _seconds),
        _harness.Column("mpi_init_s", "MPI init", "before", 10, _seconds),
    ]
)


def main(argv=None) -> list[dict]:
    """Run the jobs; return one row per P and method (medians over jobs)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--procs", type=_harness.ints, default="2,4,8", help="comma-separated P values"
    )
    parser.add_argument("--repeat", type=int, default=5, help="jobs per method and P")
    METHODS.option(parser, "--methods")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    args = _harness.parse_or_work(parser, argv, worker)
    if args is None:
        return []
    methods = args.methods

    print(
        f"# jax.distributed.initialize(), slowest rank, median of {args.repeat} jobs "
        f"per method (round-robin); MPI initialized before"
    )
    print(
        "# mpi4jax_dist's phases from the start of initialize: bootstrap done "
        "(slowest rank), rank 0's service listening, the others released (slowest)"
    )
    print(TABLE.header(), flush=True)
    results = []
    for procs in args.procs:
        samples: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(args.repeat):
            for method in methods:
                env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL=METHODS[method]["level"])
                job = _harness.run_job(
                    procs,
                    [os.path.abspath(__file__), "--worker", method],
                    timeout=args.timeout,
                    env=env,
                )
                if not job.ok or not job.results:
                    sys.exit(
                        f"{method} at P={procs} failed (exit {job.returncode}):\n"
                        f"{job.tail}"
                    )
                samples[method].append(job.results[0])
        theirs = samples.get("jax-mpi4py")
        base = statistics.median(s["init_s"] for s in theirs) if theirs else None
        for method in methods:
            jobs = samples[method]
            row = {"procs": procs, "method": method, "release": jobs[0]["release"]}
            for key in PHASES:
                values = [j[key] for j in jobs if j[key] is not None]
                row[key] = statistics.median(values) if values else None
            # The median hides a bimodal method (JAX's, when a client loses the race
            # to the service): the worst job shows it.
            row["init_max_s"] = max(j["init_s"] for j in jobs)
            row["ratio"] = None if base is None else row["init_s"] / base
            row["jobs"] = jobs
            results.append(row)
            print(TABLE.row(row), flush=True)
    _harness.save(args, _harness.meta(repeat=args.repeat), results)
    return results


if __name__ == "__main__":
    main()
