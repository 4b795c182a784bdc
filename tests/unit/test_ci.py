"""What tools/test.sh runs where: each folder of tests/ by how its tests run;
under mpiexec, only the folders of util.WITH_PEERS are collected
(tests/conftest.py); at 4 ranks, only the tests marked more_ranks.
"""

import re
import sys

import pytest
import util

pytestmark = util.serial_only

# A test or a module marked mpi (pytest-mpi), or more_ranks (run at 4 ranks).
MARKED_MPI = re.compile(
    r"^(@pytest\.mark\.mpi\(|@util\.more_ranks|pytestmark = .*mark\.mpi\()", re.M
)
FOLDERS = sorted(p for p in util.HERE.iterdir() if any(p.glob("test_*.py")))


def test_tests_marked_mpi_are_in_a_folder_run_with_peers():
    """A test marked mpi elsewhere would never run with peers; a file of
    tests/peers without one is not run with peers either."""
    for folder in FOLDERS:
        for path in folder.glob("test_*.py"):
            marked = MARKED_MPI.search(path.read_text()) is not None
            where = path.relative_to(util.ROOT)
            if folder.name not in util.WITH_PEERS:
                assert not marked, f"{where}: marked mpi, in no folder run with peers"
            elif folder.name == "peers":
                assert marked, f"{where}: no test marked mpi, in tests/peers"


def test_every_folder_runs_in_tools_test_sh():
    script = (util.ROOT / "tools" / "test.sh").read_text()
    for folder in FOLDERS:
        assert f"tests/{folder.name}" in script, f"tools/test.sh never runs {folder}"


def test_no_test_of_one_process_is_taken_for_an_mpi_test(request):
    """pytest-mpi skips serially, and runs under mpiexec, every test with "mpi"
    among its keywords, which hold its folders' names too (a folder tests/mpi
    skipped 70 tests of one process)."""
    wrong = [
        item.nodeid
        for item in request.session.items
        if "mpi" in item.keywords and not item.get_closest_marker("mpi")
    ]
    assert not wrong, f"taken for tests marked mpi: {wrong[:5]}"


def test_tests_at_four_ranks_are_mpi_tests(request):
    serial = [
        item.nodeid
        for item in request.session.items
        if item.get_closest_marker("more_ranks") and not item.get_closest_marker("mpi")
    ]
    assert not serial, f"marked more_ranks, not mpi (every rank runs them): {serial}"


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


def stage_functions() -> str:
    """A script's head with tools/test.sh's ``run`` and ``children_cpu``, read
    from it, and the ``here`` and ``venv`` it runs tools/reaped.py from."""
    script = (util.ROOT / "tools" / "test.sh").read_text()
    functions = re.findall(
        r"^(?:children_cpu|run)\(\) \{\n.*?^\}\n", script, re.M | re.S
    )
    assert len(functions) == 2, "tools/test.sh defines no run() or children_cpu()"
    head = f"set -euo pipefail\nhere={util.ROOT}\nvenv={sys.prefix}\n"
    return head + "".join(functions)


def test_a_stage_that_runs_out_of_its_time_says_so(tmp_path):
    """tools/test.sh's ``run``, read from the script: a stage ended by its
    ``timeout`` prints which limit ran out and after how long, and the script ends
    with timeout's status; a stage that passes says nothing of the kind."""
    probe = tmp_path / "probe.sh"
    probe.write_text(
        stage_functions() + "run true\nrun timeout 1 sleep 30\necho not reached\n"
    )
    proc = util.run_command(["bash", str(probe)], env=util.clean_env(), timeout=30)
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "not reached" not in proc.stdout
    said = re.findall(
        r"ran out of its time limit after (\d+) s \(exit 124\)", proc.stderr
    )
    assert len(said) == 1 and 1 <= int(said[0]) <= 5, proc.stderr
    # Each stage's seconds and CPU seconds, the second one's CPU about none.
    took = re.findall(r"^\+ took (\d+) s, (\d+) s of CPU$", proc.stdout, re.M)
    assert len(took) == 2 and int(took[1][1]) == 0, proc.stdout


def test_jobs_skip_the_last_collections_at_exit_unless_asked_for_a_full_exit():
    """tests/quick_exit/sitecustomize.py, which a job's Python runs at start-up
    (clean_env puts it on PYTHONPATH): the finalizer of an object in a reference
    cycle still alive at exit runs in CPython's last collections, which the hook's
    gc.freeze() skips; clean_env(full_exit=True) leaves the hook out."""
    code = (
        "class Cycle:\n"
        "    def __init__(self):\n"
        "        self.me = self\n"
        "    def __del__(self):\n"
        "        print('finalized', flush=True)\n"
        "kept = Cycle()\n"
    )
    for full_exit, finalized in ((False, False), (True, True)):
        env = util.clean_env(full_exit=full_exit)
        proc = util.run_command([sys.executable, "-c", code], env=env, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert ("finalized" in proc.stdout) == finalized, (full_exit, proc.stdout)


def test_a_stage_counts_the_cpu_of_what_it_left_to_others_to_reap(tmp_path):
    """tools/test.sh's ``run`` under tools/reaped.py: a process the stage's command
    leaves behind (as MPI_Abort leaves a job's ranks to whoever reaps them) counts
    for the stage's CPU, and one still running after the stage is named; without
    the subreaper (a function of the script, run as it is) its CPU is lost."""
    burn = tmp_path / "burn.py"  # 1.2 CPU-s, then writes the file it is given
    burn.write_text(
        "import sys, time\n"
        "end = time.process_time() + 1.2\n"
        "while time.process_time() < end:\n"
        "    pass\n"
        "open(sys.argv[1], 'w').close()\n"
    )

    def leave(name):
        # In the background of a subshell that ends at once; the stage waits for
        # the orphan's file.
        done = tmp_path / name
        wait = f"until [ -e {done} ]; do sleep 0.1; done"
        return f"({sys.executable} {burn} {done} &); {wait}"

    sleeper = f"({sys.executable} -c 'import time; time.sleep(5)' &)"
    probe = tmp_path / "probe.sh"
    probe.write_text(
        stage_functions()
        + f"stage() {{ {leave('b')}; }}\n"
        + f'run bash -c "{leave("a")}"\nrun stage\nrun bash -c "{sleeper}"\n'
    )
    proc = util.run_command(["bash", str(probe)], env=util.clean_env(), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    took = re.findall(r"^\+ took \d+ s, (\d+) s of CPU$", proc.stdout, re.M)
    assert [int(t) for t in took] == [1, 0, 0], proc.stdout
    assert re.search(
        r"left running by bash: python\S* \(\d+\)", proc.stderr
    ), proc.stderr
