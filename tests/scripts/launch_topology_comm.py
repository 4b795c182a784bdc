"""``mpi4jax_dist.topology(comm)`` called twice with the same sub-communicator."""

from launch_common import describe, report
from mpi4py import MPI

import mpi4jax_dist

world = MPI.COMM_WORLD
comm = world.Split(world.Get_rank() // 2, world.Get_rank())
first = mpi4jax_dist.topology(comm)
fields = {"world_rank": world.Get_rank(), "first_size": first.size}
try:
    fields["again"] = "same" if mpi4jax_dist.topology(comm) == first else "different"
except Exception as err:
    fields["again"] = describe(err)
report(**fields)
