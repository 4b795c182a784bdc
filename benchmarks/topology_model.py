"""JAX's topology exchange at 10^4 and 10^5 processes: a model fitted to
``benchmarks/coordinator_scale.py --exchange`` runs, and what a user can do about it.

Usage::

    python benchmarks/coordinator_scale.py --procs 512,1024,2048,4096 --waves 0 \\
        --exchange cuda:110 --repeat 3 --json cuda110.json
    python benchmarks/topology_model.py cuda110.json [more.json ...] \\
        [--gpus 10000,100000] [--json PATH]

The model, per platform's exchange of P processes, each with a local topology of
``L`` bytes::

    whole      = a * P + c * P^2 + b * payload
    put_gather = a' * P + c' * P^2
    payload    = P * L + P * global(P, L)  ~  P^2 (L + 3)

``payload`` is what rank 0's service must send: every local topology to process 0,
and the global one (all P, each behind a tag and its length) to every process. ``a``
is a cost per process (its requests), ``c`` one per pair of processes whatever the
bytes (each of P requests served while P connections are open; on the 2-core host
that ran the emulation, partly its P threads' contention), ``b`` one per byte sent.
They are fitted by least squares on the relative error, over every setting of every
file whose runs made one platform's exchange (a second platform's exchange in the
same run follows the first one's, whose keys the service still holds, and is not
used for the fit). ``put_gather`` is until process 0 holds every local topology
(what JAX's "local" timeout bounds); it moves only P * L bytes.

The package's own model (``mpi4jax_dist.launch.limits.TOPOLOGY_FIT``, behind the
timeouts ``initialize()`` sets and ``python -m mpi4jax_dist --procs N``) holds these
coefficients; a test refits them from the committed runs.

Then the scenarios (:data:`SCENARIOS`) for a job of N GPUs: one process per GPU or
one per node with all its GPUs, with and without ``JAX_PLATFORMS`` (without it, JAX
also starts its CPU backend, which exchanges a topology of its own, first). A GPU
process's local topology is an estimate
(``mpi4jax_dist.launch.limits.GPU_LOCAL_TOPOLOGY_BYTES``); the CPU client's was
measured.
Printed per scenario: the processes, the bytes through rank 0, the model's seconds
and a floor, the bytes at 25 GB/s (one 200 Gb/s NIC). The model comes from one
2-core host holding the service and every client, so it is an upper bound for a
real rank 0; the floor is a lower one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from mpi4jax_dist.launch import limits  # noqa: E402

#: Bytes per second of one 200 Gb/s NIC: the floor's rate.
NIC_BYTES_PER_S = 25e9

#: (name, GPUs per process, platforms' exchanges in order)
SCENARIOS = (
    ("1 per GPU, JAX_PLATFORMS unset", 1, ("cpu", "cuda")),
    ("1 per GPU, JAX_PLATFORMS=cuda", 1, ("cuda",)),
    ("1 per 4-GPU node, unset", 4, ("cpu", "cuda")),
    ("1 per 4-GPU node, =cuda", 4, ("cuda",)),
    ("1 per 8-GPU node, =cuda", 8, ("cuda",)),
)


def points(paths: list[str]) -> list[dict]:
    """One point per setting and platform of the files' ok rows: P, L, the median
    seconds (whole exchange, put + gather, fetch) and the peak memory."""
    found = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data["results"]:
            platforms = row.get("exchange_platforms") or []
            if not row.get("ok") or not platforms:
                continue
            runs = [r for r in row["runs"] if r.get("ok")]
            for position, platform in enumerate(platforms):

                def median(key: str, runs=runs, platform=platform) -> float:
                    return statistics.median(r[f"{platform}.{key}"] for r in runs)

                found.append(
                    {
                        "file": os.path.basename(path),
                        "procs": row["procs"],
                        "platform": platform,
                        "after": platforms[:position],
                        "local": row[f"{platform}.exchange_local_bytes"],
                        "runs": len(runs),
                        "whole_s": median("exchange_s"),
                        "put_gather_s": median("put_s") + median("gather_s"),
                        "fetch_s": median("fetch_s"),
                        "peak_mib": max(
                            r[f"{platform}.exchange_peak_mib"] or 0 for r in runs
                        ),
                    }
                )
    return found


UNITS = {"per_process_s": "s*P", "per_pair_s": "s*P^2", "per_byte_s": "s/B*payload"}
#: The terms each time is fitted with (the model's phases, as in _limits).
FITTED = {"whole": tuple(UNITS), "put_gather": tuple(UNITS)[:2]}


def fit(pts: list[dict], key: str) -> dict[str, float]:
    """The coefficients of ``key``'s terms (:data:`FITTED`) by least squares on the
    relative error (each equation divided by its measured time)."""
    names = FITTED[key]
    x = np.array(
        [[limits.exchange_terms(p["procs"], p["local"])[n] for n in names] for p in pts]
    )
    t = np.array([p[f"{key}_s"] for p in pts], float)
    coef, *_ = np.linalg.lstsq(x / t[:, None], np.ones(len(t)), rcond=None)
    return dict(zip(names, map(float, coef), strict=True))


def model_s(coef: dict[str, float], procs: int, local: int) -> float:
    values = limits.exchange_terms(procs, local)
    return sum(c * values[name] for name, c in coef.items())


def scenario(name: str, per_process: int, platforms, gpus: int, coefs) -> dict:
    """One job of ``gpus`` GPUs: its processes, and per platform's exchange (then
    summed) the bytes, the model's seconds and the floor."""
    procs = max(1, gpus // per_process)
    sizes = {
        "cpu": limits.CPU_LOCAL_TOPOLOGY_BYTES,
        "cuda": limits.gpu_local_topology_bytes(per_process),
    }
    row = {"scenario": name, "gpus": gpus, "procs": procs, "platforms": {}}
    for platform in platforms:
        local = sizes[platform]
        row["platforms"][platform] = {
            "local_bytes": local,
            "payload_bytes": limits.exchange_payload(procs, local),
            "whole_s": model_s(coefs["whole"], procs, local),
            "put_gather_s": model_s(coefs["put_gather"], procs, local),
        }
    parts = row["platforms"].values()
    row["payload_bytes"] = sum(p["payload_bytes"] for p in parts)
    row["whole_s"] = sum(p["whole_s"] for p in parts)
    row["floor_s"] = row["payload_bytes"] / NIC_BYTES_PER_S
    cuda = row["platforms"]["cuda"]
    limit = limits.GPU_TOPOLOGY_TIMEOUTS_MINUTES["global"]
    row["cuda_within_xla_limit"] = cuda["whole_s"] <= 60 * limit
    return row


POINTS = _harness.Table(
    [
        _harness.Column("file", "file", "", 34, left=True),
        _harness.Column("procs", "P", "", 5, "d"),
        _harness.Column("platform", "platform", "", 8, left=True),
        _harness.Column("local", "local", "B", 5, "d"),
        _harness.Column("whole_s", "whole", "median s", 8, ".3f"),
        _harness.Column("model_s", "model", "s", 8, ".3f"),
        _harness.Column("ratio", "ratio", "meas/mod", 8, ".2f"),
        _harness.Column("put_gather_s", "put+gath", "median s", 8, ".3f"),
        _harness.Column("fetch_s", "fetch", "median s", 8, ".3f"),
        _harness.Column("peak_mib", "peak RSS", "+MiB", 8, ".0f"),
    ]
)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


SCENARIO_TABLE = _harness.Table(
    [
        _harness.Column("scenario", "scenario", "", 31, left=True),
        _harness.Column("gpus", "GPUs", "", 6, "d"),
        _harness.Column("procs", "P", "", 6, "d"),
        _harness.Column("payload_gb", "rank 0", "GB sent", 8, ".1f"),
        _harness.Column("whole_s", "model", "min", 8, _minutes),
        _harness.Column("floor_s", "floor", "min", 7, _minutes),
        _harness.Column("cuda_min", "cuda", "model min", 9, _minutes),
        _harness.Column("fits", "cuda in", "XLA 5 min", 9, left=True),
    ]
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="coordinator_scale.py --json files")
    parser.add_argument(
        "--gpus", default="10000,100000", help="the jobs' GPU counts, comma-separated"
    )
    parser.add_argument("--json", help="write the fit and the scenarios here")
    args = parser.parse_args(argv)
    try:
        gpu_counts = [int(t) for t in args.gpus.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--gpus {args.gpus!r}: comma-separated integers")
    pts = points(args.files)
    alone = [p for p in pts if not p["after"]]
    if len(alone) < 2:
        parser.error(
            "the files hold fewer than 2 settings of a single platform's exchange: "
            "run coordinator_scale.py --exchange with 2 or more --procs values"
        )
    coefs = {key: fit(alone, key) for key in FITTED}
    for key, coef in coefs.items():
        print(
            f"# fit of {key} over {len(alone)} settings of one platform's exchange: "
            + " + ".join(f"{c:.3e} {UNITS[n]}" for n, c in coef.items())
        )
    print(
        "# every setting, medians over its runs; 'after': a platform exchanged "
        "first in the same run (not fitted)"
    )
    print(POINTS.header())
    for p in pts:
        p["model_s"] = model_s(coefs["whole"], p["procs"], p["local"])
        p["ratio"] = p["whole_s"] / p["model_s"]
        line = dict(p, platform=p["platform"] + ("*" if p["after"] else ""))
        print(POINTS.row(line))
    gpu = limits.GPU_LOCAL_TOPOLOGY_BYTES
    print(
        f"# jobs of N GPUs; local topologies: cpu {limits.CPU_LOCAL_TOPOLOGY_BYTES} B "
        f"(measured), cuda {gpu['process']} + {gpu['device']} B per GPU (estimated); "
        f"model: the fit above, an upper bound; floor: the bytes at "
        f"{NIC_BYTES_PER_S / 1e9:g} GB/s; XLA's GPU client allows "
        f"{limits.GPU_TOPOLOGY_TIMEOUTS_MINUTES['global']} min for the whole "
        "exchange, which JAX cannot change"
    )
    print(SCENARIO_TABLE.header())
    scenarios = []
    for gpus in gpu_counts:
        for name, per_process, platforms in SCENARIOS:
            row = scenario(name, per_process, platforms, gpus, coefs)
            scenarios.append(row)
            cuda = row["platforms"]["cuda"]
            line = dict(
                row,
                payload_gb=row["payload_bytes"] / 1e9,
                cuda_min=cuda["whole_s"],
                fits="yes" if row["cuda_within_xla_limit"] else "NO",
            )
            print(SCENARIO_TABLE.row(line))
    result = {
        "fit": coefs,
        "points": pts,
        "scenarios": scenarios,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": _harness.meta(files=args.files), "results": result}, f)
    return result


if __name__ == "__main__":
    main()
