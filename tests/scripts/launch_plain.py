"""``import mpi4jax_dist`` then initialize JAX, report the world, compute across it.

Usage: python launch_plain.py [jax|api]
    jax (default): a plain ``jax.distributed.initialize()``.
    api: ``mpi4jax_dist.initialize()``.
Afterwards calls ``mpi4jax_dist.initialize()`` (again) and reports whether that
idempotent call returned the same topology (``reinit``).
"""

import sys

import jax
from launch_common import (
    cross_process_checks,
    describe,
    jax_fields,
    report,
    topology_fields,
)

import mpi4jax_dist  # noqa: E402  (registers the cluster env)
from mpi4jax_dist.launch import bootstrap

mode = sys.argv[1] if len(sys.argv) > 1 else "jax"
if mode == "jax":
    jax.distributed.initialize()
    returned = None
elif mode == "api":
    returned = mpi4jax_dist.initialize()
else:
    raise SystemExit(f"unknown mode {mode!r}")

from mpi4py import MPI  # noqa: E402  (already initialized by the bootstrap)

topo = mpi4jax_dist.topology()
fields = dict(
    mode=mode,
    mpi_rank=MPI.COMM_WORLD.Get_rank(),
    mpi_size=MPI.COMM_WORLD.Get_size(),
    returned_is_topology=None if returned is None else returned == topo,
    jax_coordinator=jax._src.distributed.global_state.coordinator_address,
    thread_level=MPI.Query_thread(),
    release=bootstrap.current().release_mode,
    **topology_fields(topo),
    **jax_fields(),
    **cross_process_checks(),
)
try:
    again = mpi4jax_dist.initialize()
    fields["reinit"] = "same" if again == topo else f"different: {again}"
except Exception as err:  # reported, asserted on by the test
    fields["reinit"] = describe(err)
report(**fields)
