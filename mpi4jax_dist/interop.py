"""Between per-rank arrays (what mpi4jax codes hold) and global ``jax.Array``\\ s.

After ``jax.distributed.initialize()`` through mpi4jax_dist, JAX's process index is
the MPI rank, so a mesh ordered by process index is ordered by rank: row block ``r``
of a global array lives on rank ``r``, as in the mpi4jax code it came from.
"""

from __future__ import annotations

import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat
from .launch import bootstrap

DEFAULT_AXIS = "ranks"


def global_mesh(axis_name: str = DEFAULT_AXIS, axis_type: str = "auto"):
    """Return a 1-D Mesh over every device of the job, ordered by MPI rank.

    Args:
        axis_name: the mesh axis name ``shard_map``/``psum`` refer to.
        axis_type: ``"auto"`` (default; ``jax.scipy.sparse.linalg.cg`` and most
            existing code need it) or ``"explicit"``, or JAX's own
            ``jax.sharding.AxisType.Auto``/``.Explicit``.

    Raises:
        TypeError: ``axis_name`` is not a non-empty string.
        ValueError: ``axis_type`` is none of those, or this JAX has no axis
            types.

    Messages:
        .. code-block:: text

            TypeError: global_mesh: axis_name must be a non-empty string
            (the name shard_map and psum refer to); got <value>.

            ValueError: axis_type=<value>: expected 'auto' or 'explicit' (or
            jax.sharding.AxisType.Auto or .Explicit).

            ValueError: axis_type=<value> needs jax >= 0.6 with
            jax.sharding.AxisType.
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(
            f"global_mesh: axis_name must be a non-empty string (the name "
            f"shard_map and psum refer to); got {axis_name!r}."
        )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return _compat.make_mesh(devices, axis_name, axis_type)


def _local_devices(mesh):
    me = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == me]


def to_global(local, mesh=None, *, check: bool = True):
    """Return the global array whose row block ``rank`` is this rank's ``local``.

    Collective: every rank calls it with an array of the same shape and dtype; the
    result has shape ``(size * local.shape[0], *local.shape[1:])``, sharded along
    axis 0 over ``mesh`` (default :func:`global_mesh`). No data moves.

    Args:
        local: this rank's array (NumPy, JAX, or anything ``jnp.asarray`` takes).
        mesh: a ``jax.sharding.Mesh`` whose first axis runs over the ranks.
        check: compare the shape and dtype over the ranks first: one MPI
            allreduce of 16 bytes (O(log P)); ``False`` skips it in hot paths.

    Raises:
        TypeError: ``mesh`` is not a ``Mesh``, or ``local`` is not an array.
        ValueError: ``local`` is a scalar, its rows do not split evenly over
            this process's devices, or (on every rank) the ranks' shapes or
            dtypes differ.

    Messages:
        .. code-block:: text

            TypeError: to_global: mesh must be a jax.sharding.Mesh (such as
            mpi4jax_dist.global_mesh()) or None; got <type>.

            TypeError: to_global: local must be an array (NumPy, JAX or a
            nested list of numbers); got <type>: <error>

            ValueError: to_global needs an array with a leading axis to
            shard; got a scalar.

            ValueError: to_global: <n> rows do not split evenly over this
            process's <n> devices.

            ValueError: to_global: the ranks' local arrays differ in shape
            or dtype (rank <rank> of <size> has <shape> <dtype>); every rank
            must pass the same shape and dtype.
    """
    if mesh is None:
        mesh = global_mesh()
    elif not isinstance(mesh, Mesh):
        raise TypeError(
            f"to_global: mesh must be a jax.sharding.Mesh (such as "
            f"mpi4jax_dist.global_mesh()) or None; got {type(mesh).__name__}."
        )
    try:
        local = jnp.asarray(local)
    except TypeError as err:
        raise TypeError(
            f"to_global: local must be an array (NumPy, JAX or a nested list of "
            f"numbers); got {type(local).__name__}: {err}"
        ) from None
    if check:
        _check_same_everywhere(local)
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


def _check_same_everywhere(local) -> None:
    """Raise ``ValueError`` on every rank unless every rank's ``local`` has the same
    shape and dtype: one allreduce (MIN) of a 62-bit digest and its negation."""
    comm = _world_comm()
    if comm is None or comm.Get_size() == 1:
        return
    from mpi4py import MPI

    text = f"{tuple(local.shape)}|{local.dtype.name}".encode()
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2
    mine = np.array([digest, -digest], dtype=np.int64)
    extremes = np.empty_like(mine)
    comm.Allreduce(mine, extremes, op=MPI.MIN)
    if extremes[0] != -extremes[1]:
        raise ValueError(
            f"to_global: the ranks' local arrays differ in shape or dtype (rank "
            f"{comm.Get_rank()} of {comm.Get_size()} has {tuple(local.shape)} "
            f"{local.dtype.name}); every rank must pass the same shape and dtype."
        )


def _world_comm():
    """The communicator of JAX's world: the bootstrap's, else COMM_WORLD when it
    matches JAX's process count, else None (nothing to check against)."""
    current = bootstrap.current()
    if current is not None:
        return current.comm
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    if MPI.COMM_WORLD.Get_size() != jax.process_count():
        return None
    return MPI.COMM_WORLD


def to_local(global_array):
    """Return this rank's row block of ``global_array`` as a local array.

    The inverse of :func:`to_global`. A replicated array gives the whole array.

    Raises:
        TypeError: ``global_array`` is not a ``jax.Array``.

    Messages:
        .. code-block:: text

            TypeError: to_local: global_array must be a jax.Array (from
            to_global, or a computation on one); got <type>. A NumPy array
            is already local.
    """
    if not isinstance(global_array, jax.Array):
        raise TypeError(
            f"to_local: global_array must be a jax.Array (from to_global, or a "
            f"computation on one); got {type(global_array).__name__}. A NumPy "
            f"array is already local."
        )
    blocks = {}
    for shard in global_array.addressable_shards:
        start = shard.index[0].start if shard.index else None
        blocks.setdefault(start or 0, shard.data)
    ordered = [blocks[k] for k in sorted(blocks)]
    return ordered[0] if len(ordered) == 1 else jnp.concatenate(ordered, axis=0)
