"""The benchmarks run and report (tiny sizes; the figures are theirs to print)."""

import util

pytestmark = util.skip_in_mpi_job


def test_bootstrap_benchmark_reports_both_methods(tmp_path, capsys):
    bench = util.load_benchmark("bootstrap")
    out = tmp_path / "bootstrap.json"
    results = bench.main(
        ["--procs", "2", "--repeat", "1", "--timeout", "120", "--json", str(out)]
    )
    assert [r["procs"] for r in results] == [2]
    row = results[0]
    assert row["jax_mpi4py_init_s"] > 0 and row["mpi4jax_dist_init_s"] > 0
    assert set(row["mpi4jax_dist_phases_s"]) == {
        "bootstrap_s",
        "listening_s",
        "mpi_init_s",
    }
    assert out.exists()
    assert "jax-mpi4py" in capsys.readouterr().out
