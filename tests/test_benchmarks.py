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


def test_overlap_benchmark_and_scale_model(tmp_path, capsys):
    """overlap.py's tables (2 ranks, tiny), and the scale model read from them."""
    out = tmp_path / "overlap.json"
    proc = util.run_mpi(
        util.ROOT / "benchmarks" / "overlap.py",
        2,
        *("--grids", "16", "--delays", "0,40", "--mode", "latency,rank1"),
        *("--variants", "single,pipelined_nb", "--iters", "5", "--samples", "1"),
        *("--micro-iters", "5", "--micro-latencies", "0,40", "--json", str(out)),
        timeout=300,
    )
    rows = json.loads(out.read_text())["results"]
    micro = [r for r in rows if r.get("micro")]
    assert [r["latency_us"] for r in micro] == [0, 40], rows
    # A reduction held 40 us takes at least that; the counters saw every wait.
    assert micro[1]["reduce_us"] >= 40 and 0 <= micro[1]["done_before_wait"] <= 1
    cg_rows = [(r["mode"], r["delay_us"]) for r in rows if "mode" in r]
    assert cg_rows == [("latency", 0), ("latency", 40), ("rank1", 0), ("rank1", 40)]
    held = [r for r in rows if r.get("mode") == "latency" and r["delay_us"] == 40][0]
    assert held["single"] >= 40 and held["pipelined_nb"] > 0, held
    # pipelined_nb's waits, counted: the work between post and wait, and the wait
    # for the rest of the 40 us (less each wait's first MPI_Test).
    waits = held["pipelined_nb_waits"]
    assert waits["slack_us"] > 0 and waits["slack_us"] + waits["blocked_us"] >= 39
    # The progress table: the matvec, the local stencil, and it with a test.
    progress = [r for r in rows if r.get("progress")]
    assert [r["work"] for r in progress] == ["matvec", "stencil", "stencil+test"]
    assert [r["test_done"] is None for r in progress] == [True, True, False]
    assert "cores of each rank" in proc.stdout
    model = util.load_benchmark("scale_model").main([str(out), "--procs", "1000"])
    checked = [r for r in model if "measured_us" in r]
    assert {(r["variant"], r["latency_us"]) for r in checked} == {
        ("single", 40),
        ("pipelined_nb", 40),
    }
    predicted = [r for r in model if "procs" in r]
    assert len(predicted) == 2 and all(r["single"] > 0 for r in predicted)
    assert "Graham et al." in capsys.readouterr().out


def test_iallreduce_copies_benchmark_prints_one_row_per_size():
    proc = util.run_mpi(
        util.ROOT / "benchmarks" / "iallreduce_copies.py",
        2,
        *("--sizes", "4,64KiB", "--samples", "2"),
        timeout=180,
    )
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1] == " "]
    rows = [r for r in rows if r[0].isdigit()]
    assert [r[0] for r in rows] == ["4", "65536"], proc.stdout
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), proc.stdout
