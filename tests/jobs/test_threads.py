"""Programs of one process that nothing orders against each other never cross
unnoticed: dispatched from two threads, or under two execution streams, their
calls fail loudly where they would meet the other ranks' in another order
(tests/scripts/threads.py, each case a job of its own, no variable set).

Before (08163be) the ``apart`` and ``stream`` cases returned ``f 101.0, g 101.0``
(f's sum is 2.0, g's 200.0) on both ranks with exit 0: each rank's first call met
the other's other program. Serially: python -m pytest tests/jobs/test_threads.py.
"""

import time

import pytest
import util

pytestmark = [pytest.mark.mpi_skip, util.same_under_every_jax]

CROSSED = "ran while another program of this process ran a call there"
# The other way a crossing is caught: f's and g's calls are made from different
# lines, which the ranks compare (the header's site).
DISAGREE = "disagree on its call"


def threads(case: str, timeout: float = 120, **env):
    start = time.perf_counter()
    proc = util.run_mpi(
        "threads.py",
        2,
        timeout=timeout,
        check=False,
        env=util.clean_env(CASE=case, MPI4JAX_NO_WARN_JAX_VERSION=1, **env),
    )
    return proc, time.perf_counter() - start


def output(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("case", ["apart", "stream"])
def test_programs_no_one_orders_fail_loudly(case):
    """``apart``: two programs from two threads, run in one order on one rank and
    the other on the other; ``stream``: two programs of one thread under two
    execution streams, likewise. The job ends non-zero within seconds and no rank
    prints a value (before: f 101.0, g 101.0 on both ranks, exit 0)."""
    if case == "stream":
        from jaxlib import xla_client

        if not hasattr(xla_client, "execution_stream_id"):
            pytest.skip("this jaxlib has no execution_stream_id")
    proc, took = threads(case)
    assert proc.returncode != 0, output(proc)
    assert took < 60, output(proc)
    assert CROSSED in proc.stderr or DISAGREE in proc.stderr, output(proc)
    assert "RESULT" not in proc.stdout, output(proc)


def test_one_line_s_programs_from_two_threads_are_right_or_named():
    """``same``: two programs whose calls are made at one line, from two threads,
    the second dispatched once the first's call waits (for a late rank). Where
    the runtime starts the second while the first is in its call, the job ends
    named; where it holds it until then (as it often does), the values are right.
    Never a wrong value with exit 0."""
    proc, took = threads("same")
    if proc.returncode == 0:
        assert sorted(util.result_texts(proc.stdout)) == [
            "0 2.0 200.0",
            "1 2.0 200.0",
        ], output(proc)
    else:
        assert CROSSED in proc.stderr, output(proc)
        assert "RESULT" not in proc.stdout, output(proc)
        assert took < 60, output(proc)


def test_programs_the_user_orders_run_right():
    """The control: thread B waits for f's result before it dispatches g."""
    proc, _ = threads("serial")
    assert proc.returncode == 0, output(proc)
    assert sorted(util.result_texts(proc.stdout)) == ["0 2.0 200.0", "1 2.0 200.0"]
