"""benchmarks/memory.py: one fresh job per case, the same rows in any order, a
failed case is a row, not the end of the run, and mpi4jax_dist's cases are in
place (small sizes only: the 256 MiB to 2^31-element figures are the README's)."""

import argparse
import json

import numpy as np
import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.same_under_every_jax]


@pytest.fixture(scope="module")
def memory():
    return util.load_benchmark("memory")


def test_rows_do_not_depend_on_order(memory, tmp_path):
    rows = {}
    for order in ("default", "reversed"):
        path = tmp_path / f"{order}.json"
        found = memory.main(
            [
                "--sizes",
                "1MiB",
                "--impls",
                "mpi4py,mpi4jax",
                "--order",
                order,
                "--timeout",
                "120",
                "--json",
                str(path),
            ]
        )
        assert path.exists()
        rows[order] = {(r["impl"], r["bytes"]): r for r in found}
        for row in found:
            assert row["status"] == "ok", row
            assert row["wrong"] == 0 and row["compiles"] == 0
            assert row["peak_reset"] and row["measure"] == "rss"
            assert isinstance(row["rise_x"], float) and row["rise_x"] >= 0
            assert row["t_call_s"] > 0
    assert (
        set(rows["default"])
        == set(rows["reversed"])
        == {
            ("mpi4py", 1 << 20),
            ("mpi4jax", 1 << 20),
        }
    )


def test_in_place_forms_against_mpi4jax(memory, tmp_path):
    """Donated, mpi4jax_dist reduces its input's buffer; on an intermediate it
    reduces the result's buffer, which holds ``x + z``; mpi4jax holds ``x + z``
    beside its result. 4 MiB: one MPI call (scratch half a message for 2 ranks)."""
    path = tmp_path / "forms.json"
    found = memory.main(
        ["--sizes", "4MiB", "--impls", "mpi4jax_dist,mpi4jax_dist_tmp,mpi4jax_tmp"]
        + ["--json", str(path)]
    )
    rows = {r["impl"]: r for r in found}
    for row in found:
        assert row["status"] == "ok" and row["compiles"] == 0, row
    for name in ("mpi4jax_dist", "mpi4jax_dist_tmp"):
        assert rows[name]["in_place"] == "yes", rows[name]
        assert rows[name]["xla_temp_x"] == 0, rows[name]
        assert rows[name]["handler_stats"]["handler_calls"] == 1, rows[name]
    assert rows["mpi4jax_tmp"]["in_place"] is None
    # The check can fail: the same analysis sees mpi4jax's temporary.
    assert rows["mpi4jax_tmp"]["xla_temp_x"] >= 1, rows["mpi4jax_tmp"]
    rise = {name: row["rise_x"] for name, row in rows.items()}
    assert rise["mpi4jax_dist"] + 0.5 < rise["mpi4jax_dist_tmp"], rise
    assert rise["mpi4jax_dist_tmp"] + 0.5 < rise["mpi4jax_tmp"], rise
    assert len(json.loads(path.read_text())["results"]) == 3


def test_int8_sizes_are_element_counts(memory):
    # 4099 int8: a count that is not a multiple of any larger type.
    (row,) = memory.main(["--sizes", "4099", "--dtype", "int8", "--impls", "mpi4py"])
    assert row["status"] == "ok" and row["count"] == row["bytes"] == 4099, row
    with pytest.raises(SystemExit):
        memory.parse_args(["--sizes", "4099", "--dtype", "float32"])


def test_a_crash_is_reported_and_the_run_goes_on(memory, tmp_path, monkeypatch):
    """One case segfaults (as mpi4jax does above 2^31 elements): its row says
    so, the next case still runs, and the run ends with status 1."""
    real = memory._harness.run_job

    def run_job(procs, argv, **kwargs):
        if "mpi4jax:1048576" in argv:
            return memory._harness.JobResult(
                11, [], stderr="EXIT STRING: Segmentation fault (signal 11)"
            )
        return real(procs, argv, **kwargs)

    monkeypatch.setattr(memory._harness, "run_job", run_job)
    path = tmp_path / "crash.json"
    with pytest.raises(SystemExit) as exit_:
        memory.main(
            ["--sizes", "1MiB", "--impls", "mpi4jax,mpi4py", "--json", str(path)]
        )
    assert exit_.value.code == 1
    rows = {r["impl"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["mpi4jax"]["status"] == "crashed (11, SIGSEGV)"
    assert "Segmentation fault" in rows["mpi4jax"]["tail"]
    assert rows["mpi4py"]["status"] == "ok"


def test_statuses_and_time_limits(memory):
    assert memory._harness.crash_status(1) == "crashed (1)"
    assert memory._harness.crash_status(-9) == "crashed (-9, SIGKILL)"
    assert memory._harness.crash_status(139) == "crashed (139, SIGSEGV)"
    assert memory._harness.crash_status(2, "exited on signal 6 (Aborted)") == (
        "crashed (2, SIGABRT)"
    )
    assert memory.timeout_for(1 << 20, 30.0) == 30.0
    assert memory.timeout_for(0, None) == 120
    assert memory.timeout_for(2 << 30, None) == 240


def test_pattern_made_by_xla_is_numpys(memory, monkeypatch):
    bench = memory._allreduce_impls
    for dtype in bench.DTYPES:
        for rank in (0, 2):
            made = bench.device_pattern(1001, rank, 3, dtype)
            want = bench.pattern(1001, rank, 3, dtype)
            assert made.dtype == want.dtype and np.array_equal(made, want), dtype
    monkeypatch.setattr(bench, "BLOCK", 100)  # 11 blocks, the last of 1
    result = bench.expected(1001, 3, "int8")
    assert bench.count_wrong_blocks(result, 1001, 3, "int8") == 0
    result[[0, 99, 100, 1000]] += 1
    assert bench.count_wrong_blocks(result, 1001, 3, "int8") == 4
    assert bench.count_wrong_blocks(result[:7], 1001, 3, "int8") == 1001


def test_a_failed_case_is_a_row(memory):
    args = argparse.Namespace(dtype="float32", procs=2, timeout=60, gpu=False)
    env = memory._harness.memory_job_env()
    row = memory.measure("nosuch", 1 << 20, args, env)
    assert row["status"] == "crashed (1)", row["tail"]
    assert "nosuch" in row["tail"]
    args.timeout = 0.01
    row = memory.measure("mpi4py", 1 << 20, args, env)
    assert row["status"] == "timed out (0.01 s)"


def test_environment(memory):
    assert memory._harness.memory_job_env()["MALLOC_MMAP_THRESHOLD_"] == "131072"
