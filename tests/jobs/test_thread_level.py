"""The compiled ops at every MPI thread level (tests/scripts/thread_level.py).

XLA runs the ops on its worker threads. At ``MPI_THREAD_MULTIPLE`` they call MPI
freely; at ``MPI_THREAD_SERIALIZED`` (Cray MPICH's level where
``MPICH_MAX_THREAD_SAFETY`` is unset) every MPI call of the extension holds one
lock, and the results must be the same; below that each op refuses, naming what
to set. A job of two ranks per level, under the MPI of this environment (CI runs
this file under MPICH, Open MPI and Intel MPI). Serially: ``python -m pytest
tests/jobs/test_thread_level.py``.
"""

import pytest
import util

pytestmark = [
    pytest.mark.mpi_skip,
    pytest.mark.usefixtures("mpi4jax_installed"),
    util.every_mpi,
]

CHUNK = 256 << 10  # the 1 MiB allreduce goes in 4 calls


@pytest.fixture
def mpi4jax_installed():
    pytest.importorskip("mpi4jax")


def job(level: str) -> list[dict]:
    env = util.clean_env(
        MPI4PY_RC_THREAD_LEVEL=level,
        MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES=CHUNK,
        MPI4JAX_NO_WARN_JAX_VERSION=1,
    )
    proc = util.run_mpi("thread_level.py", 2, env=env, timeout=240, check=False)
    return util.result_lines(proc, 2, "rank")


@pytest.mark.parametrize(
    "level", [pytest.param("serialized", marks=util.variant), "multiple"]
)
def test_the_ops_are_right_and_lock_only_when_serialized(level):
    for r in job(level):
        assert r["level"] == level, r
        wrong = {k: e for k, e in r["errors"].items() if e > 1e-9}
        assert not wrong, f"rank {r['rank']}: {wrong}"
        assert len(r["errors"]) == 9, r["errors"]  # 5 allreduce cases, 4 cg variants
        # What ran: the blocking calls (the 1 MiB one in 4 chunks) and the
        # non-blocking ones' posts, tests and waits, each under the lock.
        stats = r["stats"]
        assert stats["mpi_calls"] >= 1 + 4 + 50, stats
        if level == "serialized":
            assert stats["locked_sections"] > stats["mpi_calls"], stats
        else:
            assert stats["locked_sections"] == 0, stats
        # A Python thread registering a communicator beside a running program of
        # allreduces (2,000 under the lock): it waits its turn, the program's
        # value is right.
        beside = r["beside"]
        assert beside["value"] == 1.0 and beside["registrations"] >= 1, beside
        if level == "serialized":
            assert beside["locked_during"] >= 2000, beside


@pytest.mark.parametrize(
    "level", ["single", pytest.param("funneled", marks=util.variant)]
)
def test_below_serialized_every_op_refuses_naming_what_to_set(level):
    for r in job(level):
        assert r["level"] == level, r
        for op, said in r["refusals"].items():
            assert said is not None, f"rank {r['rank']}: {op} ran at {level}"
            assert f"MPI_THREAD_{level.upper()}" in said, said
            assert "MPICH_MAX_THREAD_SAFETY=serialized" in said, said
            assert "mpi4py.rc.thread_level" in said, said
            assert f"MPI4PY_RC_THREAD_LEVEL={level}" in said, said
        assert set(r["refusals"]) == {"allreduce", "iallreduce", "cg"}
