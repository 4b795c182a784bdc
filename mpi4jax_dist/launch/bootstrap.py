"""The bootstrap: every MPI call mpi4jax_dist makes to set up JAX lives here.

A :class:`Bootstrap` runs once per process: arrival (a non-blocking ``Idup``,
waited on against a deadline), the topology on that private communicator (node
split, node numbers by scan and allreduce, rank 0's answer by broadcast:
mpi4jax_dist/launch/wire.py), and the release that holds the other ranks until rank
0's coordination service listens (mpi4jax_dist/launch/coordinator.py watches its
port). Every call goes through one recording communicator, whose log is what
``python -m mpi4jax_dist --check --verbose`` prints; every wait has a deadline,
past which the job is aborted with one line. docs/design.rst, *The bootstrap's MPI
calls*.
"""

from __future__ import annotations

import logging
import threading
import time
import typing
from dataclasses import dataclass, field

import numpy as np

from .. import _config, _mpi
from ..faults import failfast
from ..faults import settings as fault_settings
from . import coordinator, detect, limits, network, wire

# JAX's own default for initialization_timeout.
DEFAULT_TIMEOUT_S = 300
# Rank 0's choice of the coordinator: (status, text), in wire.py's statuses.
_OK, _ERROR = wire.OK, wire.ERROR

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


