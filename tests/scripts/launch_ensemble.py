"""Ensembles: ``COMM_WORLD.Split(rank // group)``, one JAX world per group.

Usage: python launch_ensemble.py [group_size]   (default 2)
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
from mpi4py import MPI

import mpi4jax_dist

group = int(sys.argv[1]) if len(sys.argv) > 1 else 2
world = MPI.COMM_WORLD
comm = world.Split(world.Get_rank() // group, world.Get_rank())
topo = mpi4jax_dist.initialize(comm=comm)
fields = dict(
    world_rank=world.Get_rank(),
    world_size=world.Get_size(),
    color=world.Get_rank() // group,
    comm_rank=comm.Get_rank(),
    comm_size=comm.Get_size(),
    jax_coordinator=jax._src.distributed.global_state.coordinator_address,
    **topology_fields(topo),
    **jax_fields(),
    **cross_process_checks(),
)
for name, call in (
    ("reinit", lambda: mpi4jax_dist.initialize(comm=comm)),
    ("topology_comm", lambda: mpi4jax_dist.topology(comm)),
):
    try:
        fields[name] = "same" if call() == topo else "different"
    except Exception as err:
        fields[name] = describe(err)
report(**fields)
