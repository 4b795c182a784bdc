"""``initialize`` and ``topology``: the explicit entry points."""

from __future__ import annotations

import jax

from . import _cluster, _jax_compat, _topology


def topology(comm=None) -> _topology.Topology:
    """Return where this process sits in the MPI job (bootstrapping on first call).

    Args:
        comm: an mpi4py communicator; default the one ``initialize`` used, else
            ``MPI.COMM_WORLD``. The first call is collective over it.

    Returns:
        The cached :class:`Topology`: rank, size, local rank and size, node index and
        count, coordinator address, launcher.
    """
    return _topology.topology(comm)


def initialize(comm=None, **kwargs) -> _topology.Topology:
    """Initialize JAX's distributed runtime from MPI; return the :class:`Topology`.

    Calls ``jax.distributed.initialize`` through the mpi4jax_dist cluster env, so
    that JAX's process index and count are the rank and size in ``comm``. Calling it
    again (or after a plain ``jax.distributed.initialize()`` that used this env)
    only checks and returns the topology.

    Args:
        comm: the communicator whose ranks form one JAX world (default
            ``MPI.COMM_WORLD``). A sub-communicator gives each group of ranks its
            own JAX world, e.g. ensembles of independent jobs in one MPI launch.
        **kwargs: passed to ``jax.distributed.initialize`` (``coordinator_address``,
            ``local_device_ids``, ``initialization_timeout``, ...); what is given
            there wins over what MPI says.

    Raises:
        RuntimeError: JAX's process index or count differs from the communicator's
            rank or size (JAX was initialized another way, or with other arguments).
    """
    initialized, _, _ = _jax_compat.distributed_state()
    _topology.use_communicator(comm)
    if not initialized:
        if _jax_compat.detection_accepts_name():
            kwargs.setdefault(
                "cluster_detection_method", _cluster.Mpi4jaxDistCluster.name
            )
        with _cluster.explicitly_requested():
            jax.distributed.initialize(**kwargs)
    topo = _topology.topology(comm)
    _check_matches(topo)
    return topo


def _check_matches(topo: _topology.Topology) -> None:
    _, process_id, num_processes = _jax_compat.distributed_state()
    if (process_id, num_processes) != (topo.rank, topo.size):
        raise RuntimeError(
            f"JAX's process index/count is {process_id}/{num_processes} but the MPI "
            f"rank/size is {topo.rank}/{topo.size}: JAX was initialized another way "
            f"or with explicit process_id/num_processes. Call "
            f"mpi4jax_dist.initialize() (or a plain jax.distributed.initialize() after "
            f"import mpi4jax_dist) before anything else initializes JAX."
        )
