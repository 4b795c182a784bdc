"""The bootstrap: every MPI collective mpi4jax_dist makes to set up JAX lives here.

A :class:`Bootstrap` runs once per process: arrival (a non-blocking ``Idup``), the
topology on that private communicator (node split, node numbers by scan and
allreduce, rank 0's answer by broadcast: mpi4jax_dist/launch/wire.py), and the
:class:`Release` that holds the other ranks until rank 0's coordination service
listens (mpi4jax_dist/launch/coordinator.py watches its port). Every call goes
through one recording communicator, whose log ``python -m mpi4jax_dist --check
--verbose`` prints; every wait has a deadline, past which the job is aborted with
one line (mpi4jax_dist/launch/waits.py). docs/design.rst, *The bootstrap's MPI
calls*.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import _config, _mpi
from ..faults import failfast
from ..faults import settings as fault_settings
from . import coordinator, detect, limits, network, settings, waits, wire
from .settings import DEFAULT_TIMEOUT_S

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
    """One process's bootstrap; everything it holds is an attribute.

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
        file_limit_raised: on rank 0, ``(old, new)`` soft open-file limit when the
            bootstrap raised it for the coordination service, else None.
        fault_settings: the collective and hang timeouts
            (:class:`~mpi4jax_dist.faults.settings.JobSettings`), this process's
            until rank 0's arrive with the coordinator address, rank 0's after.
        setting_error: this process's bad fault setting, if any (rank 0's is
            every rank's error; another rank's value is never used).
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
    file_limit_raised: tuple | None = None
    fault_settings: fault_settings.JobSettings = field(init=False)
    setting_error: str | None = field(init=False)
    log: _mpi.CallLog = field(default_factory=_mpi.CallLog)
    timestamps: dict = field(default_factory=dict)
    # What run() keeps for release(), and the release itself.
    _release: Release = field(init=False, repr=False)

    def __post_init__(self):
        self.fault_settings, self.setting_error = fault_settings.this_process()
        self.setting_error = self.setting_error or _config.first_bad_setting()
        self._release = Release(self)

    def check_settings(self, comm=None, port=None, timeout_s=None) -> None:
        """Raise when a later call asks for other settings than this bootstrap's.

        A communicator must be the same (or congruent); a port must be the
        coordinator's; a timeout must be the one asked for first, unless the first
        call asked for none (JAX's default): then the new one rules the waits still
        ahead (the release).

        Raises:
            RuntimeError: naming what was asked and what this process already uses.
        """
        settings.check_comm(comm, self.comm)
        if self.topology is not None:
            settings.check_port(port, self.topology.coordinator_address)
        if settings.takes_timeout(timeout_s, self.timeout_s, self.timeout_explicit):
            self.timeout_s, self.timeout_explicit = float(timeout_s), True

    def deadline(self) -> waits.Deadline:
        """Return the deadline of waits starting now: ``timeout_s`` from now."""
        return waits.Deadline(
            at=time.monotonic() + self.timeout_s,
            timeout_s=self.timeout_s,
            collective_timeout_s=self.fault_settings.collective_timeout_s,
            comm=self.comm,
            log=self.log,
        )

    def run(self) -> Topology:
        """Compute the topology and the coordinator (collective over ``comm``)."""
        from mpi4py import MPI

        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        failfast.quiet_on_other_ranks(rank)
        env = _config.environ()
        info = detect.detect(env)
        settings.check_launch_size(self.comm, info)

        # MPI4JAX_DIST_INTERFACE on this host, checked before any collective it
        # may serve; the ranks that cannot use it are counted with the nodes.
        name = _config.interface(env)
        interface_error = network.interface_error(name)
        deadline = self.deadline()
        self.log.phase = "arrival"
        # Non-blocking, so that a rank that never comes is noticed, not waited for.
        comm, request = _mpi.RecordingComm(self.comm, self.log).Idup()
        waits.wait(
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
            node_index, num_nodes, unusable = self._node_numbers(
                comm, node, local_rank, interface_error is not None, deadline
            )
            if unusable:  # on every rank alike: rank 0 says it
                raise failfast.JobValueError(
                    _interface_message(name, interface_error, unusable, size)
                )
            explicit = _config.coordinator_address(env)
            address = self._answer(comm, rank, size, explicit, num_nodes, deadline)
            # Kept for the release: the private communicator in thread mode; in
            # probe mode the node's, where a leader other than rank 0 releases it.
            if self.release_mode == "thread":
                self._release.private, comm = comm, None
            if self.release_mode == "probe" and node_index > 0 and local_size > 1:
                self._release.node, node = node, None
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

    def _node_numbers(
        self, comm, node, local_rank, unusable, deadline
    ) -> tuple[int, int, int]:
        """Return (node index, node count, ranks that cannot use the interface):
        node leaders (local rank 0) count the leaders below them (an exclusive
        scan) and all of them (an allreduce, which counts the ranks whose
        ``unusable`` is true too), both posted at once; then one broadcast within
        the node.

        Nodes are numbered in order of their lowest rank. A ``Split`` of the leaders
        gives the same numbers, but MPICH's gathers every rank's color and key:
        O(P) bytes per rank against O(1) here, and it cannot be waited on with a
        deadline.
        """
        from mpi4py import MPI

        leader = np.array([1 if local_rank == 0 else 0], dtype=np.int64)
        below = np.zeros(1, dtype=np.int64)
        counts = np.zeros(2, dtype=np.int64)
        mine = np.array([leader[0], 1 if unusable else 0], dtype=np.int64)
        scan = comm.Iexscan(leader, below, op=MPI.SUM)
        total = comm.Iallreduce(mine, counts, op=MPI.SUM)
        what = "every rank to count the nodes"
        waits.wait(scan, deadline, what)
        waits.wait(total, deadline, what)
        # MPI leaves rank 0's exclusive scan undefined: nothing is below it.
        numbers = np.array([0 if comm.Get_rank() == 0 else below[0], counts[0]])
        waits.wait(
            node.Ibcast(numbers, root=0),
            deadline,
            "this node's first rank to send the node index",
        )
        return int(numbers[0]), int(numbers[1]), int(counts[1])

    def _answer(self, comm, rank, size, explicit, num_nodes, deadline) -> str:
        """Broadcast rank 0's answer (wire.py): every rank takes its release mode
        and its fault settings, and returns its coordinator address.

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
        waits.wait(
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
                self._release.reservation = network.reserve_port(host)
                port = self._release.reservation.getsockname()[1]
            else:
                network.check_port_free(host, port)
            return _OK, network.format_address(host, port)
        except Exception as err:  # raised on every rank after the broadcast
            return _ERROR, f"rank 0 could not choose the coordinator address: {err}"

    def release(self, on_listening=None) -> None:
        """Hold the other ranks until rank 0's coordination service listens
        (:meth:`Release.run`); once per process."""
        self._release.run(on_listening)

    def duplicate(self, phase: str, comm=None):
        """Return a ``Dup`` of ``comm`` (default: the job's communicator), recorded
        in :attr:`log` under ``phase``. Collective on ``comm``."""
        self.log.phase = phase
        return _mpi.RecordingComm(comm or self.comm, self.log).Dup().comm


@dataclass
class Release:
    """What holds the other ranks until rank 0's coordination service listens.

    Attributes:
        bootstrap: whose topology, release mode and timeout it runs with.
        private: the private communicator, kept by :meth:`Bootstrap.run` in thread
            mode for the barrier that releases the other ranks.
        node: the node's communicator, kept in probe mode on nodes other than rank
            0's, where the node's leader probes and releases the others.
        reservation: rank 0's socket holding the chosen port until JAX's service
            binds it.
        done: whether :meth:`run` has run.
    """

    bootstrap: Bootstrap
    private: object = None
    node: object = None
    reservation: object = None
    done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def run(self, on_listening=None) -> None:
        """Hold the other ranks until rank 0's coordination service listens.

        Called where JAX asks for the coordinator address, before any rank
        connects. Rank 0 returns at once and starts a thread that waits for its own
        port to accept, closes the port's reservation, calls ``on_listening`` (JAX
        has read its settings by then) and, in thread mode, joins the ``Ibarrier``
        the other ranks wait in. Runs once.
        """
        with self._lock:
            if self.done:
                return
            self.done = True
        boot = self.bootstrap
        deadline = boot.deadline()
        boot.log.phase = "release"
        if boot.topology.rank == 0:
            threading.Thread(
                target=self._when_listening,
                name="mpi4jax_dist-release",
                args=(deadline, on_listening),
                daemon=True,
            ).start()
            return
        waiting_for = (
            f"rank 0's JAX coordination service to listen on "
            f"{boot.topology.coordinator_address}"
        )
        if boot.release_mode == "thread":
            self._by_barrier(deadline, waiting_for)
        elif boot.release_mode == "probe":
            self._by_probing(deadline, waiting_for)
        boot.timestamps["released"] = time.perf_counter()

    def _when_listening(self, deadline: waits.Deadline, on_listening) -> None:
        """Rank 0's thread: wait for the service, then release the others."""
        boot = self.bootstrap
        address = boot.topology.coordinator_address
        if coordinator.listening(address, deadline.at) is not None:
            message = (
                f"JAX's coordination service did not listen on "
                f"{address} within {deadline.timeout_s:g} s."
            )
            if boot.release_mode == "thread":
                waits.abort(boot.comm, boot.log, message)
            logger.warning("mpi4jax_dist: %s", message)
        boot.timestamps["service_listening"] = time.perf_counter()
        if self.reservation is not None:
            self.reservation.close()
            self.reservation = None
        if on_listening is not None:
            on_listening()
        if boot.release_mode == "thread":
            waits.wait(
                self.private.Ibarrier(),
                deadline,
                "the other ranks to join the barrier that tells them the "
                "coordinator listens",
            )
            self.private.Free()
            self.private = None

    def _by_barrier(self, deadline: waits.Deadline, waiting_for: str) -> None:
        """Thread mode: wait in the barrier rank 0's thread joins once its service
        listens; then a node leader other than rank 0's checks, in a thread of its
        own, that its node reaches the service (:meth:`check_reachable`)."""
        waits.wait(self.private.Ibarrier(), deadline, waiting_for)
        self.private.Free()
        self.private = None
        topo = self.bootstrap.topology
        if topo.node_index > 0 and topo.local_rank == 0:
            threading.Thread(
                target=self.check_reachable,
                name="mpi4jax_dist-reach",
                daemon=True,
            ).start()

    def _by_probing(self, deadline: waits.Deadline, waiting_for: str) -> None:
        """Probe mode: the node's leader (every rank on rank 0's node) probes rank
        0's port, then releases the node's other ranks with a barrier."""
        if self.node is None or self.bootstrap.topology.local_rank == 0:
            self._probe(deadline, waiting_for)
        if self.node is not None:
            waits.wait(self.node.Ibarrier(), deadline, waiting_for)
            self.node.Free()
            self.node = None

    def _probe(self, deadline: waits.Deadline, waiting_for: str) -> None:
        """Poll rank 0's port until it accepts (:func:`coordinator.probe`); abort
        the job past the deadline, or once attempts went unanswered, saying
        which."""
        boot = self.bootstrap
        topo = boot.topology
        address = topo.coordinator_address
        why = coordinator.probe(address, deadline.at, topo.num_nodes + topo.local_size)
        if why is None:
            return
        if why.startswith(network.REFUSED):  # reached, but nothing listened
            waits.give_up(deadline, waiting_for)
        where = "where rank 0's service is to listen"
        waits.abort(boot.comm, boot.log, coordinator.unreachable(address, why, where))

    def check_reachable(self) -> None:
        """A node leader's thread, once rank 0's service listens: connect to it
        once (:func:`coordinator.reach`), and end the job saying so when this node
        cannot reach it."""
        boot = self.bootstrap
        address = boot.topology.coordinator_address
        why = coordinator.reach(address, boot.timeout_s)
        if why is not None:
            where = "where rank 0's service listens"
            waits.abort(
                boot.comm, boot.log, coordinator.unreachable(address, why, where)
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

            if port is None:
                port = _variable_port()
            bootstrap = Bootstrap(
                comm=comm or _chosen_comm or MPI.COMM_WORLD,
                port=port,
                timeout_s=float(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s),
                timeout_explicit=timeout_s is not None,
            )
            bootstrap.run()
            _current = bootstrap
        else:
            _current.check_settings(comm, port, timeout_s)
        return _current.topology


def _interface_message(name, own_error, unusable: int, size: int) -> str:
    """The job's one line for ``MPI4JAX_DIST_INTERFACE`` unusable on ``unusable``
    of ``size`` ranks (``own_error``: this rank's reason, or None)."""
    fix = "name an interface every node has (ip -brief address, on each)"
    if own_error is not None:
        return f"{own_error} So on {unusable} of {size} ranks: {fix}."
    rank_0 = f"rank 0's {name!r} is usable there" if name else "rank 0 names none"
    return (
        f"{_config.INTERFACE} names no usable interface on {unusable} of {size} "
        f"ranks ({rank_0}): {fix}."
    )


def _variable_port() -> int | None:
    """``JAX_COORDINATOR_PORT``, or None where it is unset or bad: a bad value is
    the bootstrap's setting error, which rank 0 reports for the job
    (:func:`mpi4jax_dist._config.first_bad_setting`)."""
    try:
        return _config.coordinator_port()
    except ValueError:
        return None


def release(on_listening=None) -> None:
    """Run this process's release (see :meth:`Release.run`); once."""
    with _lock:
        bootstrap = _current
    if bootstrap is None:
        raise RuntimeError("mpi4jax_dist: release() before the bootstrap ran")
    bootstrap.release(on_listening)


def collectives() -> list[_mpi.Call]:
    """Return the calls of this process's bootstrap that communicate, in order."""
    return [] if _current is None else _current.log.collectives()
