"""What an idle rank costs: each thread's wake-ups and CPU time per minute while the
program sleeps, in a bootstrapped job (Linux: read from /proc).

    mpiexec -n 2 python tests/scripts/idle.py [--seconds 60] [--json PATH]

The instrument of tests/jobs/test_hangs.py's watchdog test, and of the figure in
docs/benchmarks-scale.rst, *What the fault handling costs* (a settled question, so
it left benchmarks/).

Run it with and without ``MPI4JAX_DIST_COLLECTIVE_TIMEOUT`` or
``MPI4JAX_DIST_HANG_TIMEOUT`` to see what the package's watchdog adds. Every rank
initializes JAX through mpi4jax_dist, makes one ``mpi4jax_dist.allreduce`` (which
loads the compiled ops and, with a timeout set, starts the watchdog), then sleeps
``--seconds``; each thread's voluntary context switches (each one a sleep that
ended: a wake-up) and its CPU time over the sleep are counted. Rank 0 prints one
row per thread name (summed over the threads of that name, the median over ranks),
then the whole process's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def threads() -> dict[int, dict]:
    """This process's threads now: name, wake-ups so far, CPU seconds so far."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            with open(f"{base}/stat") as f:
                # Fields after the name in parentheses: utime and stime are the
                # 14th and 15th of the line (man 5 proc).
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/status") as f:
                pairs = (line.split(":") for line in f if "ctxt_switches" in line)
                switches = {key: int(value) for key, value in pairs}
        except OSError:  # ended meanwhile
            continue
        found[int(tid)] = {
            "name": names.get(int(tid), comm),
            "wakeups": switches["voluntary_ctxt_switches"],
            "cpu_s": (int(fields[11]) + int(fields[12])) * TICK_S,
        }
    return found


def idle_cost(seconds: float) -> dict[str, dict]:
    """Per thread name: wake-ups and CPU milliseconds per minute over a sleep."""
    before = threads()
    time.sleep(seconds)
    after = threads()
    per_name: dict[str, dict] = {}
    for tid, now in after.items():
        was = before.get(tid, {"wakeups": 0, "cpu_s": 0.0})
        empty = {"threads": 0, "wakeups": 0, "cpu_s": 0.0}
        row = per_name.setdefault(now["name"], empty)
        row["threads"] += 1
        row["wakeups"] += now["wakeups"] - was["wakeups"]
        row["cpu_s"] += now["cpu_s"] - was["cpu_s"]
    scale = 60.0 / seconds
    return {
        name: {
            "threads": row["threads"],
            "wakeups_per_min": row["wakeups"] * scale,
            "cpu_ms_per_min": row["cpu_s"] * 1e3 * scale,
        }
        for name, row in per_name.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--json", help="write the rows to this file (rank 0)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    import mpi4jax_dist

    jax.distributed.initialize()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    jax.block_until_ready(jax.jit(mpi4jax_dist.allreduce)(jnp.ones(4)))
    comm.Barrier()
    rows = comm.gather(idle_cost(args.seconds), root=0)
    if comm.rank != 0:
        return
    settings = {
        name: os.environ.get(name, "unset")
        for name in ("MPI4JAX_DIST_COLLECTIVE_TIMEOUT", "MPI4JAX_DIST_HANG_TIMEOUT")
    }
    names = sorted({name for ranks in rows for name in ranks})
    table = {}
    for name in names:
        present = [r[name] for r in rows if name in r]
        table[name] = {
            key: statistics.median(p[key] for p in present)
            for key in ("threads", "wakeups_per_min", "cpu_ms_per_min")
        }
    total = {
        key: statistics.median(sum(r[n][key] for n in r) for r in rows)
        for key in ("threads", "wakeups_per_min", "cpu_ms_per_min")
    }
    print(
        f"idle {args.seconds:g} s, {comm.size} ranks, "
        + ", ".join(f"{k}={v}" for k, v in settings.items())
        + " (median over ranks; CPU in clock ticks of "
        + f"{TICK_S * 1e3:g} ms)"
    )
    print(f"{'thread':<32} {'n':>3} {'wake-ups/min':>13} {'CPU ms/min':>11}")
    for name, row in sorted(table.items(), key=lambda kv: -kv[1]["wakeups_per_min"]):
        print(
            f"{name:<32} {row['threads']:>3g} {row['wakeups_per_min']:>13.0f} "
            f"{row['cpu_ms_per_min']:>11.1f}"
        )
    print(
        f"{'(whole process)':<32} {total['threads']:>3g} "
        f"{total['wakeups_per_min']:>13.0f} {total['cpu_ms_per_min']:>11.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "seconds": args.seconds,
                    "ranks": comm.size,
                    "settings": settings,
                    "versions": {"jax": jax.__version__},
                    "threads": table,
                    "process": total,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
