"""The README's usage example: mpiexec -n 2 python examples/hello.py"""

import jax
import jax.numpy as jnp
import mpi4jax
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import mpi4jax_dist  # registers the MPI cluster env with JAX; starts nothing

jax.distributed.initialize()  # coordinator, process count and id from MPI
rank = MPI.COMM_WORLD.Get_rank()
assert jax.process_index() == rank

# The same sum two ways: mpi4jax on per-rank arrays, psum on a global array.
x = jnp.arange(4.0) + rank
by_mpi4jax = jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM))(x)

mesh = mpi4jax_dist.global_mesh()
try:
    from jax import shard_map
except ImportError:  # jax 0.6.0
    from jax.experimental.shard_map import shard_map
psum = shard_map(
    lambda a: jax.lax.psum(a, "ranks"),
    mesh=mesh,
    in_specs=P("ranks"),
    out_specs=P("ranks"),
)
by_psum = mpi4jax_dist.to_local(jax.jit(psum)(mpi4jax_dist.to_global(x, mesh)))

print(f"rank {rank}/{jax.process_count()}: {mpi4jax_dist.topology()}")
print(f"rank {rank}: mpi4jax {by_mpi4jax}, psum {by_psum}")
assert (by_mpi4jax == by_psum).all()
