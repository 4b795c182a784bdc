"""The topology-exchange model behind ``initialize()``'s timeouts and the
diagnostics (``mpi4jax_dist.launch.limits.TOPOLOGY_FIT``): it is the fit of the
committed emulation runs, and the fit finds known coefficients."""

import glob
import json

import pytest
import util

from mpi4jax_dist.launch import limits

pytestmark = util.skip_in_mpi_job

RUNS = sorted(glob.glob(str(util.ROOT / "docs" / "benchmarks" / "topology_exchange-*")))


def test_the_package_model_is_the_fit_of_the_committed_runs():
    model = util.load_benchmark("topology_model")
    assert RUNS, "no docs/benchmarks/topology_exchange-*.json"
    points = [p for p in model.points(RUNS) if not p["after"]]
    assert len(points) >= 20
    for phase, coefs in limits.TOPOLOGY_FIT.items():
        fitted = model.fit(points, phase)
        assert fitted.keys() == coefs.keys(), phase
        for name, value in coefs.items():
            # The package holds 4 significant figures.
            assert value == pytest.approx(fitted[name], rel=1e-3), (phase, name)


def test_the_fit_finds_known_coefficients_and_rejects_others():
    model = util.load_benchmark("topology_model")
    known = {"per_process_s": 1e-3, "per_pair_s": 2e-7, "per_byte_s": 3e-9}
    points = []
    for procs, local in [(64, 88), (512, 88), (4096, 88), (256, 600), (1024, 320)]:
        terms = limits.exchange_terms(procs, local)
        whole = sum(c * terms[n] for n, c in known.items())
        points.append({"procs": procs, "local": local, "whole_s": whole, "after": []})
    fitted = model.fit(points, "whole")
    assert fitted == pytest.approx(known, rel=1e-6)
    # One point measured 10 % slow moves the fit: it is not fixed in advance.
    points[2]["whole_s"] *= 1.1
    assert model.fit(points, "whole") != pytest.approx(known, rel=1e-3)


def test_payload_is_what_the_emulation_sends():
    """The model's bytes against a global topology the emulation builds, each local
    one framed as a protobuf field (its length's varint grows at 128 B)."""
    bench = util.load_benchmark("coordinator_scale")
    for procs, local in [(2, 69), (64, 88), (4096, 110), (100, 127), (100, 128)]:
        built = len(b"".join(bench.frame(bytes(local)) for _ in range(procs)))
        assert limits.global_topology_bytes(procs, local) == built
        assert limits.exchange_payload(procs, local) == procs * local + procs * built


def test_scenarios_one_process_per_node_and_jax_platforms_save():
    """The scenario table's arithmetic: JAX_PLATFORMS=cuda drops the CPU exchange,
    one process per 4-GPU node a quarter of the processes."""
    model = util.load_benchmark("topology_model")
    fit = limits.TOPOLOGY_FIT
    per_gpu, only_cuda, per_node = (
        model.scenario(name, per, platforms, 100_000, fit)
        for name, per, platforms in model.SCENARIOS[:3]
    )
    assert per_gpu["procs"] == only_cuda["procs"] == 100_000
    assert per_node["procs"] == 25_000
    cpu = per_gpu["platforms"]["cpu"]["whole_s"]
    assert per_gpu["whole_s"] == pytest.approx(only_cuda["whole_s"] + cpu)
    assert per_node["platforms"]["cuda"]["local_bytes"] == 40 + 4 * 70
    assert not only_cuda["cuda_within_xla_limit"]


def test_the_model_script_runs_on_the_committed_runs(tmp_path, capsys):
    model = util.load_benchmark("topology_model")
    out = tmp_path / "model.json"
    result = model.main([*RUNS, "--gpus", "10000,100000", "--json", str(out)])
    printed = capsys.readouterr().out
    assert (
        "# fit of whole over" in printed and "1 per GPU, JAX_PLATFORMS=cuda" in printed
    )
    assert len(result["scenarios"]) == 2 * len(model.SCENARIOS)
    saved = json.loads(out.read_text())
    assert saved["results"]["fit"] == result["fit"] and "versions" in saved["meta"]
    # At 10^5 GPUs one process per GPU does not fit XLA's 5 minutes by the model;
    # one per 8-GPU node does.
    at_1e5 = {s["scenario"]: s for s in result["scenarios"] if s["gpus"] == 100_000}
    assert not at_1e5["1 per GPU, JAX_PLATFORMS=cuda"]["cuda_within_xla_limit"]
    assert at_1e5["1 per 8-GPU node, =cuda"]["cuda_within_xla_limit"]