@dataclass
class Bootstrap:
    """One process's bootstrap and release; everything it holds is an attribute.

    Attributes:
        comm: the communicator JAX's world is made of (``MPI.COMM_WORLD`` unless
            ``mpi4jax_dist.initialize(comm=...)`` chose another).
        port: the coordinator port asked for (None: rank 0 picks a free one).
        timeout_s: the deadline of every wait, in seconds.
        timeout_explicit: whether someone asked for ``timeout_s`` (else JAX's
            default, which a later explicit request may still set).
        topology: the result, None until :meth:`run` has run.
        release_mode: ``"thread"`` or ``"probe"`` (docs/design.rst); None
            for a job of one rank, which needs no release.
        released: whether :meth:`release` has run.
        file_limit_raised: on rank 0, ``(old, new)`` soft open-file limit when the
            bootstrap raised it for the coordination service, else None.
        fault_settings: the collective and hang timeouts
            (:class:`~mpi4jax_dist.faults.settings.JobSettings`), this process's
            until rank 0's arrive with the coordinator address, rank 0's after: no
            wait here lasts longer than the collective timeout.
        setting_error: where one of this process's fault settings is bad, the
            error (rank 0's is every rank's; another rank's value is never used).
        log: every MPI call made, as it ran (:class:`~mpi4jax_dist._mpi.CallLog`).
        timestamps: ``time.perf_counter()`` where phases ended (``bootstrap_done``;
            rank 0's ``service_listening``; the others' ``released``).
    """

    comm: object
    port: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    timeout_explicit: bool = False
    topology: Topology | None = None
    release_mode: str | None = None
    released: bool = False
    file_limit_raised: tuple | None = None
    fault_settings: fault_settings.JobSettings = field(init=False)
    setting_error: str | None = field(init=False)
    log: _mpi.CallLog = field(default_factory=_mpi.CallLog)
    timestamps: dict = field(default_factory=dict)
    # Kept from run() for release(): the private communicator (thread mode), the
    # node's communicator (probe mode, nodes other than rank 0's), and rank 0's
    # socket holding the chosen port until JAX's service binds it.
    _private: object = None
    _node: object = None
    _reservation: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.fault_settings, self.setting_error = fault_settings.this_process()

    def check_settings(self, comm=None, port=None, timeout_s=None) -> None:
        """Raise when a later call asks for other settings than this bootstrap's.

        A communicator must be the same (or congruent); a port must be the
        coordinator's; a timeout must be the one asked for first, unless the first
        call asked for none (JAX's default): then the new one rules the waits still
        ahead (the release).

        Raises:
            RuntimeError: naming what was asked and what this process already uses.
        """
        from mpi4py import MPI

        if comm is not None and MPI.Comm.Compare(comm, self.comm) not in (
            MPI.IDENT,
            MPI.CONGRUENT,
        ):
            raise RuntimeError(
                "mpi4jax_dist already bootstrapped on another communicator: one JAX "
                "world per process. Pass the same comm= to every call."
            )
        if port is not None and self.topology is not None:
            _, chosen = _config.split_host_port(
                self.topology.coordinator_address, "coordinator address"
            )
            if port != chosen:
                raise RuntimeError(
                    f"coordinator port {port} asked for, but this process already "
                    f"bootstrapped with the coordinator at "
                    f"{self.topology.coordinator_address}. Set "
                    f"{_config.COORDINATOR_PORT} (or pass the port) before the first "
                    f"call, the same on every call."
                )
        if timeout_s is not None and timeout_s != self.timeout_s:
            if self.timeout_explicit:
                raise RuntimeError(
                    f"initialization_timeout={timeout_s:g} asked for, but this "
                    f"process already bootstraps with {self.timeout_s:g} s. Pass the "
                    f"same timeout to every call."
                )
            self.timeout_s, self.timeout_explicit = float(timeout_s), True

    # --- bootstrap ------------------------------------------------------------------

    def run(self) -> Topology:
        """Compute the topology and the coordinator (collective over ``comm``)."""
        from mpi4py import MPI

        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        failfast.quiet_on_other_ranks(rank)
        env = _config.environ()
        info = detect.detect(env)
        _check_launch_size(self.comm, info)

        deadline = time.monotonic() + self.timeout_s
        self.log.phase = "arrival"
        # Non-blocking, so that a rank that never comes is noticed, not waited for.
        comm, request = _mpi.RecordingComm(self.comm, self.log).Idup()
        self._wait(
            request,
            deadline,
            f"all {size} ranks to reach the bootstrap (some rank "
            f"never called jax.distributed.initialize or mpi4jax_dist)",
        )
        node = None
        self.log.phase = "topology"
        try:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            local_rank, local_size = node.Get_rank(), node.Get_size()
            node_index, num_nodes = self._node_numbers(comm, node, local_rank, deadline)
            explicit = _config.coordinator_address(env)
            address = self._answer(comm, rank, size, explicit, num_nodes, deadline)
            # Kept for the release: the private communicator in thread mode; in
            # probe mode the node's, where a leader other than rank 0 releases it.
            if self.release_mode == "thread":
                self._private, comm = comm, None
            if self.release_mode == "probe" and node_index > 0 and local_size > 1:
                self._node, node = node, None
        finally:
            for unused in (node, comm):
                if unused is not None:
                    unused.Free()
        self.topology = Topology(
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            node_index=node_index,
            num_nodes=num_nodes,
            coordinator_address=address,
            launcher=info.launcher if info else "mpi",
        )
        self.timestamps["bootstrap_done"] = time.perf_counter()
        return self.topology

    def _node_numbers(self, comm, node, local_rank, deadline) -> tuple[int, int]:
        """Return (node index, node count): node leaders (local rank 0) count the
        leaders below them (an exclusive scan) and all of them (an allreduce), both
        posted at once; then one broadcast within the node.

        Nodes are numbered in order of their lowest rank. A ``Split`` of the leaders
        gives the same numbers, but MPICH's gathers every rank's color and key:
        O(P) bytes per rank against O(1) here, and it cannot be waited on with a
        deadline.
        """
        from mpi4py import MPI

        leader = np.array([1 if local_rank == 0 else 0], dtype=np.int64)
        below = np.zeros(1, dtype=np.int64)
        count = np.zeros(1, dtype=np.int64)
        scan = comm.Iexscan(leader, below, op=MPI.SUM)
        total = comm.Iallreduce(leader, count, op=MPI.SUM)
        what = "every rank to count the nodes"
        self._wait(scan, deadline, what)
        self._wait(total, deadline, what)
        # MPI leaves rank 0's exclusive scan undefined: nothing is below it.
        numbers = np.array([0 if comm.Get_rank() == 0 else below[0], count[0]])
        self._wait(
            node.Ibcast(numbers, root=0),
            deadline,
            "this node's first rank to send the node index",
        )
        return int(numbers[0]), int(numbers[1])

    def _answer(self, comm, rank, size, explicit, num_nodes, deadline) -> str:
        """Broadcast rank 0's answer (wire.py): every rank takes its release mode
        and fault settings, and returns its coordinator address.

        Raises:
            failfast.JobValueError: rank 0's fault setting is bad.
            failfast.JobError: rank 0 could not choose the coordinator address.
        """
        from mpi4py import MPI

        message = wire.buffer()
        if rank == 0:
            threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
            if self.setting_error:
                status, text = wire.BAD_SETTING, self.setting_error
            else:
                status, text = self._choose_coordinator(explicit, num_nodes, size)
            mode = "thread" if threads else "probe"
            carried = self.fault_settings.pack()
            wire.encode(message, wire.Message(status, mode, text, carried))
        self._wait(
            comm.Ibcast(message, root=0),
            deadline,
            "rank 0 to send the coordinator address",
        )
        status, mode, text, carried = wire.decode(message)
        if status == wire.BAD_SETTING:
            raise failfast.JobValueError(text)
        if status != wire.OK:
            raise failfast.JobError(text)
        # Another rank's own bad value is not used: rank 0's rules, as any.
        # Rank 0's: every rank then makes (or skips) the watchdog's Dup alike.
        self.fault_settings = fault_settings.JobSettings.unpack(carried)
        if size > 1:
            self.release_mode = mode
        return text

    def _choose_coordinator(self, explicit, num_nodes, size):
        """Return ``(status, text)``: the address, or the error every rank raises.

        First rank 0's open-file limit, raised to the hard one where its
        coordination service would run out (one connection per process).
        """
        try:
            self.file_limit_raised = limits.ensure_file_limit(size)
        except RuntimeError as err:
            return _ERROR, str(err)
        if explicit is not None:
            return _OK, explicit
        try:
            host = network.coordinator_host(num_nodes, _config.interface())
            port = self.port
            if port is None:
                self._reservation = network.reserve_port(host)
                port = self._reservation.getsockname()[1]
            else:
                network.check_port_free(host, port)
            return _OK, network.format_address(host, port)
        except Exception as err:  # raised on every rank after the broadcast
            return _ERROR, f"rank 0 could not choose the coordinator address: {err}"

    # --- release --------------------------------------------------------------------

    def release(self, on_listening=None) -> None:
        """Hold the other ranks until rank 0's coordination service listens.

        Called where JAX asks for the coordinator address, before any rank
        connects. Rank 0 returns at once and starts a thread that waits for its own
        port to accept, closes the port's reservation, calls ``on_listening`` (JAX
        has read its settings by then) and, in thread mode, joins the ``Ibarrier``
        the other ranks wait in. Runs once per process.
        """
        with self._lock:
            if self.released:
                return
            self.released = True
        deadline = time.monotonic() + self.timeout_s
        self.log.phase = "release"
        if self.topology.rank == 0:
            threading.Thread(
                target=self._when_listening,
                name="mpi4jax_dist-release",
                args=(deadline, on_listening),
                daemon=True,
            ).start()
            return
        waiting_for = (
            f"rank 0's JAX coordination service to listen on "
            f"{self.topology.coordinator_address}"
        )
        if self.release_mode == "thread":
            self._release_by_barrier(deadline, waiting_for)
        elif self.release_mode == "probe":
            self._release_by_probing(deadline, waiting_for)
        self.timestamps["released"] = time.perf_counter()

    def _when_listening(self, deadline: float, on_listening) -> None:
        """Rank 0's thread: wait for the service, then release the others."""
        address = self.topology.coordinator_address
        if coordinator.listening(address, deadline) is not None:
            message = (
                f"JAX's coordination service did not listen on "
                f"{address} within {self.timeout_s:g} s."
            )
            if self.release_mode == "thread":
                self._abort(message)
            logger.warning("mpi4jax_dist: %s", message)
        self.timestamps["service_listening"] = time.perf_counter()
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None
        if on_listening is not None:
            on_listening()
        if self.release_mode == "thread":
            self._wait(
                self._private.Ibarrier(),
                deadline,
                "the other ranks to join the barrier that tells them the "
                "coordinator listens",
            )
            self._private.Free()
            self._private = None

    def _release_by_barrier(self, deadline: float, waiting_for: str) -> None:
        """Thread mode: wait in the barrier rank 0's thread joins once its service
        listens; then a node leader other than rank 0's checks, in a thread of its
        own, that its node reaches the service (:meth:`_check_reachable`)."""
        self._wait(self._private.Ibarrier(), deadline, waiting_for)
        self._private.Free()
        self._private = None
        if self.topology.node_index > 0 and self.topology.local_rank == 0:
            threading.Thread(
                target=self._check_reachable,
                name="mpi4jax_dist-reach",
                daemon=True,
            ).start()

    def _release_by_probing(self, deadline: float, waiting_for: str) -> None:
        """Probe mode: the node's leader (every rank on rank 0's node) probes rank
        0's port, then releases the node's other ranks with a barrier."""
        if self._node is None or self.topology.local_rank == 0:
            self._probe(deadline, waiting_for)
        if self._node is not None:
            self._wait(self._node.Ibarrier(), deadline, waiting_for)
            self._node.Free()
            self._node = None

    def _probe(self, deadline: float, waiting_for: str) -> None:
        """Poll rank 0's port until it accepts (:func:`coordinator.probe`); abort
        the job past ``deadline``, or once attempts went unanswered, saying which."""
        topo = self.topology
        address = topo.coordinator_address
        why = coordinator.probe(address, deadline, topo.num_nodes + topo.local_size)
        if why is None:
            return
        if why.startswith(network.REFUSED):  # reached, but nothing listened
            self._give_up(waiting_for)
        where = "where rank 0's service is to listen"
        self._abort(coordinator.unreachable(address, why, where))

    def _check_reachable(self) -> None:
        """A node leader's thread, once rank 0's service listens: connect to it
        once (:func:`coordinator.reach`), and end the job saying so when this node
        cannot reach it."""
        address = self.topology.coordinator_address
        why = coordinator.reach(address, self.timeout_s)
        if why is not None:
            where = "where rank 0's service listens"
            self._abort(coordinator.unreachable(address, why, where))

    def duplicate(self, phase: str, comm=None):
        """Return a ``Dup`` of ``comm`` (default: the job's communicator), recorded
        in :attr:`log` under ``phase``. Collective on ``comm``."""
        self.log.phase = phase
        return _mpi.RecordingComm(comm or self.comm, self.log).Dup().comm

    # --- waiting and failing --------------------------------------------------------

    def _wait(self, request, deadline: float, what: str) -> None:
        """Wait for ``request`` until ``deadline`` (monotonic), or for the
        collective timeout where it comes first; abort past it."""
        pause = 1e-5
        limit = self.fault_settings.collective_timeout_s
        collective = None if limit is None else time.monotonic() + limit
        while not request.Test():
            now = time.monotonic()
            if collective is not None and now > collective and collective < deadline:
                self._timed_out(what)
            if now > deadline:
                self._give_up(what)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _give_up(self, what: str) -> typing.NoReturn:
        """Abort the job: this rank waited ``timeout_s`` for ``what``."""
        self._abort(
            f"gave up after {self.timeout_s:g} s waiting for {what}. "
            f"Raise initialization_timeout if the job is just slow."
        )

    def _timed_out(self, what: str) -> typing.NoReturn:
        """Abort the job: this rank waited the collective timeout for ``what``."""
        self._abort(
            f"gave up after {self.fault_settings.collective_timeout_s:g} s "
            f"({_config.COLLECTIVE_TIMEOUT}) waiting for {what} in the bootstrap. "
            f"Raise {_config.COLLECTIVE_TIMEOUT} if the job is just slow."
        )

    def _abort(self, message: str) -> typing.NoReturn:
        """Print ``message`` for this rank and end the whole MPI job; never
        returns."""
        # Through logging (with no handler configured, Python prints it to stderr).
        logger.critical(
            "mpi4jax_dist: rank %d of %d: %s",
            self.comm.Get_rank(),
            self.comm.Get_size(),
            message,
        )
        _mpi.abort(_mpi.RecordingComm(self.comm, self.log), 1)


