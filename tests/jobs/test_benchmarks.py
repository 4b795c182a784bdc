"""The benchmarks run and report (tiny sizes; the figures are theirs to print)."""

import json
import re
import sys

import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.same_under_every_jax]


def test_bootstrap_benchmark_reports_every_method(tmp_path, capsys):
    bench = util.load_benchmark("bootstrap")
    out = tmp_path / "bootstrap.json"
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
    assert "mpi4jax_dist/single" in capsys.readouterr().out


def test_overlap_benchmark(tmp_path):
    """overlap.py's table (2 ranks, tiny). (Its settled microbenchmark's checks,
    the wait counters under a held reduction, are
    test_latency_interposer_holds_every_reduction_until_its_time's.)"""
    out = tmp_path / "overlap.json"
    proc = util.run_mpi(
        util.ROOT / "benchmarks" / "overlap.py",
        2,
        *("--grids", "16", "--delays", "0,40"),
        *("--variants", "single,pipelined_nb", "--iters", "5", "--samples", "1"),
        *("--json", str(out)),
        timeout=300,
    )
    rows = json.loads(out.read_text())["results"]
    cg_rows = [(r["mode"], r["delay_us"]) for r in rows]
    assert cg_rows == [("latency", 0), ("latency", 40)]
    held = [r for r in rows if r["delay_us"] == 40][0]
    assert held["single"] >= 40 and held["pipelined_nb"] > 0, held
    assert "cores of each rank" in proc.stdout


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and value == value and abs(value) < 1e300


def test_sr_benchmark_reports_every_route(tmp_path):
    """sr.py at a tiny size on 2 ranks: every route timed, its allreduces counted,
    its answer checked."""
    out = tmp_path / "sr.json"
    util.run_mpi(
        util.ROOT / "benchmarks" / "sr.py",
        2,
        *("--params", "64", "--walkers", "32", "--repeat", "1"),
        *("--variants", "classic,pipelined", "--json", str(out)),
        timeout=240,
    )
    saved = json.loads(out.read_text())
    assert "versions" in saved["meta"] and saved["meta"]["world_size"] == 2
    rows = saved["results"]
    routes = {r["route"]: r for r in rows if r["section"] == "routes"}
    assert set(routes) == {
        "jax.scipy",
        "dropin/classic",
        "dropin/pipelined",
        "solve_normal",
        "cholesky",
    }, routes
    for row in routes.values():
        assert _finite(row["t_solve_s"]) and row["t_solve_s"] > 0, row
        assert row["allreduces"] > 0 and row["bytes_per_solve"] > 0, row
        assert _finite(row["rel_residual"]) and _finite(row["diff_vs_a"]), row
    assert routes["cholesky"]["allreduces"] == 1
    assert routes["cholesky"]["bytes_per_allreduce"] == 8 * 64 * 64
    # The drop-in (classic) iterates as jax.scipy's cg; one allreduce per iteration.
    a, b = routes["jax.scipy"], routes["dropin/classic"]
    assert a["iterations"] == b["iterations"] > 0
    assert b["allreduces_loop"] == b["iterations"] == a["allreduces_loop"]


def test_sr_step_example_matches_jax_scipy():
    """examples/sr_step.py on 2 ranks: the drop-in's update is jax.scipy's."""
    proc = util.run_mpi(util.ROOT / "examples" / "sr_step.py", 2, timeout=120)
    # Searched anywhere in a line, not at its start, and each up to the next rank's
    # line: mpiexec forwards each rank's stdout as it reads it, so one rank's line
    # can follow another's unfinished output (Gloo's "[Gloo] Rank 0 is connected
    # ..." on the same line), and in a clean-clone CI run rank 0's line followed
    # rank 1's before its newline.
    lines = re.findall(r"rank \d+/2: .*?(?=rank \d+/2: |\n|$)", proc.stdout)
    ranks = sorted(line.split("/")[0] for line in lines)
    assert ranks == ["rank 0", "rank 1"], proc.stdout + proc.stderr
    for line in lines:
        assert "converged True" in line, proc.stdout
        assert float(line.rsplit("= ", 1)[1]) < 1e-8, proc.stdout


def test_allreduce_table_alone_on_stdout():
    """The main job's stdout: its table, with no ``[Gloo] Rank N is connected``
    line from jaxlib (sent to stderr) in it; psum's rows make Gloo connect."""
    proc = util.run_mpi(
        util.ROOT / "benchmarks" / "allreduce.py",
        2,
        "--sizes",
        "4",
        "--impls",
        "mpi4py,psum,mpi4jax",
        "--samples",
        "2",
        "--iters",
        "3",
        "--loop-iters",
        "3",
    )
    assert "[Gloo]" in proc.stderr, proc.stderr[-2000:]  # they were printed
    assert "[Gloo]" not in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    # As HPC users read a table: within 120 columns, one row per size and
    # implementation, the loop's table first and the call's after it, each under
    # its title.
    assert max(map(len, lines)) <= 120, proc.stdout
    tables = {
        line.split(":")[0][2:]: index
        for index, line in enumerate(lines)
        if line.startswith(("# loop:", "# call:"))
    }
    assert list(tables) == ["loop", "call"], proc.stdout
    rows = [line.split()[:2] for line in lines if line.startswith("  ")]
    assert rows == [["4", name] for name in ("mpi4py", "mpi4jax", "psum")] * 2
    call_rows = [line for line in lines[tables["call"] :] if line.startswith("  ")]
    assert len(call_rows) == 3, proc.stdout
    assert any(line.startswith("# wrong values: 0 of ") for line in lines)
    # mpi4jax's warning about a newer JAX, said once in the header instead of as
    # a warning per rank (under JAX 0.12 and mpi4jax 0.9.1 it warns).
    assert "latest supported JAX version" not in proc.stderr, proc.stderr[-2000:]


