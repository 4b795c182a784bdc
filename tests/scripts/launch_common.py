"""Shared by the launch_*.py scripts: one JSON line per rank, and cross-process checks.

Each script prints exactly one line ``RESULT {json}`` per rank;
tests/jobs/test_launch.py parses those lines.
"""

from __future__ import annotations

import json
import sys

PREFIX = "RESULT "


def report(**fields) -> None:
    """Print this rank's result line (flushed: ranks share one stdout)."""
    sys.stdout.write(PREFIX + json.dumps(fields, sort_keys=True) + "\n")
    sys.stdout.flush()


def describe(err: BaseException) -> str:
    """Return ``Type: message`` for an exception, on one line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def topology_fields(topo) -> dict:
    """Return a Topology as a dict of JSON-able fields."""
    import dataclasses

    return {f"topo_{k}": v for k, v in dataclasses.asdict(topo).items()}


def jax_fields() -> dict:
    """Return what JAX says about this process's world, after initialize."""
    import jax

    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "device_process_indices": sorted(d.process_index for d in jax.devices()),
    }


def cross_process_checks() -> dict:
    """Run computations that need every process of the JAX world; return results.

    * ``allgather``: ``process_allgather`` of each process index.
    * ``global_sum``: a jitted sum of the global array whose row ``i`` is ``i + 1``
      (built with ``to_global`` from one row per process).
    * ``psum``: ``shard_map`` + ``lax.psum`` of the same rows over the mesh axis.
    * ``roundtrip``: ``to_local(to_global(x))`` gives back ``x``.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import mpi4jax_dist
    from mpi4jax_dist import _compat

    me = jax.process_index()
    gathered = multihost_utils.process_allgather(np.array([me], dtype=np.int32))
    mesh = mpi4jax_dist.global_mesh()
    local = jnp.array([float(me + 1)], dtype=jnp.float32)
    global_array = mpi4jax_dist.to_global(local, mesh)
    total = jax.jit(jnp.sum)(global_array)
    summed = _compat.shard_map(
        lambda x: jax.lax.psum(x, "ranks"),
        mesh=mesh,
        in_specs=P("ranks"),
        out_specs=P(),
        check=True,
    )(global_array)
    back = mpi4jax_dist.to_local(global_array)
    return {
        "allgather": np.asarray(gathered).reshape(-1).tolist(),
        "global_shape": list(global_array.shape),
        "global_sum": float(np.asarray(total)),
        "psum": np.asarray(summed).reshape(-1).tolist(),
        "roundtrip": np.asarray(back).tolist() == np.asarray(local).tolist(),
        "mesh_process_order": [d.process_index for d in mesh.devices.flat],
    }