def _check_launch_size(base, info) -> None:
    """Stop when the launcher started N ranks but MPI says otherwise."""
    from mpi4py import MPI

    if info is None or info.size is None:
        return
    if MPI.Comm.Compare(base, MPI.COMM_WORLD) != MPI.IDENT:
        return
    if base.Get_size() != info.size:
        raise RuntimeError(
            f"The launcher ({info.launcher}) started {info.size} ranks but MPI says "
            f"this job has {base.Get_size()}: mpi4py talks to another MPI than the "
            f"mpiexec that started it (mpi4py uses: {_mpi.mpi_library()}). Start the "
            f"job with the mpiexec of that MPI, or rebuild mpi4py against the "
            f"launcher's (pip install --no-binary mpi4py mpi4py, with its mpicc on "
            f"PATH)."
        )


# --- the process's one bootstrap ------------------------------------------------------

_lock = threading.Lock()
_current: Bootstrap | None = None
_chosen_comm = None  # set by use_communicator() before the bootstrap runs


def current() -> Bootstrap | None:
    """Return this process's bootstrap (None before the first call)."""
    return _current


def use_communicator(comm) -> None:
    """Make the bootstrap run on ``comm`` (collective on it when it runs).

    Raises:
        RuntimeError: the bootstrap already ran on a different communicator.
    """
    global _chosen_comm
    with _lock:
        if _current is not None:
            _current.check_settings(comm=comm)
        elif comm is not None:
            _chosen_comm = comm


