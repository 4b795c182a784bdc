"""With peers: mpiexec -n 2 (and 4) python -m pytest --with-mpi.

Every rank runs every test; asserts gather the outcome first, so that one failing
rank does not leave the others waiting in the next collective.
"""

import numpy as np
import pytest
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import _topology

pytestmark = pytest.mark.mpi(min_size=2)


def test_topology_matches_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    topo = mpi4jax_dist.topology()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    expected = (comm.rank, comm.size, node.rank, node.size)
    node.Free()
    got = (topo.rank, topo.size, topo.local_rank, topo.local_size)
    all_ranks(got == expected, f"{got} != {expected}")
    addresses = comm.allgather(topo.coordinator_address)
    all_ranks(len(set(addresses)) == 1, f"coordinators differ: {addresses}")
    all_ranks(topo.num_nodes == 1 and topo.node_index == 0, str(topo))
    all_ranks(topo.coordinator_address.startswith("127.0.0.1:"), str(topo))
    all_ranks(topo.launcher == "mpich-hydra" or topo.launcher != "mpi", topo.launcher)


def test_bootstrap_collectives_few_and_small():
    from mpi4py import MPI

    mpi4jax_dist.topology()
    made = _topology.collectives()
    lists = MPI.COMM_WORLD.allgather(made)
    all_ranks(all(m == lists[0] for m in lists), f"ranks disagree: {lists}")
    phases = [c.phase for c in made]
    # The arrival Idup, then at most four that compute the topology and coordinator.
    all_ranks(phases[0] == "arrival" and phases.count("arrival") == 1, str(made))
    all_ranks(0 < phases.count("topology") <= 4, f"{len(made)} collectives: {made}")
    all_ranks(all(c.bytes_per_rank <= 1024 for c in made), str(made))


def test_initialize_gives_mpi_rank(world):
    import jax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    got = (jax.process_index(), jax.process_count(), jax.device_count())
    all_ranks(got == (comm.rank, comm.size, comm.size), f"{got}")
    all_ranks(world == mpi4jax_dist.topology(), f"{world}")
    # Idempotent: a second call checks and returns the same topology.
    all_ranks(mpi4jax_dist.initialize() is world, "second initialize differs")


def test_global_mesh_in_rank_order(world):
    mesh = mpi4jax_dist.global_mesh()
    owners = [d.process_index for d in mesh.devices.flat]
    all_ranks(owners == list(range(world.size)), f"mesh order {owners}")
    assert mesh.axis_names == ("ranks",)


def test_psum_equals_mpi4jax_allreduce(world):
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    from mpi4jax_dist import _jax_compat

    mesh = mpi4jax_dist.global_mesh()
    local = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) * (world.rank + 1)

    summed = jax.jit(
        _jax_compat.shard_map(
            lambda a: jax.lax.psum(a, "ranks"),
            mesh=mesh,
            in_specs=P("ranks"),
            out_specs=P("ranks"),
        )
    )(mpi4jax_dist.to_global(local, mesh))
    by_psum = np.asarray(mpi4jax_dist.to_local(summed))
    by_mpi4jax = np.asarray(jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM))(local))
    expected = np.arange(6.0).reshape(2, 3) * sum(range(1, world.size + 1))
    all_ranks(np.array_equal(by_psum, by_mpi4jax), f"{by_psum} != {by_mpi4jax}")
    all_ranks(np.array_equal(by_psum, expected), f"{by_psum} != {expected}")


def test_to_global_and_back(world):
    import jax
    import jax.numpy as jnp

    local = jnp.full((3, 2), world.rank, dtype=jnp.int32)
    g = mpi4jax_dist.to_global(local)
    all_ranks(g.shape == (3 * world.size, 2), f"shape {g.shape}")
    # Row block r of the global array is rank r's data: its row sums say so.
    rows = jax.jit(lambda a: a.sum(axis=1), out_shardings=None)(g)
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
    expected = np.repeat(np.arange(world.size) * 2, 3)
    all_ranks(np.array_equal(every, expected), f"{every} != {expected}")
    back = np.asarray(mpi4jax_dist.to_local(g))
    all_ranks(np.array_equal(back, np.asarray(local)), f"{back}")
