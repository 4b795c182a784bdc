"""JAX's persistent compilation cache serves every rank's own programs under
``jax.distributed``: real 2-rank jobs, run twice against one cache directory.

JAX writes cache entries on process 0 only, and a per-rank program's key holds its
device (another key on every rank, except on GPU): without
``_compat.cache_on_every_process`` rank 1 never finds one. Serial session only.
"""

from __future__ import annotations

import pytest
import util
from util import skip_in_mpi_job

TIMEOUT = 120  # seconds per job; a job takes a few seconds here


def _twice(cache_dir, **env) -> list[dict]:
    """Run the per-rank programs twice on 2 ranks against ``cache_dir``; return the
    second run's RESULT records, by rank."""
    records = []
    for _ in range(2):
        proc = util.run_mpi(
            "compilation_cache.py",
            2,
            cache_dir,
            env=util.clean_env(**env),
            timeout=TIMEOUT,
        )
        records = util.result_lines(proc, 2, "rank")
    return records


@util.same_under_every_mpi
@skip_in_mpi_job
def test_every_rank_hits_the_cache_on_the_second_run(tmp_path):
    second = _twice(tmp_path / "cache")
    for record in second:
        assert record["requests"] >= 2, record
        assert record["hits"] == record["requests"], second


@util.same_under_every_mpi
@skip_in_mpi_job
def test_jax_rule_alone_leaves_rank_1_without_entries(tmp_path):
    # MPI4JAX_DIST_CACHE_EVERY_PROCESS=0: JAX's rule, process 0 alone writes. What
    # the test above would see without the fix: rank 1 misses every time.
    second = _twice(tmp_path / "cache", MPI4JAX_DIST_CACHE_EVERY_PROCESS=0)
    assert second[0]["hits"] == second[0]["requests"] >= 2, second
    assert second[1]["hits"] == 0 and second[1]["requests"] >= 2, second


@util.serial_only
@pytest.mark.parametrize(
    "value, expected", [(None, True), ("1", True), ("0", False), ("off", False)]
)
def test_switch(value, expected):
    from mpi4jax_dist import _config

    env = {} if value is None else {_config.CACHE_EVERY_PROCESS: value}
    assert _config.cache_every_process(env) is expected
