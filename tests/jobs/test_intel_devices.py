"""Intel GPUs as Aurora's job scripts give them: one tile per rank.

examples/set_affinity_gpu.sh (GPU_VENDOR=intel) sets ZE_AFFINITY_MASK for each rank
of a real 2-rank job; the device rule (tests/unit/test_package.py has its table) then
gives JAX local_device_ids [0] and sets jax_oneapi_visible_devices where this JAX
has the option (0.10 or newer). There is no Intel GPU here: JAX ends on its CPU,
which is what a rank without the GPU runtime would see. Where jax-oneapi-plugin is
installed (Python 3.12, JAX 0.11.2) the same job runs with it and JAX's attempt to
load it.
"""

from __future__ import annotations

import sys

import pytest
import util

from mpi4jax_dist import _compat

pytestmark = util.skip_in_mpi_job

WRAP = util.ROOT / "examples" / "set_affinity_gpu.sh"


@pytest.mark.parametrize(
    "hierarchy, mask",
    [("FLAT", "{}"), pytest.param("COMPOSITE", "0.{}", marks=util.variant)],
)
def test_each_rank_gets_its_tile(hierarchy, mask):
    env = util.clean_env(
        JAX_PLATFORMS="",  # not cpu: the accelerator rule applies
        GPU_VENDOR="intel",
        GPUS_PER_NODE=1,
        TILES_PER_GPU=2,
        ZE_FLAT_DEVICE_HIERARCHY=hierarchy,
    )
    script = util.SCRIPTS / "devices_program.py"
    proc = util.run_mpi([sys.executable, script], 2, python=str(WRAP), env=env)
    results = util.result_lines(proc, 2, "rank")
    for r in results:
        assert r["ze_affinity_mask"] == mask.format(r["local_rank"]), r
        assert (r["process_index"], r["process_count"]) == (r["rank"], 2), r
        assert r["platforms"] == ["cpu"], r  # no Intel GPU on this machine
        assert r["options"]["jax_cuda_visible_devices"] == "0", r
        if _compat.since("jax_oneapi_visible_devices"):
            assert r["options"]["jax_oneapi_visible_devices"] == "0", r
        else:
            assert "jax_oneapi_visible_devices" not in r["options"], r
    if results[0]["plugin"]:  # JAX tried Intel's plugin and fell back to its CPU
        assert "oneapi" in proc.stderr.lower(), proc.stderr[-2000:]
