"""What the benchmarks share: timing across ranks, statistics, memory, provenance.

Every figure is a set of samples; per sample the slowest rank counts (a collective
is as slow as its last rank), and samples are summarized by min, median and max.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np


def slowest(samples, comm) -> list[float]:
    """Return, per sample, the largest time over the ranks of ``comm``."""
    from mpi4py import MPI

    local = np.asarray(samples, dtype=np.float64)
    out = np.empty_like(local)
    comm.Allreduce(local, out, op=MPI.MAX)
    return out.tolist()


def summary(samples) -> dict:
    """Return ``t_min_s``, ``t_median_s``, ``t_max_s`` of ``samples`` (seconds)."""
    return {
        "t_min_s": min(samples),
        "t_median_s": statistics.median(samples),
        "t_max_s": max(samples),
    }


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) on Linux; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int, int]:
    """Return ``(current, peak)`` resident set size of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def commit() -> str | None:
    """Return the git commit of this checkout (with ``-dirty``), or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sha.stdout.strip() or None


def meta(comm, **extra) -> dict:
    """Return provenance: machine, MPI, versions, backend, devices, commit, UTC time."""
    import jax
    from mpi4py import MPI

    import mpi4jax_dist
    from mpi4jax_dist import _diagnose

    topo = mpi4jax_dist.topology()
    info = {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "mpi_vendor": "{} {}".format(
            MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))
        ),
        "mpi_library": _diagnose.mpi_library(),
        "world_size": comm.Get_size(),
        "num_nodes": topo.num_nodes,
        "versions": _diagnose.versions(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_collectives": getattr(
            jax.config, "jax_cpu_collectives_implementation", None
        ),
    }
    info.update(extra)
    return info


def write_json(path: str, meta_: dict, results: list[dict]) -> None:
    """Write ``{"meta": ..., "results": [...]}`` to ``path``."""
    with open(path, "w") as f:
        json.dump({"meta": meta_, "results": results}, f, indent=1)


def human_bytes(n: int) -> str:
    """Return ``n`` bytes as ``4 B``, ``16 KiB``, ``64 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"
