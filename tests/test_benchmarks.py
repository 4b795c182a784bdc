"""The benchmarks run and report (tiny sizes; the figures are theirs to print)."""

import json

import util

pytestmark = util.skip_in_mpi_job


def test_bootstrap_benchmark_reports_every_method(tmp_path, capsys):
    bench = util.load_benchmark("bootstrap")
    out, png = tmp_path / "bootstrap.json", tmp_path / "bootstrap.png"
    methods = ["jax-mpi4py", "mpi4jax_dist/multiple", "mpi4jax_dist/single"]
    results = bench.main(
        [
            "--procs",
            "2",
            "--repeat",
            "1",
            "--methods",
            ",".join(methods),
            "--timeout",
            "120",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert [(r["procs"], r["method"]) for r in results] == [(2, m) for m in methods]
    rows = {r["method"]: r for r in results}
    assert all(r["init_s"] > 0 for r in results)
    assert rows["jax-mpi4py"]["ratio"] == 1.0
    # The release the run reports is the one each thread level must get.
    assert rows["mpi4jax_dist/multiple"]["release"] == "thread"
    assert rows["mpi4jax_dist/single"]["release"] == "probe"
    for method in methods[1:]:
        assert 0 < rows[method]["bootstrap_s"] <= rows[method]["init_s"]
        assert rows[method]["released_s"] > 0
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 3 and "versions" in saved["meta"]
    assert png.stat().st_size > 0
    assert "mpi4jax_dist/single" in capsys.readouterr().out