def test_latency_interposer_holds_every_reduction_until_its_time():
    """The benchmarks' PMPI interposer (benchmarks/pmpi_latency.c, preloaded by
    benchmarks/_latency.py): a blocking allreduce takes the delay; a non-blocking
    one tests incomplete before it and its wait returns after it; the package's
    iallreduce, jitted and eagerly, is held alike and reduces right; the
    extension's wait counters see the hold (slack: the work between post and
    wait; blocked: the rest of the delay); at delay 0 nothing is held. (A lower
    bound only: how much an overlap hides is benchmarks/overlap.py's figure.)"""
    proc = util.run_command(
        [sys.executable, str(util.ROOT / "tests" / "scripts" / "latency_held.py")],
        env=util.clean_env(MPI4JAX_NO_WARN_JAX_VERSION="1"),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in proc.stdout.splitlines()
        if line[:1].isupper()
    }
    assert got["ALLREDUCE"][0] >= 0.030, got
    early, waited = got["IALLREDUCE"]
    assert early == 0 and waited >= 0.030, got
    for name in ("JIT", "EAGER"):
        took, right = got[name]
        assert took >= 0.030 and right == 1, got
    waits, done, slack_ms, blocked_ms = got["WAIT0"]
    assert waits == 1 and done == 1 and slack_ms >= 20 and blocked_ms == 0, got
    waits, done, slack_ms, blocked_ms = got["WAIT60"]
    assert waits == 1 and done == 0 and 20 <= slack_ms < 60, got
    # The wait held the result for the rest of the 60 ms (less its first
    # MPI_Test, counted in neither), and no longer than a loaded machine's
    # scheduling slack past them.
    assert 59 <= slack_ms + blocked_ms < 60 + 200, got
    assert got["AFTER"][0] < 0.030, got


def test_loop_fit_stays_sane_under_random_load():
    """The loop rows' fit on loops of known cost (``fixed + k * trip``, 2 %
    noise) where a random third of the samples is slowed by up to tens of ms, as
    a busy machine slows them: over 200 runs of 10 rounds at K and 2K trips, the
    median time per trip stays within 10 % of the truth in 8 runs of 10 or more,
    and no time or fixed part is negative; the difference of each round's two
    samples goes negative in most runs. A fixed part a third of the loop is
    resolved in 2 runs of 5 or more, then within 10 % of a loop of the truth in 9
    of 10; a loop without one is said to have one in 1 run of 20 at most."""
    import random

    harness = util.load_benchmark("allreduce")._harness
    draw = random.Random(42)

    def samples(fixed, trip, k):
        out = []
        for _ in range(10):
            t = fixed + k * trip * (1 + draw.gauss(0, 0.02))
            if draw.random() < 1 / 3:
                t += draw.expovariate(1 / 0.005)
            out.append(t)
        return out

    for fixed, trip, k in ((500e-6, 2e-6, 500), (0.0, 2e-6, 500), (50e-6, 3e-4, 50)):
        close = negative_before = resolved = near = 0
        for _ in range(200):
            short, long = samples(fixed, trip, k), samples(fixed, trip, 2 * k)
            fit = harness.fit_trips({k: short, 2 * k: long})
            row = harness.summary(fit.per_trip)
            assert 0 < row["t_min_s"] <= row["t_median_s"] <= row["t_max_s"]
            close += abs(row["t_median_s"] / trip - 1) < 0.10
            negative_before += min(b - a for a, b in zip(short, long, strict=True)) < 0
            if fit.fixed is None:
                assert fit.fixed_at_most >= 0
            else:
                resolved += 1
                assert fit.fixed > 0 and fit.fixed_at_most is None
                near += abs(fit.fixed - fixed) < 0.1 * trip * k
        # with this seed: 170, 179 and 198 close; resolved in 103 (96 near),
        # 3 and 7 runs; negative before in 183, 186 and 29
        assert close >= 160, (fixed, trip, k, close)
        if trip * k < 0.005:  # loops shorter than the slowing
            assert negative_before > 150, negative_before
        if fixed == 0:
            assert resolved <= 10, resolved  # a fixed part claimed where none is
        elif fixed > 0.1 * trip * k:
            assert resolved >= 80 and near >= 0.9 * resolved, (resolved, near)
    # One sample per trip count (--samples 1): an estimate, never resolved.
    fit = harness.fit_trips({5: [0.030 + 5 * 0.002], 10: [0.030 + 10 * 0.002]})
    assert fit.fixed is None and fit.fixed_at_most == pytest.approx(0.030)
    assert [round(t, 6) for t in fit.per_trip] == [0.002, 0.002]
