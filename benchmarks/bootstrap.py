"""Time jax.distributed.initialize(): JAX's own mpi4py method against mpi4jax_dist.

    python benchmarks/bootstrap.py --procs 2,4,8 --repeat 5 [--json PATH]

For each P, starts ``mpiexec -n P`` jobs alternating the two methods, ``--repeat``
of each. In every job MPI is initialized first (``from mpi4py import MPI``, timed as
"MPI init"); then ``jax.distributed.initialize()`` is timed on every rank and the
slowest rank counts. Reported: the median over jobs for each method, their ratio,
and mpi4jax_dist's phases (bootstrap done, rank 0's service listening, all
connected), measured from the start of initialize on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

METHODS = ("jax-mpi4py", "mpi4jax_dist")


def worker(method: str) -> None:
    """One MPI job: initialize JAX one way and print rank 0's summary as JSON."""
    t_start = time.perf_counter()
    import jax

    import mpi4jax_dist
    from mpi4jax_dist import _topology

    t_mpi0 = time.perf_counter()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    t_mpi1 = time.perf_counter()
    comm.Barrier()
    t0 = time.perf_counter()
    if method == "jax-mpi4py":
        jax.distributed.initialize(cluster_detection_method="mpi4py")
    else:
        jax.distributed.initialize()
    t1 = time.perf_counter()
    assert jax.process_index() == comm.rank and jax.process_count() == comm.size
    stamps = _topology.timestamps if method == "mpi4jax_dist" else {}
    row = {
        "mpi_init_s": t_mpi1 - t_mpi0,
        "init_s": t1 - t0,
        "bootstrap_s": stamps.get("bootstrap_done", t0) - t0,
        "listening_s": stamps.get("service_listening", t0) - t0,
        "import_s": t_mpi0 - t_start,
    }
    rows = comm.gather(row)
    if comm.rank == 0:
        print(
            "BOOTSTRAP "
            + json.dumps(
                {
                    "method": method,
                    "procs": comm.size,
                    "init_s": max(r["init_s"] for r in rows),
                    "mpi_init_s": max(r["mpi_init_s"] for r in rows),
                    "bootstrap_s": max(r["bootstrap_s"] for r in rows),
                    "listening_s": rows[0]["listening_s"],
                    "coordinator": (
                        mpi4jax_dist.topology().coordinator_address
                        if method == "mpi4jax_dist"
                        else None
                    ),
                }
            ),
            flush=True,
        )


def run_job(mpiexec: str, procs: int, method: str, timeout: float) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cmd = [
        mpiexec,
        "-n",
        str(procs),
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        method,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("BOOTSTRAP "):
            return json.loads(line[len("BOOTSTRAP ") :])
    raise RuntimeError(
        f"{' '.join(cmd)} exited {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="2,4,8", help="comma-separated P values")
    parser.add_argument("--repeat", type=int, default=5, help="jobs per method and P")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return []

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or sys.exit("no mpiexec found")
    print(
        f"# jax.distributed.initialize() wall, slowest rank, median of "
        f"{args.repeat} jobs per method (alternating); MPI already initialized"
    )
    print(
        "# mpi4jax_dist phases from the start of initialize on rank 0: bootstrap "
        "done (slowest rank), rank 0's service listening"
    )
    print(
        f"# {'P':>3} {'jax-mpi4py':>12} {'mpi4jax_dist':>13} {'ratio':>7} "
        f"{'bootstrap':>10} {'listening':>10} {'MPI init':>9}"
    )
    results = []
    for procs in [int(p) for p in args.procs.split(",")]:
        samples = {m: [] for m in METHODS}
        for _ in range(args.repeat):
            for method in METHODS:
                samples[method].append(run_job(mpiexec, procs, method, args.timeout))
        med = {
            m: {
                k: statistics.median(s[k] for s in samples[m])
                for k in ("init_s", "mpi_init_s", "bootstrap_s", "listening_s")
            }
            for m in METHODS
        }
        ours, theirs = med["mpi4jax_dist"], med["jax-mpi4py"]
        ratio = ours["init_s"] / theirs["init_s"]
        print(
            f"  {procs:>3} {theirs['init_s'] * 1e3:>9.1f} ms "
            f"{ours['init_s'] * 1e3:>10.1f} ms {ratio:>7.3f} "
            f"{ours['bootstrap_s'] * 1e3:>7.1f} ms "
            f"{ours['listening_s'] * 1e3:>7.1f} ms {ours['mpi_init_s'] * 1e3:>6.1f} ms",
            flush=True,
        )
        results.append(
            {
                "procs": procs,
                "jax_mpi4py_init_s": theirs["init_s"],
                "mpi4jax_dist_init_s": ours["init_s"],
                "ratio": ratio,
                "mpi4jax_dist_phases_s": {
                    k: ours[k] for k in ("bootstrap_s", "listening_s", "mpi_init_s")
                },
                "samples": samples,
            }
        )
    if args.json:
        import jax

        meta = {
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "jax": jax.__version__,
            "repeat": args.repeat,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