def topology(comm=None, port: int | None = None, timeout_s: float | None = None):
    """Return this process's :class:`Topology`, bootstrapping on first call.

    Args:
        comm: the communicator; default the one set by ``use_communicator``, else
            ``MPI.COMM_WORLD``. Collective on it the first time.
        port: the coordinator port; default ``JAX_COORDINATOR_PORT`` or a free one.
        timeout_s: how long to wait for the other ranks (default 300 s, JAX's
            ``initialization_timeout``); past it the job is aborted.

    Raises:
        RuntimeError: rank 0 could not choose a coordinator address (every rank
            raises the same message), or a later call asks for another
            communicator, port or timeout than the first (see
            :meth:`Bootstrap.check_settings`).
    """
    global _current
    with _lock:
        if _current is None:
            from mpi4py import MPI

            bootstrap = Bootstrap(
                comm=comm or _chosen_comm or MPI.COMM_WORLD,
                port=_config.coordinator_port() if port is None else port,
                timeout_s=float(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s),
                timeout_explicit=timeout_s is not None,
            )
            bootstrap.run()
            _current = bootstrap
        else:
            _current.check_settings(comm, port, timeout_s)
        return _current.topology


def release(on_listening=None) -> None:
    """Run this process's release (see :meth:`Bootstrap.release`); once."""
    with _lock:
        bootstrap = _current
    if bootstrap is None:
        raise RuntimeError("mpi4jax_dist: release() before the bootstrap ran")
    bootstrap.release(on_listening)


def collectives() -> list[_mpi.Call]:
    """Return the calls of this process's bootstrap that communicate, in order."""
    return [] if _current is None else _current.log.collectives()
