"""``initialize`` and ``topology``: the explicit entry points."""

from __future__ import annotations

import sys

import jax

from . import _cluster, _cpu_collectives, _jax_compat, _limits, _topology


def topology(comm=None) -> _topology.Topology:
    """Return where this process sits in the MPI job (bootstrapping on first call).

    Args:
        comm: an mpi4py communicator; default the one ``initialize`` used, else
            ``MPI.COMM_WORLD``. The first call is collective over it.

    Returns:
        The cached :class:`Topology`: rank, size, local rank and size, node index and
        count, coordinator address, launcher.

    Raises:
        TypeError: ``comm`` is not an mpi4py intracommunicator.
    """
    check_comm(comm, "topology")
    return _topology.topology(comm)


def initialize(comm=None, *, cpu_collectives=None, **kwargs) -> _topology.Topology:
    """Initialize JAX's distributed runtime from MPI; return the :class:`Topology`.

    Calls ``jax.distributed.initialize`` through the mpi4jax_dist cluster env, so
    that JAX's process index and count are the rank and size in ``comm``. Calling it
    again (or after a plain ``jax.distributed.initialize()`` that used this env)
    only checks and returns the topology.

    Args:
        comm: the communicator whose ranks form one JAX world (default
            ``MPI.COMM_WORLD``). A sub-communicator gives each group of ranks its
            own JAX world, e.g. ensembles of independent jobs in one MPI launch.
        cpu_collectives: ``"mpi"`` runs JAX's cross-process collectives on CPU
            (``psum`` and friends) over MPI, ``"gloo"`` over TCP (JAX's default);
            None takes ``MPI4JAX_DIST_CPU_COLLECTIVES``. MPI needs the wrapper
            library loaded when jax was imported (see ``_cpu_collectives``).
        **kwargs: passed to ``jax.distributed.initialize`` (``coordinator_address``,
            ``local_device_ids``, ``initialization_timeout``, ...); what is given
            there wins over what MPI says. ``initialization_timeout`` and
            ``heartbeat_timeout_seconds``, when not given, grow with the number of
            processes (:func:`mpi4jax_dist._limits.timeouts`), and so do JAX's
            options ``jax_cpu_get_local_topology_timeout_minutes`` and
            ``jax_cpu_get_global_topology_timeout_minutes`` where they still hold
            JAX's defaults (:func:`mpi4jax_dist._limits.topology_timeouts`).

    Raises:
        TypeError: ``comm`` is not an mpi4py intracommunicator.
        RuntimeError: JAX's process index or count differs from the communicator's
            rank or size (JAX was initialized another way, or with other
            arguments); or MPI collectives were asked for and cannot work.
    """
    check_comm(comm, "initialize")
    initialized, _, _ = _jax_compat.distributed_state()
    _topology.use_communicator(comm)
    if not initialized:
        _cpu_collectives.settle(cpu_collectives)
        size = _size(comm)
        if not _jax_compat.backends_initialized():  # else JAX's own error follows
            _jax_compat.raise_config_defaults(
                _limits.topology_timeouts(size), _limits.JAX_TOPOLOGY_TIMEOUTS
            )
        with _cluster.explicitly_requested():
            jax.distributed.initialize(**jax_arguments(size, kwargs))
    topo = _topology.topology(comm)
    _check_matches(topo)
    return topo


def check_comm(comm, function: str) -> None:
    """Raise ``TypeError`` unless ``comm`` is None or an mpi4py intracommunicator.

    Starts no MPI: a communicator can only exist once ``mpi4py.MPI`` is imported.
    """
    if comm is None:
        return
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and isinstance(comm, MPI.Intracomm):
        return
    got = "MPI.COMM_NULL" if MPI is not None and comm == MPI.COMM_NULL else None
    raise TypeError(
        f"mpi4jax_dist.{function}: comm must be an mpi4py intracommunicator "
        f"(MPI.COMM_WORLD, or a Split of it) or None for MPI.COMM_WORLD; got "
        f"{got or type(comm).__name__ + ' ' + repr(comm)[:40]}."
    )


def jax_arguments(size: int, kwargs: dict) -> dict:
    """Return ``kwargs`` for ``jax.distributed.initialize`` with what this JAX
    accepts filled in: our cluster env by name, and the timeouts for ``size``
    processes where the caller gave none."""
    wanted = {"cluster_detection_method": _cluster.Mpi4jaxDistCluster.name}
    wanted.update(_limits.timeouts(size))
    arguments = dict(kwargs)
    for name, value in wanted.items():
        if _jax_compat.initialize_accepts(name):
            arguments.setdefault(name, value)
    return arguments


def _size(comm) -> int:
    """The number of processes the JAX world will have."""
    from mpi4py import MPI

    bootstrap = _topology.current()
    if comm is None and bootstrap is not None:
        comm = bootstrap.comm
    return (MPI.COMM_WORLD if comm is None else comm).Get_size()


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
