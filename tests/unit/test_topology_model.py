"""The topology-exchange model behind ``initialize()``'s timeouts and the
diagnostics (``mpi4jax_dist.launch.limits.TOPOLOGY_FIT``): it is the fit of the
committed emulation runs (``coordinator_scale.py --exchange``, retired; in
docs/benchmarks-scale.rst), and the fit finds known coefficients."""

import glob
import json
import statistics

import numpy as np
import pytest
import util

from mpi4jax_dist.launch import limits

pytestmark = util.skip_in_mpi_job

RUNS = sorted(glob.glob(str(util.ROOT / "docs" / "benchmarks" / "topology_exchange-*")))
#: The terms each phase is fitted with (the phases of ``limits.TOPOLOGY_FIT``).
FITTED = {
    "whole": ("per_process_s", "per_pair_s", "per_byte_s"),
    "put_gather": ("per_process_s", "per_pair_s"),
}


def points(paths: list[str]) -> list[dict]:
    """One point per setting of the runs, their first platform's exchange (a second
    one's follows it while the service still holds the first's keys, and is not
    fitted): P, L and the median seconds."""
    found = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["results"]
        for row in rows:
            if not row.get("ok") or not row.get("exchange_platforms"):
                continue
            platform = row["exchange_platforms"][0]
            runs = [r for r in row["runs"] if r.get("ok")]

            def median(key: str, runs=runs, platform=platform) -> float:
                return statistics.median(r[f"{platform}.{key}"] for r in runs)

            found.append(
                {
                    "procs": row["procs"],
                    "local": row[f"{platform}.exchange_local_bytes"],
                    "whole_s": median("exchange_s"),
                    "put_gather_s": median("put_s") + median("gather_s"),
                }
            )
    return found


def fit(pts: list[dict], key: str) -> dict[str, float]:
    """The coefficients of ``key``'s terms by least squares on the relative error
    (each equation divided by its measured time)."""
    names = FITTED[key]
    x = np.array(
        [[limits.exchange_terms(p["procs"], p["local"])[n] for n in names] for p in pts]
    )
    t = np.array([p[f"{key}_s"] for p in pts], float)
    coef, *_ = np.linalg.lstsq(x / t[:, None], np.ones(len(t)), rcond=None)
    return dict(zip(names, map(float, coef), strict=True))


def test_the_package_model_is_the_fit_of_the_committed_runs():
    assert RUNS, "no docs/benchmarks/topology_exchange-*.json"
    points_ = points(RUNS)
    assert len(points_) >= 20
    for phase, coefs in limits.TOPOLOGY_FIT.items():
        fitted = fit(points_, phase)
        assert fitted.keys() == coefs.keys(), phase
        for name, value in coefs.items():
            # The package holds 4 significant figures.
            assert value == pytest.approx(fitted[name], rel=1e-3), (phase, name)


def test_the_fit_finds_known_coefficients_and_rejects_others():
    known = {"per_process_s": 1e-3, "per_pair_s": 2e-7, "per_byte_s": 3e-9}
    pts = []
    for procs, local in [(64, 88), (512, 88), (4096, 88), (256, 600), (1024, 320)]:
        terms = limits.exchange_terms(procs, local)
        whole = sum(c * terms[n] for n, c in known.items())
        pts.append({"procs": procs, "local": local, "whole_s": whole})
    fitted = fit(pts, "whole")
    assert fitted == pytest.approx(known, rel=1e-6)
    # One point measured 10 % slow moves the fit: it is not fixed in advance.
    pts[2]["whole_s"] *= 1.1
    assert fit(pts, "whole") != pytest.approx(known, rel=1e-3)


def test_payload_is_what_the_emulation_sends():
    """The model's bytes against a global topology the emulation builds, each local
    one framed as a protobuf field (its length's varint grows at 128 B)."""
    for procs, local in [(2, 69), (64, 88), (4096, 110), (100, 127), (100, 128)]:
        built = len(b"".join(frame(bytes(local)) for _ in range(procs)))
        assert limits.global_topology_bytes(procs, local) == built
        assert limits.exchange_payload(procs, local) == procs * local + procs * built


def frame(value: bytes) -> bytes:
    """``value`` as one ``nodes`` entry (field 1) of a GlobalTopologyProto, as the
    emulation (``coordinator_scale.py --exchange``) built it."""
    n, length = len(value), bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return b"\x0a" + bytes(length) + value
