"""When one rank fails, the whole job ends in seconds
(``mpi4jax_dist.faults.failfast``).

Each test launches ``tests/scripts/rank_failure.py --worker CASE`` on 2 ranks (the
scenarios the benchmark times), in which rank 1 fails
while rank 0 waits for it in a jitted ``mpi4jax.allreduce`` (or, before the
backend starts, in JAX's backend start-up), and asserts the exit status, the first
line printed, and that the job ended within 15 s of rank 1's failure (the line it
prints just before; from the job's start where there is none). Without the
package's hooks these jobs hang for minutes (README, "When a rank fails").
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.every_mpi]

bench = util.load_benchmark("rank_failure", util.SCRIPTS)
ENDS_WITHIN_S = 15
HEADER = "mpi4jax_dist: rank 1 of 2: {what}; MPI_Abort ends the job"


def launch(case, *python_args, full_exit=False, **env):
    """The job's result, and the seconds from rank 1's failure to the job's end
    (``full_exit``: util.clean_env's).

    From the failure, not the launch: under Open MPI a job that ends 0.3 s after
    the failure took 3 s from its launch on an idle VM, and 16 to 28 s in CI's
    three lanes on a slower one (2026-12-07), failing the 15 s check."""
    start = time.monotonic()
    proc = util.run_mpi(
        [*python_args, util.SCRIPTS / "rank_failure.py", "--worker", case],
        2,
        check=False,
        timeout=90,
        env=util.clean_env(full_exit=full_exit, **{**bench.QUIET, **env}),
    )
    return proc, util.seconds_from("RANK1 FAILS", proc.stdout, start, time.monotonic())


def first_line(proc) -> str:
    return bench.first_line(proc.stdout, proc.stderr)


def sigterm_caught(proc) -> list[bool]:
    """Per rank, whether SIGTERM had a handler once JAX's backend was up."""
    found = re.findall(r"READY (\d) (True|False)", proc.stdout)
    return [caught == "True" for _, caught in sorted(found)]


def show(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(
    "case, runner, code, what",
    [
        ("raise_before_backend", (), 1, "uncaught ValueError"),
        ("raise", (), 1, "uncaught ValueError"),
        # Python's hooks alone, with nothing of JAX's between them and the abort:
        # under the newest JAX only.
        pytest.param(
            "raise",
            ("-m", "mpi4py"),
            1,
            "uncaught ValueError",
            marks=util.same_under_every_jax,
        ),
        pytest.param(
            "thread",
            (),
            1,
            "uncaught ValueError in thread 'Thread-1 (<lambda>)'",
            marks=util.same_under_every_jax,
        ),
        pytest.param("exit3", (), 3, "sys.exit(3)", marks=util.same_under_every_jax),
        pytest.param("exit3", ("-m", "mpi4py"), 3, "sys.exit(3)", marks=util.variant),
    ],
)
def test_failing_rank_aborts_the_job(case, runner, code, what):
    proc, took = launch(case, *runner)
    assert proc.returncode == code, show(proc)
    assert first_line(proc).startswith(HEADER.format(what=what)), show(proc)
    assert "RANK0 DONE" not in proc.stdout
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end"
    if case in ("raise", "raise_before_backend", "thread"):
        # The traceback once, every line prefixed with the rank.
        assert proc.stderr.count("Traceback (most recent call last):") == 1
        assert "[rank 1] ValueError: rank 1 failed on purpose" in proc.stderr


@pytest.mark.parametrize(
    "case, signal",
    [
        # SIGKILL leaves nothing to JAX; SIGTERM meets its preemption service.
        pytest.param("kill9", 9, marks=util.same_under_every_jax),
        ("sigterm", 15),
    ],
)
def test_signalled_rank_ends_the_job(case, signal):
    proc, took = launch(case)
    # MPICH's mpiexec exits with the signal's number, Open MPI's with 128 + it,
    # Intel MPI's with 255.
    codes = {"mpich": (signal,), "openmpi": (128 + signal,), "impi": (255,)}
    assert proc.returncode in codes[util.mpi_family()], show(proc)
    if util.mpi_family() == "openmpi":
        # Open MPI 5's prterun says it first; 4's ORTE (mpiexec.openmpi on Debian)
        # after "Primary job terminated normally, but 1 process returned".
        assert "noticed that process rank 1 with PID" in proc.stderr + proc.stdout
    else:
        expected = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
        assert first_line(proc).startswith(expected), show(proc)
    assert "RANK0 DONE" not in proc.stdout
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end"


@util.same_under_every_jax
def test_os_exit_0_while_the_other_rank_waits_ends_the_job_non_zero():
    """Rank 1 calls os._exit(0) while rank 0 waits in an allreduce: the launcher
    used to end rank 0 with it and return status 0 (MPICH), a job that looked
    right. Now rank 1 waits for rank 0 to reach its exit (the hang timeout, here
    5 s), then ends the job non-zero, naming itself and its os._exit (or the
    hang timeout's report, due at the same time, does)."""
    proc, took = launch("os_exit0", MPI4JAX_DIST_HANG_TIMEOUT=5)
    assert proc.returncode != 0, show(proc)
    # Its own line, or the hang timeout's report (whichever comes first: both
    # wait 5 s) naming it at its exit (os._exit marks it so for the watchdogs).
    said = "rank 1 of 2: os._exit(0) while other ranks had not reached their exit"
    placed = r"  rank 1 reached its exit \(the end of the program, or sys\.exit\)"
    assert said in proc.stderr or re.search(placed, proc.stderr), show(proc)
    assert "RANK0 DONE" not in proc.stdout
    assert took < 5 + ENDS_WITHIN_S, f"the job took {took:.1f} s to end"


@util.same_under_every_jax
def test_os_exit_0_at_the_end_waits_for_the_others_work():
    """Rank 1 calls os._exit(0) at its end while rank 0 works 3 s more, then 1 s
    at its exit: the launcher used to end rank 0 with rank 1 (MPICH's Hydra
    SIGKILLs the ranks of a job one of which left without MPI_Finalize); now
    rank 1 waits for rank 0 at the exit and leaves as the end of a program does,
    and the job ends with status 0 under every MPI, its work done."""
    proc, _ = launch("os_exit0_early")
    assert proc.returncode == 0, show(proc)
    assert "RANK0 LATE DONE" in proc.stdout, show(proc)
    assert "EXIT WORK DONE" in proc.stdout, show(proc)
    assert "MPI_Abort ends the job" not in proc.stderr + proc.stdout


@util.variant
@util.same_under_every_mpi
def test_os_exit_ends_the_job_where_its_clean_up_fails():
    """JAX's shutdown raising in rank 1's os._exit (after the ranks met at the
    exit): rank 0 would wait at JAX's shutdown barrier for minutes, unless the
    launcher killed it; the job ends with MPI_Abort, naming why, non-zero (1, or
    9 where Hydra reports rank 0's SIGKILL first)."""
    proc, took = launch("os_exit0_cleanup_fails")
    assert proc.returncode != 0, show(proc)
    said = HEADER.format(
        what="os._exit(0): its clean-up failed (RuntimeError: the coordination "
        "service is gone (injected))"
    )
    assert first_line(proc).startswith(said), show(proc)
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end"


@util.same_under_every_jax
@util.same_under_every_mpi
def test_a_forked_child_s_os_exit_is_not_the_rank_s():
    """A child that rank 1 forks ends by os._exit(0) (as multiprocessing's do): it
    ends at once, without waiting for the ranks at their exit, and the job goes on
    to its end."""
    proc, _ = launch("fork_os_exit0")
    assert proc.returncode == 0, show(proc)
    ended = re.search(r"CHILD ENDED ([\d.]+)", proc.stdout)
    assert ended and float(ended.group(1)) < 5, show(proc)
    assert "RANK0 DONE 2.0" in proc.stdout, show(proc)


@util.same_under_every_jax
def test_sys_exit_0_while_the_other_rank_waits_is_named_exited():
    """Rank 1 ends by sys.exit(0) while rank 0 waits for it in an allreduce: under
    the hang timeout the report names rank 1 as at its exit (it was 'no answer
    ... where it stands is unknown') and the job ends non-zero."""
    proc, took = launch("exit0", MPI4JAX_DIST_HANG_TIMEOUT=5)
    assert proc.returncode != 0, show(proc)
    assert "the job is hung" in proc.stderr, show(proc)
    assert re.search(r"  rank 1 reached its exit \(", proc.stderr), show(proc)
    assert "no answer from" not in proc.stderr, show(proc)
    assert took < 5 + ENDS_WITHIN_S + 10, f"the job took {took:.1f} s to end"


@pytest.mark.parametrize(
    "case",
    [
        "ok",
        pytest.param("caught_exit", marks=[util.same_under_every_mpi, util.variant]),
    ],
)
def test_normal_exit_keeps_jax_shutdown(case):
    # As users meet it: CPython's finalization whole (tests/quick_exit).
    proc, _ = launch(case, full_exit=True)
    assert proc.returncode == 0, show(proc)
    assert "RANK0 DONE 2.0" in proc.stdout
    assert "Exception ignored" not in proc.stderr, show(proc)
    assert "MPI_Abort" not in proc.stderr + proc.stdout
    # JAX's preemption service (and its SIGTERM handler) is off.
    assert sigterm_caught(proc) == [False, False], show(proc)


@util.same_under_every_mpi
def test_switch_off_brings_back_jax_behaviour():
    # Rank 1 raises where nobody waits for it, so that the job ends either way.
    on, _ = launch("raise_after")
    assert on.returncode == 1, show(on)
    assert first_line(on).startswith(HEADER.format(what="uncaught ValueError"))
    assert sigterm_caught(on) == [False, False], show(on)

    off, _ = launch("raise_after", MPI4JAX_DIST_FAIL_FAST=0)
    assert off.returncode == 1, show(off)
    assert first_line(off) == "Traceback (most recent call last):", show(off)
    assert "MPI_Abort" not in off.stderr + off.stdout
    assert "RANK0 DONE 2.0" in off.stdout
    assert sigterm_caught(off) == [True, True], show(off)  # JAX's notifier


@util.same_under_every_mpi
def test_jax_preemption_service_on_request():
    proc, took = launch("raise", JAX_ENABLE_PREEMPTION_SERVICE=1)
    assert sigterm_caught(proc) == [True, True], show(proc)
    # Exceptions still end the job.
    assert proc.returncode == 1, show(proc)
    assert first_line(proc).startswith(HEADER.format(what="uncaught ValueError"))
    assert took < ENDS_WITHIN_S, f"the job took {took:.1f} s to end"


@pytest.mark.parametrize(
    "env, installed, sigterm",
    [
        ({}, True, "default action (the process ends)"),
        pytest.param(
            {"MPI4JAX_DIST_FAIL_FAST": "0"},
            False,
            "caught by JAX's preemption service",
            marks=util.same_under_every_mpi,
        ),
        pytest.param(
            {"JAX_ENABLE_PREEMPTION_SERVICE": "1"},
            True,
            "caught by JAX's preemption service",
            marks=util.same_under_every_mpi,
        ),
    ],
)
def test_diagnostics_report_what_is_in_force(env, installed, sigterm):
    proc = util.run_mpi(
        ["-m", "mpi4jax_dist"], 2, "--json", "--check", env=util.clean_env(**env)
    )
    report = json.loads(
        proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1]
    )
    failure = report["on_failure"]
    assert failure["abort_on_failure"] is (env.get("MPI4JAX_DIST_FAIL_FAST") != "0")
    assert failure["installed"] is installed
    assert failure["sigterm"] == sigterm
    assert {k: v for k, v in failure["settings"].items() if v is not None} == env


# --- the sys.exit hook's judgement, without MPI -------------------------------------


@util.same_under_every_jax
@util.same_under_every_mpi
@pytest.mark.parametrize(
    "shape, code, aborts",
    [
        ("module", 3, True),
        ("nested", 3, True),
        pytest.param("string", 1, True, marks=util.variant),
        ("reraise_bare", 3, True),
        pytest.param("reraise_named", 3, True, marks=util.variant),
        ("zero", 0, False),
        ("caught_at_module", 0, False),
        pytest.param("caught_in_function", 0, False, marks=util.variant),
        pytest.param("suppressed", 0, False, marks=util.variant),
        pytest.param("caught_then_zero", 0, False, marks=util.variant),
    ],
)
def test_exit_hook_aborts_only_when_the_exit_ends_the_program(shape, code, aborts):
    proc = subprocess.run(
        [sys.executable, str(util.SCRIPTS / "exit_shapes.py"), shape],
        capture_output=True,
        text=True,
        timeout=120,
        env=util.clean_env(),
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert ("ABORT" in proc.stdout) == aborts, proc.stdout + proc.stderr


@util.same_under_every_jax
def test_one_ctrl_c_ends_a_job_waiting_in_c():
    """Ranks deadlocked in C (allreduce on rank 0 against iallreduce on rank 1, no
    timeout set) and one Ctrl-C, as a terminal sends it: SIGINT to the launcher's
    process group. Python would raise KeyboardInterrupt only when its main thread
    runs again, which it never does, and Hydra asks for a second Ctrl-C; the
    package's C thread sees Python has not run for 2 s, writes each rank's stacks
    and one line, and MPI_Abort ends the job, non-zero, within seconds. (Open
    MPI's launcher ends the ranks itself at the first Ctrl-C, before that.)"""
    cmd = [util.mpiexec()]
    if util.mpi_family() == "openmpi":
        cmd.append("--oversubscribe")
    cmd += ["-n", "2", sys.executable, str(util.SCRIPTS / "desync.py")]
    # The checks off: with them the watchdog ends this deadlock within seconds
    # by itself (tests/jobs/test_standstill.py), before or after the Ctrl-C.
    env = util.clean_env(CASE="kind", MPI4JAX_DIST_CHECKS=0, **bench.QUIET)
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=util.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        ready = []
        deadline = time.monotonic() + 60
        while len(ready) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            ready += re.findall(r"READY \d", line)
        assert len(ready) == 2, "the ranks did not start"
        time.sleep(3)  # into the deadlock: both wait in C
        assert proc.poll() is None, "the job ended before the Ctrl-C"
        os.killpg(proc.pid, signal.SIGINT)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert took < 15, f"the job took {took:.1f} s after the Ctrl-C\n{err}"
    if util.mpi_family() == "openmpi":
        return  # Open MPI's prterun ends the ranks itself at the first Ctrl-C
    said = "interrupted (SIGINT), and its Python has not run for 2 s since"
    assert said in err, err
    # Where each rank stood: its stacks, the script's line among them.
    stood = re.findall(r"\[rank (\d)\]\s+File \".*desync\.py\", line \d+", err)
    assert set(stood) == {"0", "1"}, err
