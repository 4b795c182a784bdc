"""One script, any launch: what a NetKet-style user runs under ``mpiexec -n N`` and
as a plain ``python any_launch.py``, unchanged.

It initializes JAX through ``import mpi4jax_dist`` and a plain
``jax.distributed.initialize()``, then computes a global figure that does not depend
on the number of processes: the mean of ``sin(i)`` over i < 4096, each process
taking its block of rows and the blocks summed with ``shard_map`` + ``psum``.
Reports the figure, the world, the ClusterEnv JAX chose, whether MPI was started,
and which addresses this process listens on.
"""

import logging
import sys

import jax
import jax.numpy as jnp
import psutil
from jax.sharding import PartitionSpec as P
from launch_common import report

import mpi4jax_dist

N = 4096


class Chosen(logging.Handler):
    """Records the ClusterEnv JAX chose (its debug line names the class)."""

    name = None

    def emit(self, record):
        if record.getMessage().startswith("Initializing distributed JAX environment"):
            Chosen.name = record.args[0]


cluster_log = logging.getLogger("jax._src.clusters.cluster")
cluster_log.setLevel(logging.DEBUG)
cluster_log.addHandler(Chosen())

jax.distributed.initialize(initialization_timeout=60)
mesh = mpi4jax_dist.global_mesh()
count, me = jax.process_count(), jax.process_index()
rows = N // count
local = jnp.sin(jnp.arange(me * rows, (me + 1) * rows, dtype=jnp.float32))
try:
    from jax import shard_map
except ImportError:  # jax 0.6.0
    from jax.experimental.shard_map import shard_map
mean = shard_map(
    lambda x: jax.lax.psum(jnp.sum(x), "ranks") / N,
    mesh=mesh,
    in_specs=P("ranks"),
    out_specs=P(),
)(mpi4jax_dist.to_global(local, mesh))
listening = sorted(
    {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
)
report(
    process_index=me,
    process_count=count,
    mean=float(mean),
    cluster_env=Chosen.name,
    mpi_started="mpi4py.MPI" in sys.modules,
    listening=listening,
)
