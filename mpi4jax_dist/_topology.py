"""The one-shot bootstrap: every MPI collective mpi4jax_dist makes lives here.

An ``Idup()`` of the job's communicator, waited on against a deadline, tells that
every rank arrived and gives a private communicator. On it, four collectives, each
O(log P) in time and O(1) in bytes per rank (no gather of hostnames):

1. ``Split_type(COMM_TYPE_SHARED)``: the ranks of this node -> local rank and size.
2. ``Split`` of the node leaders (local rank 0), ordered by rank -> node index and
   node count on the leaders.
3. ``Ibcast`` within each node of (node index, node count) from its leader.
4. ``Ibcast`` from rank 0 of the coordinator address (or of rank 0's error, so that
   a failure there raises on every rank instead of leaving them waiting).

The result is cached: JAX calls the cluster env four or five times per initialize,
and a second bootstrap on one rank while the others wait elsewhere would deadlock.

Then the release (``release()``): the other ranks must not contact the coordinator
before rank 0's service listens, or gRPC backs off for about a second. They wait in
one ``Ibarrier`` on the private communicator that a thread on rank 0 joins once its
port accepts connections. The private communicator is freed after it.

Every wait has a deadline; past it, the rank prints what it waited for and calls
``MPI_Abort``, which ends the job: a plain exception would leave ``MPI_Finalize``
waiting for the ranks that never came.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from . import _config, _launch, _network

# Fixed-size byte buffer for rank 0's answer: a status byte, then UTF-8 text. Big
# enough for "[IPv6]:port" and for an error message; fixed so that no rank needs a
# size first (one collective, O(1) bytes).
_MESSAGE_BYTES = 1024
_OK, _ERROR = 1, 2
# Rank 0 can release the others from a thread only where MPI allows a second thread
# to call it; its choice travels with the address (after the status byte).
_NO_RELEASE, _RELEASE = 0, 1
# JAX's own default for initialization_timeout.
DEFAULT_TIMEOUT_S = 300

logger = logging.getLogger("mpi4jax_dist")


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
    """One collective of the bootstrap, as counted for tests and diagnostics.

    ``phase``: ``arrival`` (the Idup every rank must reach), ``topology`` (what
    computes the topology and the coordinator) or ``release``.
    """

    name: str
    bytes_per_rank: int
    phase: str = "topology"


_lock = threading.Lock()
_comm = None  # the communicator chosen by initialize(comm=...); None: COMM_WORLD
_topology: Topology | None = None
_collectives: list[Collective] = []
# The private communicator, kept for the release where rank 0 can release the
# others from a thread (else None).
_private = None
_released = False
_reservation = None  # rank 0's socket holding the chosen port until JAX binds it
# time.perf_counter() when phases ended, for benchmarks/bootstrap.py.
timestamps: dict[str, float] = {}


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


def topology(
    comm=None, port: int | None = None, timeout_s: float | None = None
) -> Topology:
    """Return this process's :class:`Topology`, bootstrapping on first call.

    Args:
        comm: the communicator; default the one set by ``use_communicator``, else
            ``MPI.COMM_WORLD``. Collective on it the first time.
        port: the coordinator port; default ``JAX_COORDINATOR_PORT`` or a free one.
        timeout_s: how long to wait for the other ranks (default 300 s, JAX's
            ``initialization_timeout``); past it the job is aborted.

    Raises:
        RuntimeError: rank 0 could not choose a coordinator address (every rank
            raises the same message), or ``comm`` is not the bootstrap's communicator.
    """
    global _topology, _comm
    with _lock:
        if _topology is not None:
            if comm is not None:
                _check_same(comm)
            return _topology
        from mpi4py import MPI

        _comm = comm or _comm
        base = _comm or MPI.COMM_WORLD
        if port is None:
            port = _config.coordinator_port()
        timestamps["bootstrap_start"] = time.perf_counter()
        _topology = _bootstrap(base, port, timeout_s or DEFAULT_TIMEOUT_S)
        timestamps["bootstrap_done"] = time.perf_counter()
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


def _count(name: str, nbytes: int, phase: str = "topology") -> None:
    _collectives.append(Collective(name, nbytes, phase))


def abort(comm, message: str) -> None:
    """Print ``message`` for this rank and end the whole MPI job."""
    # Through logging (with no handler configured, Python prints it to stderr).
    logger.critical(
        "mpi4jax_dist: rank %d of %d: %s", comm.Get_rank(), comm.Get_size(), message
    )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    comm.Abort(1)


def wait(request, comm, deadline: float, what: str, timeout_s: float) -> None:
    """Wait for ``request`` until ``deadline`` (monotonic); abort the job past it."""
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            abort(
                comm,
                f"gave up after {timeout_s:g} s waiting for {what}. "
                f"Raise initialization_timeout if the job is just slow.",
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _check_launch_size(base, info) -> None:
    """Stop when the launcher started N ranks but MPI says otherwise."""
    from mpi4py import MPI

    if info is None or info.size is None:
        return
    if MPI.Comm.Compare(base, MPI.COMM_WORLD) != MPI.IDENT:
        return
    if base.Get_size() != info.size:
        from ._diagnose import mpi_library

        vendor = mpi_library()
        raise RuntimeError(
            f"The launcher ({info.launcher}) started {info.size} ranks but MPI says "
            f"this job has {base.Get_size()}: mpi4py talks to another MPI than the "
            f"mpiexec that started it (mpi4py uses: {vendor}). Start the job with the "
            f"mpiexec of that MPI, or rebuild mpi4py against the launcher's "
            f"(pip install --no-binary mpi4py mpi4py, with its mpicc on PATH)."
        )


def _bootstrap(base, port: int | None, timeout_s: float) -> Topology:
    global _private
    from mpi4py import MPI

    env = _config.environ()
    info = _launch.detect(env)
    launcher = info.launcher if info else "mpi"
    explicit_address = _config.coordinator_address(env)
    _check_launch_size(base, info)

    _collectives.clear()
    deadline = time.monotonic() + timeout_s
    # Private: our collectives never meet the user's traffic. Non-blocking, so that
    # a rank that never comes is noticed instead of waited for.
    comm, request = base.Idup()
    _count("Idup", 0, "arrival")
    wait(
        request,
        base,
        deadline,
        f"all {base.Get_size()} ranks to reach the bootstrap (some rank never "
        f"called jax.distributed.initialize or mpi4jax_dist)",
        timeout_s,
    )
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
            wait(
                node.Ibcast(node_info, root=0),
                comm,
                deadline,
                "this node's first rank to send the node index",
                timeout_s,
            )
            _count("Ibcast(node index, node count) within node", node_info.nbytes)
            node_index, num_nodes = (int(v) for v in node_info)
        finally:
            node.Free()

        message = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
        if rank == 0:
            status, text = _choose_coordinator(explicit_address, num_nodes, port)
            threads_ok = MPI.Query_thread() >= MPI.THREAD_SERIALIZED
            _encode(message, status, _RELEASE if threads_ok else _NO_RELEASE, text)
        wait(
            comm.Ibcast(message, root=0),
            comm,
            deadline,
            "rank 0 to send the coordinator address",
            timeout_s,
        )
        _count("Ibcast(coordinator address)", message.nbytes)
        status, release_flag, text = _decode(message)
        if status != _OK:
            raise RuntimeError(text)
        if release_flag == _RELEASE and size > 1:
            _private = comm
    finally:
        if _private is not comm:
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


def release(timeout_s: float | None = None, on_listening=None) -> None:
    """Hold the other ranks until rank 0's coordination service listens.

    Called where JAX asks for the coordinator address, before any rank connects.
    Rank 0 returns at once and starts a thread that polls its own port, then calls
    ``on_listening`` (JAX has read its settings by then) and joins an ``Ibarrier``;
    the other ranks wait in that ``Ibarrier``. Runs once per process.
    """
    global _released
    with _lock:
        if _released:
            return
        _released = True
    address = _topology.coordinator_address
    timeout_s = timeout_s or DEFAULT_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    comm = _private
    if _topology.rank == 0:
        threading.Thread(
            target=_when_listening,
            name="mpi4jax_dist-release",
            args=(comm, address, deadline, timeout_s, on_listening),
            daemon=True,
        ).start()
    elif comm is not None:
        _count("Ibarrier (coordinator listens)", 0, "release")
        wait(
            comm.Ibarrier(),
            comm,
            deadline,
            f"rank 0's JAX coordination service to listen on {address}",
            timeout_s,
        )
        comm.Free()


def _when_listening(
    comm, address: str, deadline: float, timeout_s: float, on_listening
) -> None:
    """Rank 0's thread: wait for the service, then release the ranks held in
    ``release`` (when ``comm`` is given; else nobody waits and a timeout is logged)."""
    host, port = _config.split_host_port(address, "coordinator address")
    pause = 1e-4
    while not _network.accepts(host, port):
        if time.monotonic() > deadline:
            message = (
                f"JAX's coordination service did not listen on {address} "
                f"within {timeout_s:g} s."
            )
            if comm is not None:
                abort(comm, message)
            logger.warning("mpi4jax_dist: %s", message)
            break
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    timestamps["service_listening"] = time.perf_counter()
    _release_port()
    if on_listening is not None:
        on_listening()
    if comm is not None:
        _count("Ibarrier (coordinator listens)", 0, "release")
        wait(
            comm.Ibarrier(),
            comm,
            deadline,
            "the other ranks to wait for the coordinator",
            timeout_s,
        )
        comm.Free()


def _release_port() -> None:
    """Close rank 0's hold on the coordinator port: JAX's service has it now."""
    global _reservation
    if _reservation is not None:
        _reservation.close()
        _reservation = None


def _choose_coordinator(explicit: str | None, num_nodes: int, port: int | None):
    """Return ``(status, text)``: the address, or the error every rank will raise."""
    global _reservation
    if explicit is not None:
        return _OK, explicit
    try:
        host = _network.coordinator_host(num_nodes, _config.interface())
        if port is None:
            _reservation = _network.reserve_port(host)
            port = _reservation.getsockname()[1]
        else:
            _network.check_port_free(host, port)
        return _OK, _network.format_address(host, port)
    except Exception as err:  # raised on every rank after the broadcast
        return _ERROR, f"rank 0 could not choose the coordinator address: {err}"


def _encode(buffer: np.ndarray, status: int, flag: int, text: str) -> None:
    data = text.encode()[: buffer.size - 2]
    buffer[0], buffer[1] = status, flag
    buffer[2 : 2 + len(data)] = np.frombuffer(data, dtype=np.uint8)


def _decode(buffer: np.ndarray) -> tuple[int, int, str]:
    text = bytes(buffer[2:]).rstrip(b"\0").decode(errors="replace")
    return int(buffer[0]), int(buffer[1]), text
