"""One rank of tests/jobs/test_intel_devices.py's job: what it was given and what JAX
took from the device rule.

Run under examples/set_affinity_gpu.sh with GPU_VENDOR=intel: each rank sees one
tile (ZE_AFFINITY_MASK). Prints one ``RESULT {json}`` line per rank.
"""

import importlib.metadata
import os

import jax
from launch_common import report
from mpi4py import MPI

import mpi4jax_dist


def plugin_version():
    """The jax-oneapi-pjrt that JAX would load for Intel GPUs, or None."""
    try:
        return importlib.metadata.version("jax-oneapi-pjrt")
    except importlib.metadata.PackageNotFoundError:
        return None


jax.distributed.initialize()
options = ("jax_oneapi_visible_devices", "jax_cuda_visible_devices")
report(
    rank=MPI.COMM_WORLD.Get_rank(),
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    ze_affinity_mask=os.environ.get("ZE_AFFINITY_MASK"),
    options={o: jax.config.values.get(o) for o in options if o in jax.config.values},
    platforms=sorted({d.platform for d in jax.devices()}),
    plugin=plugin_version(),
    local_rank=mpi4jax_dist.topology().local_rank,
)
