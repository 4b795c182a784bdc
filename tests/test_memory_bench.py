"""benchmarks/memory.py: one fresh job per case, the same rows in any order, and a
failed case is a row, not the end of the run."""

import argparse

import pytest
import util

pytestmark = util.skip_in_mpi_job


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
                "--plot",
                str(tmp_path / f"{order}.png"),
            ]
        )
        assert path.exists() and (tmp_path / f"{order}.png").exists()
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


def test_a_failed_case_is_a_row(memory):
    args = argparse.Namespace(dtype="float32", procs=2, timeout=60, warm=False)
    row = memory.measure("nosuch", 1 << 20, args, memory.job_env(False))
    assert row["status"] == "crashed (1)"
    assert "nosuch" in row["tail"]
    args.timeout = 0.01
    row = memory.measure("mpi4py", 1 << 20, args, memory.job_env(False))
    assert row["status"] == "timed out (0.01 s)"


def test_orders_and_environment(memory):
    cases = [(i, s) for s in (1, 2) for i in ("a", "b", "c")]
    assert memory.order_cases(cases, "default", 0) == cases
    assert memory.order_cases(cases, "reversed", 0) == cases[::-1]
    shuffled = memory.order_cases(cases, "shuffled", 1)
    assert sorted(shuffled) == sorted(cases)
    assert shuffled == memory.order_cases(cases, "shuffled", 1)
    assert memory.job_env(False)["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert "MALLOC_MMAP_THRESHOLD_" not in memory.job_env(True)
