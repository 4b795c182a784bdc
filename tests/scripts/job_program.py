"""The program tests/jobs/test_job_scripts.py hands the job scripts in examples/.

Like examples/hello.py, its one line for JAX is ``import mpi4jax_dist``; each rank
prints one ``RESULT {json}`` line: its MPI rank, its local rank and the device
variables examples/set_affinity_gpu.sh gave it, and JAX's view.
"""

import os

import jax
from launch_common import report
from mpi4py import MPI

import mpi4jax_dist

jax.distributed.initialize()
topo = mpi4jax_dist.topology()
report(
    rank=MPI.COMM_WORLD.Get_rank(),
    size=MPI.COMM_WORLD.Get_size(),
    local_rank=topo.local_rank,
    node_index=topo.node_index,
    num_nodes=topo.num_nodes,
    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    ze_affinity_mask=os.environ.get("ZE_AFFINITY_MASK"),
    process_index=jax.process_index(),
    process_count=jax.process_count(),
)
