"""``initialize`` and ``topology``: the explicit entry points."""

from __future__ import annotations

import sys

import jax

from .. import _compat, xla_mpi
from . import bootstrap, cluster, limits


def topology(comm=None) -> bootstrap.Topology:
    """Return where this process sits in the MPI job (bootstrapping on first call).

    Args:
        comm: an mpi4py communicator; default the one ``initialize`` used, else
            ``MPI.COMM_WORLD``. The first call is collective over it.

    Returns:
        The cached :class:`Topology`: rank, size, local rank and size, node index and
        count, coordinator address, launcher.

    Raises:
        TypeError: ``comm`` is not an mpi4py intracommunicator.

    Messages:
        .. code-block:: text

            TypeError: mpi4jax_dist.topology: comm must be an mpi4py
            intracommunicator (MPI.COMM_WORLD, or a Split of it) or None for
            MPI.COMM_WORLD; got <type>.
    """
    check_comm(comm, "topology")
    return bootstrap.topology(comm)


def initialize(comm=None, *, cpu_collectives=None, **kwargs) -> bootstrap.Topology:
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
            library loaded when jax was imported (see :mod:`mpi4jax_dist.xla_mpi`).
        **kwargs: passed to ``jax.distributed.initialize`` (``coordinator_address``,
            ``local_device_ids``, ``initialization_timeout``, ...); what is given
            there wins over what MPI says. ``initialization_timeout`` and
            ``heartbeat_timeout_seconds``, when not given, grow with the number of
            processes (:func:`mpi4jax_dist.launch.limits.timeouts`), and so do JAX's
            options ``jax_cpu_get_local_topology_timeout_minutes`` and
            ``jax_cpu_get_global_topology_timeout_minutes`` where they still hold
            JAX's defaults (:func:`mpi4jax_dist.launch.limits.topology_timeouts`).

    Raises:
        TypeError: ``comm`` is not an mpi4py intracommunicator.
        ValueError: ``cpu_collectives`` is neither of its values.
        RuntimeError: JAX's process index or count differs from the
            communicator's rank or size (JAX was initialized another way, or
            with other arguments); or MPI collectives were asked for and cannot
            work (quoted in docs/troubleshooting.rst and configuration.rst); or a
            second call
            asks for another communicator, port or timeout.

    Messages:
        .. code-block:: text

            TypeError: mpi4jax_dist.initialize: comm must be an mpi4py
            intracommunicator (MPI.COMM_WORLD, or a Split of it) or None for
            MPI.COMM_WORLD; got <type>.

            ValueError: cpu_collectives=<value>: expected 'mpi' or 'gloo'
            (or None for MPI4JAX_DIST_CPU_COLLECTIVES, else JAX's default).

            RuntimeError: mpi4jax_dist already bootstrapped on another
            communicator: one JAX world per process. Pass the same comm= to every
            call.

            RuntimeError: coordinator port <port> asked for, but this process
            already bootstrapped with the coordinator at <host:port>. Set
            JAX_COORDINATOR_PORT (or pass the port) before the first call, the
            same on every call.

            RuntimeError: initialization_timeout=<seconds> asked for, but this
            process already bootstraps with <seconds> s. Pass the same timeout to
            every call.
    """
    check_comm(comm, "initialize")
    initialized, _, _ = _compat.distributed_state()
    bootstrap.use_communicator(comm)
    if not initialized:
        xla_mpi.settle(cpu_collectives)
        size = _size(comm)
        if not _compat.backends_initialized():  # else JAX's own error follows
            _compat.raise_config_defaults(
                limits.topology_timeouts(size), limits.JAX_TOPOLOGY_TIMEOUTS
            )
        with cluster.explicitly_requested():
            jax.distributed.initialize(**jax_arguments(size, kwargs))
    topo = bootstrap.topology(comm)
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
    wanted = {"cluster_detection_method": cluster.Mpi4jaxDistCluster.name}
    wanted.update(limits.timeouts(size))
    arguments = dict(kwargs)
    for name, value in wanted.items():
        if _compat.initialize_accepts(name):
            arguments.setdefault(name, value)
    return arguments


def _size(comm) -> int:
    """The number of processes the JAX world will have."""
    from mpi4py import MPI

    current = bootstrap.current()
    if comm is None and current is not None:
        comm = current.comm
    return (MPI.COMM_WORLD if comm is None else comm).Get_size()


def _check_matches(topo: bootstrap.Topology) -> None:
    _, process_id, num_processes = _compat.distributed_state()
    if (process_id, num_processes) != (topo.rank, topo.size):
        raise RuntimeError(
            f"JAX's process index/count is {process_id}/{num_processes} but the MPI "
            f"rank/size is {topo.rank}/{topo.size}: JAX was initialized another way "
            f"or with explicit process_id/num_processes. Call "
            f"mpi4jax_dist.initialize() (or a plain jax.distributed.initialize() after "
            f"import mpi4jax_dist) before anything else initializes JAX."
        )
