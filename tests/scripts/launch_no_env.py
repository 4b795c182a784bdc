"""A plain ``jax.distributed.initialize()`` where our env must not answer.

Used without a launcher (plain ``python``) with ``MPI4JAX_DIST_ONE_PROCESS=0``,
and under ``mpiexec`` with ``MPI4JAX_DIST_DISABLE=1``. Catches and reports JAX's
error, then calls ``mpi4jax_dist.initialize()`` explicitly (asking for our env by
name) and reports the world that gives.
"""

import jax
import jax._src.distributed as distributed
from launch_common import describe, jax_fields, report, topology_fields

import mpi4jax_dist

fields = {}
try:
    jax.distributed.initialize(initialization_timeout=30)
    fields["plain"] = "initialized"
except Exception as err:
    fields["plain"] = describe(err)
fields["initialized_after_plain"] = distributed.global_state.client is not None
fields["mpi_imported_after_plain"] = "mpi4py.MPI" in __import__("sys").modules

try:
    topo = mpi4jax_dist.initialize(initialization_timeout=60)
    fields["explicit"] = "initialized"
    fields.update(topology_fields(topo))
    fields.update(jax_fields())
except Exception as err:
    fields["explicit"] = describe(err)
report(**fields)
