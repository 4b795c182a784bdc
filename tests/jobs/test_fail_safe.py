"""The compiled ops fail safely: no use-after-free, no wrong communicator, no hang.

Each test runs one scenario of tests/scripts/fail_safe.py in a 2-rank job of its
own (a failed run can leave JAX's ordered-effect token in error, and a crash at
exit must be seen as the job's status), and reads its lines, its exit status and
its duration. Serially: python -m pytest tests/jobs/test_fail_safe.py.
"""

import re
import time

import pytest
import util

from mpi4jax_dist import _config
from mpi4jax_dist.ops import lifecycle

pytestmark = [
    pytest.mark.mpi_skip,
    pytest.mark.usefixtures("mpi4jax_installed"),
    util.every_mpi,
]

# A segfault as MPICH's and Open MPI's launchers report it, or as the shell does.
CRASH = re.compile(r"signal 11|Segmentation fault|EXIT CODE: 139|SIGSEGV", re.I)
# What the exit report says when it ends the job (mpi4jax_dist/ops/lifecycle.py).
LEFT = "left pending at exit"


@pytest.fixture
def mpi4jax_installed():
    pytest.importorskip("mpi4jax")


def scenario(name: str, timeout: float = 150, **env):
    """Run the scenario on 2 ranks: ``(proc, seconds, stdout lines by rank)``."""
    start = time.perf_counter()
    proc = util.run_mpi(
        "fail_safe.py", 2, name, timeout=timeout, check=False, env=util.clean_env(**env)
    )
    took = time.perf_counter() - start
    lines = {0: [], 1: []}
    for line in proc.stdout.splitlines():
        match = re.match(r"rank (\d): (.*)", line)
        if match:
            lines[int(match[1])].append(match[2])
    return proc, took, lines


def output(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_overlapped_work_that_raises_leaves_no_crash_at_exit():
    """The work between start and wait raises: the run fails with JAX's error on
    both ranks, XLA frees the donated 32 MiB buffer while the request is pending,
    and MPI completes the request at exit into memory the extension owns: the job
    ends with the exit report's status, not a segfault."""
    proc, took, lines = scenario("callback-raises")
    for rank in (0, 1):
        # JAX 0.10 calls it JaxRuntimeError, 0.6.0 XlaRuntimeError.
        assert any(
            re.fullmatch(r"run failed: (Jax|Xla)RuntimeError", line)
            for line in lines[rank]
        ), output(proc)
        assert "done" in lines[rank], output(proc)
    assert not CRASH.search(proc.stdout + proc.stderr), output(proc)
    assert proc.returncode == lifecycle.EXIT_STATUS, output(proc)
    report = r"at exit, the request started at .*fail_safe.py:\d+ in f "
    assert re.search(report, proc.stderr), output(proc)
    assert LEFT in proc.stderr, output(proc)


def test_request_kept_out_of_its_function_ends_the_job_without_a_crash():
    """A request kept in a global list: the program's value is right, the
    request is still pending at exit, the report names its start and the job ends
    non-zero, without a segfault in the report."""
    proc, took, lines = scenario("kept-out")
    for rank in (0, 1):
        assert "value 2.0" in lines[rank], output(proc)
    assert not CRASH.search(proc.stdout + proc.stderr), output(proc)
    assert proc.returncode == lifecycle.EXIT_STATUS, output(proc)
    assert re.search(r"the request started at .*fail_safe.py:\d+ in leaks", proc.stderr)


def test_unmatched_eager_request_exits_promptly_and_non_zero():
    """Rank 0 alone starts a request, which can never complete: the drop warns
    within DROP_TIMEOUT_S, the exit report names it, and the job ends non-zero
    within seconds (it took over 70 s, and ended 0)."""
    proc, took, lines = scenario("rank0-only")
    assert "started" in lines[0] and "done" in lines[1], output(proc)
    assert proc.returncode == lifecycle.EXIT_STATUS, output(proc)
    assert "dropped without req.wait()" in proc.stderr, output(proc)
    assert LEFT in proc.stderr, output(proc)
    # Two Python starts with JAX on a loaded 2-core machine take up to ~20 s; the
    # drop and exit add DROP_TIMEOUT_S + EXIT_TIMEOUT_S.
    budget = 30 + lifecycle.DROP_TIMEOUT_S + lifecycle.EXIT_TIMEOUT_S
    assert took < budget, (took, output(proc))


def test_ranks_that_disagree_on_the_shape_fail_instead_of_hanging():
    """1,000 and 2,000 floats in 400-byte chunks: 10 MPI calls on one rank, 20 on
    the other, which hung until the job's limit. The first call on a communicator
    checks count, dtype, op and chunk size across the ranks: both fail, naming
    both counts."""
    proc, took, lines = scenario(
        "mismatch-first", timeout=90, **{_config.ALLREDUCE_CHUNK_BYTES: "400"}
    )
    for rank in (0, 1):
        text = " ".join(lines[rank])
        assert "mismatched call failed" in text, output(proc)
        assert "disagree" in text and "1000" in text and "2000" in text, text


@util.variant
def test_a_later_mismatch_is_caught_too():
    """After a matched call, the same mismatch is caught: every call is checked
    (it was the first call on a communicator only, unless asked)."""
    proc, took, lines = scenario(
        "mismatch-later", timeout=90, **{_config.ALLREDUCE_CHUNK_BYTES: "400"}
    )
    for rank in (0, 1):
        assert "matched call 2.0" in lines[rank], output(proc)
        assert any("disagree" in line for line in lines[rank]), output(proc)


def test_non_blocking_starts_that_disagree_fail_in_their_wait():
    """MPICH reduces an MPI_Iallreduce of 1,000 floats on one rank and 2,000 on
    the other without an error (rank 1's last 1,000 values are its own); Open
    MPI 5 corrupts its heap on the longer message, then aborts or hangs in its
    crash handler (1 run in 12 hung here). With the header in front (MPICH) or
    judged before the payload is posted (Open MPI), the wait fails on both ranks
    with the report; nothing is left pending at exit."""
    proc, took, lines = scenario("imismatch", timeout=90)
    assert proc.returncode == 0, output(proc)
    for rank in (0, 1):
        text = " ".join(lines[rank])
        assert "mismatched wait failed" in text, output(proc)
        assert "disagree" in text and "1000" in text and "2000" in text, text
    assert LEFT not in proc.stderr, output(proc)


def test_function_compiled_for_a_freed_communicator_refuses_to_run():
    """The compiled call names its communicator by the extension's registration,
    not by the Fortran handle that a new communicator takes over: after Free()
    it fails, where it used to reduce over the new 1-rank communicator."""
    proc, took, lines = scenario("freed-comm", timeout=90)
    assert proc.returncode == 0, output(proc)
    for rank in (0, 1):
        assert "before free 3.0" in lines[rank], output(proc)
        after = [line for line in lines[rank] if line.startswith("after free")]
        assert after and "failed" in after[0] and "freed" in after[0], output(proc)
        assert f"new comm {rank + 1.0}" in lines[rank], output(proc)
    # The case the check exists for: the new communicator took the old handle.
    assert "handle reused True" in lines[0], output(proc)
