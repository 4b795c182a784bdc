"""Between per-rank arrays (what mpi4jax codes hold) and global ``jax.Array``\\ s.

After ``jax.distributed.initialize()`` through mpi4jax_dist, JAX's process index is
the MPI rank, so a mesh ordered by process index is ordered by rank: row block ``r``
of a global array lives on rank ``r``, as in the mpi4jax code it came from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from . import _jax_compat

DEFAULT_AXIS = "ranks"


def global_mesh(axis_name: str = DEFAULT_AXIS, axis_type: str = "auto"):
    """Return a 1-D Mesh over every device of the job, ordered by MPI rank.

    Args:
        axis_name: the mesh axis name ``shard_map``/``psum`` refer to.
        axis_type: ``"auto"`` (default; ``jax.scipy.sparse.linalg.cg`` and most
            existing code need it) or ``"explicit"``.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return _jax_compat.make_mesh(devices, axis_name, axis_type)


def _local_devices(mesh):
    me = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == me]


def to_global(local, mesh=None):
    """Return the global array whose row block ``rank`` is this rank's ``local``.

    Collective in spirit: every rank calls it with an array of the same shape and
    dtype; the result has shape ``(size * local.shape[0], *local.shape[1:])``,
    sharded along axis 0 over ``mesh`` (default :func:`global_mesh`). No data moves.

    Raises:
        ValueError: ``local`` is a scalar, or its rows do not split evenly over this
            process's devices.
    """
    mesh = global_mesh() if mesh is None else mesh
    local = jnp.asarray(local)
    if local.ndim == 0:
        raise ValueError(
            "to_global needs an array with a leading axis to shard; got a scalar."
        )
    devices = _local_devices(mesh)
    if local.shape[0] % len(devices):
        raise ValueError(
            f"to_global: {local.shape[0]} rows do not split evenly over this "
            f"process's {len(devices)} devices."
        )
    pieces = jnp.split(local, len(devices), axis=0)
    arrays = [jax.device_put(p, d) for p, d in zip(pieces, devices, strict=True)]
    rows = local.shape[0] * (mesh.devices.size // len(devices))
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    return jax.make_array_from_single_device_arrays(
        (rows, *local.shape[1:]), sharding, arrays
    )


def to_local(global_array):
    """Return this rank's row block of ``global_array`` as a local array.

    The inverse of :func:`to_global`. A replicated array gives the whole array.
    """
    blocks = {}
    for shard in global_array.addressable_shards:
        start = shard.index[0].start if shard.index else None
        blocks.setdefault(start or 0, shard.data)
    ordered = [blocks[k] for k in sorted(blocks)]
    return ordered[0] if len(ordered) == 1 else jnp.concatenate(ordered, axis=0)
