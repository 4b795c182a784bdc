"""The one-shot bootstrap: every MPI collective mpi4jax_dist makes lives here.

On a private ``Dup()`` of the job's communicator, four collectives, each O(log P) in
time and O(1) in bytes per rank (no gather of hostnames):

1. ``Split_type(COMM_TYPE_SHARED)``: the ranks of this node -> local rank and size.
2. ``Split`` of the node leaders (local rank 0), ordered by rank -> node index and
   node count on the leaders.
3. ``Bcast`` within each node of (node index, node count) from its leader.
4. ``Bcast`` from rank 0 of the coordinator address (or of rank 0's error, so that
   a failure there raises on every rank instead of leaving them waiting).

The result is cached: JAX calls the cluster env four or five times per initialize,
and a second bootstrap on one rank while the others wait elsewhere would deadlock.
Everything created is freed before returning.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from . import _config, _launch, _network

# Fixed-size byte buffer for rank 0's answer: a status byte, then UTF-8 text. Big
# enough for "[IPv6]:port" and for an error message; fixed so that no rank needs a
# size first (one collective, O(1) bytes).
_MESSAGE_BYTES = 1024
_OK, _ERROR = 1, 2


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job, as MPI sees it.

    Attributes:
        rank, size: in the communicator JAX's world is made of (COMM_WORLD unless
            ``mpi4jax_dist.initialize(comm=...)`` says otherwise).
        local_rank, local_size: among the ranks that share this node.
        node_index, num_nodes: nodes numbered in order of their lowest rank.
        coordinator_address: ``host:port`` of rank 0's JAX coordination service.
        launcher: the launcher the environment names (``mpich-hydra``, ``openmpi``,
            ...), or ``mpi`` when MPI is up without one we know.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_index: int
    num_nodes: int
    coordinator_address: str
    launcher: str


@dataclass(frozen=True)
class Collective:
    """One collective of the bootstrap, as counted for tests and diagnostics."""

    name: str
    bytes_per_rank: int


_lock = threading.Lock()
_comm = None  # the communicator chosen by initialize(comm=...); None: COMM_WORLD
_topology: Topology | None = None
_collectives: list[Collective] = []


def use_communicator(comm) -> None:
    """Make the bootstrap run on ``comm`` (before it has run).

    Raises:
        RuntimeError: the bootstrap already ran on a different communicator.
    """
    global _comm
    with _lock:
        if _topology is not None:
            if comm is not None:
                _check_same(comm)
            return
        _comm = comm


def topology(comm=None, port: int | None = None) -> Topology:
    """Return this process's :class:`Topology`, bootstrapping on first call.

    Args:
        comm: the communicator; default the one set by ``use_communicator``, else
            ``MPI.COMM_WORLD``. Collective on it the first time.
        port: the coordinator port; default ``JAX_COORDINATOR_PORT`` or a free one.

    Raises:
        RuntimeError: rank 0 could not choose a coordinator address (every rank
            raises the same message), or ``comm`` is not the bootstrap's communicator.
    """
    global _topology
    with _lock:
        if _topology is not None:
            if comm is not None:
                _check_same(comm)
            return _topology
        from mpi4py import MPI

        base = comm or _comm or MPI.COMM_WORLD
        if port is None:
            port = _config.coordinator_port()
        _topology = _bootstrap(base, port)
        return _topology


def collectives() -> list[Collective]:
    """Return the collectives the bootstrap made, in order (empty before it ran)."""
    return list(_collectives)


def communicator():
    """Return the communicator the bootstrap ran on (or will run on)."""
    from mpi4py import MPI

    return _comm or MPI.COMM_WORLD


def _check_same(comm) -> None:
    from mpi4py import MPI

    used = _comm or MPI.COMM_WORLD
    if MPI.Comm.Compare(comm, used) not in (MPI.IDENT, MPI.CONGRUENT):
        raise RuntimeError(
            "mpi4jax_dist already bootstrapped on another communicator: one JAX "
            "world per process. Pass the same comm= to every call."
        )


def _count(name: str, nbytes: int) -> None:
    _collectives.append(Collective(name, nbytes))


def _bootstrap(base, port: int | None) -> Topology:
    from mpi4py import MPI

    env = _config.environ()
    info = _launch.detect(env)
    launcher = info.launcher if info else "mpi"
    explicit_address = _config.coordinator_address(env)

    _collectives.clear()
    comm = base.Dup()  # private: our collectives never meet the user's traffic
    try:
        rank, size = comm.Get_rank(), comm.Get_size()

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        _count("Split_type(COMM_TYPE_SHARED)", 4)
        try:
            local_rank, local_size = node.Get_rank(), node.Get_size()

            color = 0 if local_rank == 0 else MPI.UNDEFINED
            leaders = comm.Split(color, key=rank)
            _count("Split(node leaders)", 8)
            node_info = np.zeros(2, dtype=np.int64)
            if leaders != MPI.COMM_NULL:
                node_info[:] = leaders.Get_rank(), leaders.Get_size()
                leaders.Free()
            node.Bcast(node_info, root=0)
            _count("Bcast(node index, node count) within node", node_info.nbytes)
            node_index, num_nodes = (int(v) for v in node_info)
        finally:
            node.Free()

        message = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
        if rank == 0:
            _encode(message, *_choose_coordinator(explicit_address, num_nodes, port))
        comm.Bcast(message, root=0)
        _count("Bcast(coordinator address)", message.nbytes)
        status, text = _decode(message)
        if status != _OK:
            raise RuntimeError(text)
    finally:
        comm.Free()

    return Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_index=node_index,
        num_nodes=num_nodes,
        coordinator_address=text,
        launcher=launcher,
    )


def _choose_coordinator(explicit: str | None, num_nodes: int, port: int | None):
    """Return ``(status, text)``: the address, or the error every rank will raise."""
    if explicit is not None:
        return _OK, explicit
    try:
        host = _network.coordinator_host(num_nodes, _config.interface())
        if port is None:
            port = _network.free_port(host)
        return _OK, _network.format_address(host, port)
    except Exception as err:  # raised on every rank after the broadcast
        return _ERROR, f"rank 0 could not choose the coordinator address: {err}"


def _encode(buffer: np.ndarray, status: int, text: str) -> None:
    data = text.encode()[: buffer.size - 1]
    buffer[0] = status
    buffer[1 : 1 + len(data)] = np.frombuffer(data, dtype=np.uint8)


def _decode(buffer: np.ndarray) -> tuple[int, str]:
    return int(buffer[0]), bytes(buffer[1:]).rstrip(b"\0").decode(errors="replace")
