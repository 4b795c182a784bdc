"""What tools/test.sh runs where: under mpiexec, only the files of util.MPI_FILES
are collected (tests/conftest.py); at 4 ranks, only the tests marked more_ranks.

The tests read the serial session's own collection, so they check something when
it collects every file (python -m pytest, as CI runs it) and skip otherwise.
"""

import re

import pytest
import util

pytestmark = util.serial_only


@pytest.fixture
def items(request):
    """Every test of the session, which must have collected every test file."""
    files = {item.path.name for item in request.session.items}
    left_out = sorted(
        p.name
        for p in util.HERE.glob("test_*.py")
        if p.name not in files and p.name not in util.BESIDE_FILES
    )
    if left_out:
        pytest.skip(f"reads the whole suite's collection; not collected: {left_out}")
    return request.session.items


def test_every_file_with_mpi_tests_is_collected_under_mpiexec(items):
    with_mpi = {item.path.name for item in items if item.get_closest_marker("mpi")}
    missing = sorted(with_mpi - util.MPI_FILES)
    assert not missing, (
        f"tests marked mpi in {missing}, which mpiexec never collects: add the "
        f"files to MPI_FILES in tests/util.py"
    )
    stale = sorted(util.MPI_FILES - with_mpi)
    assert not stale, f"files in MPI_FILES (tests/util.py) without MPI tests: {stale}"


def test_tests_at_four_ranks_are_mpi_tests(items):
    serial = [
        item.nodeid
        for item in items
        if item.get_closest_marker("more_ranks") and not item.get_closest_marker("mpi")
    ]
    assert not serial, f"marked more_ranks, not mpi (every rank runs them): {serial}"


def test_files_run_beside_the_serial_suite_are_run_and_hold_no_mpi_tests():
    """tools/test.sh leaves util.BESIDE_FILES out of .venv's serial suite and runs
    them in a stage beside it; marked mpi, their tests would never run."""
    script = (util.ROOT / "tools" / "test.sh").read_text()
    for name in sorted(util.BESIDE_FILES):
        assert f"tests/{name}" in script, f"tools/test.sh never names {name}"
        text = (util.HERE / name).read_text()
        assert "mark.mpi(" not in text and "more_ranks" not in text, name


@pytest.mark.parametrize("script", [".ci/run", "tools/setup.sh"])
def test_help_prints_usage_and_starts_nothing(script, tmp_path):
    """``--help`` of the README's two entry points says what they do and starts
    nothing: run from a copy of the tree's scripts whose setup.sh and test.sh
    (for .ci/run) only leave a mark, and with VENV in a fresh folder."""
    for name in (".ci/run", "tools/setup.sh", "tools/test.sh", "tools/find_python.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        text = (util.ROOT / name).read_text()
        if script == ".ci/run" and name != ".ci/run":
            text = f"#!/usr/bin/env bash\ntouch {tmp_path}/started\n"
        (tmp_path / name).write_text(text)
    venv = tmp_path / "venv"
    proc = util.run_command(
        ["bash", str(tmp_path / script), "--help"],
        env=util.clean_env(VENV=str(venv)),
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower() or "bash tools/setup.sh" in proc.stdout
    assert not (tmp_path / "started").exists() and not venv.exists()
    wrong = util.run_command(
        ["bash", str(tmp_path / script), "--no-such-flag"],
        env=util.clean_env(VENV=str(venv)),
        timeout=30,
    )
    assert wrong.returncode == 2 and "--no-such-flag" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "started").exists() and not venv.exists()


def test_a_stage_that_runs_out_of_its_time_says_so(tmp_path):
    """tools/test.sh's ``run``, read from the script: a stage ended by its
    ``timeout`` prints which limit ran out and after how long, and the script ends
    with timeout's status; a stage that passes says nothing of the kind."""
    script = (util.ROOT / "tools" / "test.sh").read_text()
    run = re.search(r"^run\(\) \{\n.*?^\}\n", script, re.M | re.S)
    assert run, "tools/test.sh defines no run()"
    probe = tmp_path / "probe.sh"
    probe.write_text(
        "set -euo pipefail\n" + run.group(0) + "run true\nrun timeout 1 sleep 30\n"
        "echo not reached\n"
    )
    proc = util.run_command(["bash", str(probe)], env=util.clean_env(), timeout=30)
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "not reached" not in proc.stdout
    said = re.findall(
        r"ran out of its time limit after (\d+) s \(exit 124\)", proc.stderr
    )
    assert len(said) == 1 and 1 <= int(said[0]) <= 5, proc.stderr
