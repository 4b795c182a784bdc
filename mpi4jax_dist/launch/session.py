"""What a process installs once this package has bootstrapped its JAX world.

:func:`bootstrapped` is what the cluster env's getters call: the topology
(bootstrapping on the first call), and, once per process, everything in
:func:`start`, in the order listed there. :func:`prepare_connection` runs where
JAX asks for the coordinator's address, just before every rank connects.
"""

from __future__ import annotations

import logging
import threading

from .. import _compat, _config, xla_mpi
from ..faults import failfast, hangs, status
from ..timing import timeline
from . import bootstrap, network

logger = logging.getLogger("mpi4jax_dist")

_lock = threading.Lock()
_started = False
# The duplicates of the world that start() hands XLA's MPI collectives and the
# hang watchdog; kept until MPI is finalized.
_comms: dict = {}


def bootstrapped(**settings) -> bootstrap.Topology:
    """Return the topology (bootstrapping on first call, with ``settings``: see
    :func:`mpi4jax_dist.launch.bootstrap.topology`), having run :func:`start`
    once."""
    global _started
    topo = bootstrap.topology(**settings)
    with _lock:
        if not _started:
            start(topo)
            _started = True
    return topo


def start(topo: bootstrap.Topology) -> None:
    """Install, in this order, what a process of a bootstrapped JAX world runs with:

    0. the timeline of the collectives, to the program's end, where rank 0's
       ``MPI4JAX_DIST_TIMELINE`` is set (:mod:`mpi4jax_dist.timing.timeline`):
       first, so that a folder no rank can write is one line from rank 0 (a
       JobError, before fail-fast would print every rank's);
    1. JAX's CPU collectives as asked (``MPI4JAX_DIST_CPU_COLLECTIVES``), checked
       before the CPU backend exists (:func:`mpi4jax_dist.xla_mpi.settle`);
    2. for MPI collectives, a private duplicate of the world for XLA's
       communicators (:func:`mpi4jax_dist.xla_mpi.use_private_world`);
    3. fail-fast: a rank that raises, exits non-zero or gets SIGTERM ends the job
       (:func:`mpi4jax_dist.faults.failfast.install`);
    4. stacks on SIGUSR1, the job's collective and hang timeouts and, with
       either or the checks, the watchdog thread on a duplicate of the job's
       communicator (and its standstill's chain on a second one)
       (:func:`mpi4jax_dist.faults.hangs.install`), whose reports quote XLA's
       calls into MPI too (:func:`mpi4jax_dist.xla_mpi.record`), as the
       timeline times them (:func:`mpi4jax_dist.xla_mpi.time_calls`), and under
       fail-fast a Ctrl-C that ends the job where Python cannot
       (:func:`mpi4jax_dist.faults.failfast.watch_interrupts`), and the rank's
       answer to ``python -m mpi4jax_dist status``
       (:func:`mpi4jax_dist.faults.status.listen`);
    5. JAX's proxy warning off where only launcher variables set it off;
    6. the address JAX's Gloo collectives publish;
    7. the runtime token of ordered-effect programs handed on as it is
       (``MPI4JAX_DIST_TOKEN_REUSE``);
    8. the persistent compilation cache written by every process
       (``MPI4JAX_DIST_CACHE_EVERY_PROCESS``).

    The duplicates are collectives: every rank makes them here, in this order.
    """
    current = bootstrap.current()
    agreed = current.fault_settings
    if agreed.timeline:
        timeline.start_from_environment(current.comm, lambda: _timed_calls(current.log))
    xla_mpi.settle()
    xla_mpi.use_private_world(_world_for_xla)
    failfast.install(topo.rank, topo.size)
    watchdog_comm = _watchdog_comm(current)
    hangs.install(
        topo.rank,
        topo.size,
        agreed.collective_timeout_s,
        watchdog_comm,
        hang_timeout=agreed.hang_timeout_s,
        still_comm=_standstill_comm(current) if watchdog_comm else None,
    )
    if (xla_record := xla_mpi.record()) is not None:
        hangs.quote_record(*xla_record)
        xla_mpi.time_calls()
    failfast.watch_interrupts()
    status.listen(topo.rank, topo.coordinator_address)
    _silence_false_proxy_alarm(topo)
    _compat.one_version_warning(topo.rank)
    _config.setting_warnings_on_rank_0(topo.rank)
    _choose_gloo_address(topo)
    # mpi4jax's programs too, where no op of ours runs (_compat.reuse_runtime_tokens).
    _compat.reuse_runtime_tokens(_config.token_reuse())
    _compat.tokens_in_program(_config.tokens_in_program())
    if _config.cache_every_process():
        # Per-rank programs (an mpi4jax code's) are cached on every rank, as they
        # were before jax.distributed made all but rank 0 stop writing.
        _compat.cache_on_every_process()


def _timed_calls(log) -> list:
    """The bootstrap's MPI calls that ended, as the timeline's JSON holds them."""
    return [
        [c.name, c.phase, c.enter_ns, c.leave_ns]
        for c in log.collectives()
        if c.leave_ns
    ]


def _world_for_xla():
    """A duplicate of ``MPI.COMM_WORLD`` for XLA's MPI collectives (made once,
    recorded in the bootstrap's calls), or None when the job's communicator is not
    the whole world."""
    from mpi4py import MPI

    if "xla" not in _comms:
        current = bootstrap.current()
        same = MPI.Comm.Compare(current.comm, MPI.COMM_WORLD)
        if same not in (MPI.IDENT, MPI.CONGRUENT):
            return None
        _comms["xla"] = current.duplicate("xla world", MPI.COMM_WORLD)
    return _comms["xla"]


def _watchdog_comm(current: bootstrap.Bootstrap):
    """A duplicate of the job's communicator for the watchdog, or None where there
    is to be none: neither the collective timeout, the hang timeout nor the checks
    (rank 0's settings; the hang timeout and the checks are on by default), one
    rank, or MPI below ``MPI_THREAD_MULTIPLE`` on rank 0 (the release mode says so
    alike on every rank)."""
    if not current.fault_settings.watchdog or current.comm.Get_size() < 2:
        return None
    if current.release_mode != "thread":
        return None
    if "watchdog" not in _comms:
        _comms["watchdog"] = current.duplicate("watchdog")
    return _comms["watchdog"]


def _standstill_comm(current: bootstrap.Bootstrap):
    """A second duplicate for the watchdog's standstill chain (a chain of
    reductions posted apart from the hang timeout's, so on a communicator of its
    own), where the checks are on (rank 0's ``MPI4JAX_DIST_CHECKS``), else
    None."""
    if not current.fault_settings.checks:
        return None
    if "standstill" not in _comms:
        _comms["standstill"] = current.duplicate("standstill")
    return _comms["standstill"]


def _choose_gloo_address(topo) -> None:
    """Give JAX's Gloo collectives an address the other processes reach (once).

    The one this host reaches the coordinator from, or ``MPI4JAX_DIST_INTERFACE``'s
    (:func:`network.collectives_address`), instead of what the host name resolves
    to. Where that cannot be done, and rank 0's host name resolves to loopback in
    a job of several nodes, rank 0 says so in one warning before the first
    collective (which would otherwise fail after Gloo's timeout).

    Raises:
        ValueError: ``MPI4JAX_DIST_INTERFACE`` names no interface of this host, or
            one without an address.
    """
    if topo.size < 2:
        return
    try:
        address = network.collectives_address(
            topo.coordinator_address, _config.interface()
        )
    except OSError as err:  # no route to the coordinator: JAX will say more
        why = f"no address for them ({err})"
    else:
        if _compat.publish_gloo_address(address):
            logger.info(
                "mpi4jax_dist: rank %d: JAX's Gloo collectives on %s",
                topo.rank,
                address,
            )
            return
        why = f"this JAX cannot be told their address ({address})"
    loopback = network.hostname_on_loopback()
    if topo.rank == 0 and topo.num_nodes > 1 and loopback is not None:
        logger.warning(
            "mpi4jax_dist: JAX's Gloo collectives will publish %s, what rank 0's "
            "host name resolves to, which other nodes cannot reach (%s): "
            "collectives across nodes will fail. Map the host name to its cluster "
            "address in /etc/hosts, or set %s=mpi.",
            loopback,
            why,
            _config.CPU_COLLECTIVES,
        )


def _silence_false_proxy_alarm(topo) -> None:
    """Turn JAX's proxy warning off where only launcher variables set it off.

    JAX warns about every variable with "_proxy" in its name ("may cause a hang"):
    under Intel MPI's mpiexec every rank names HYDRA_BSTRAP_PROXY_ID, Hydra's
    bootstrap proxy process. A real proxy setting is :func:`prepare_connection`'s
    (the coordinator exempted, the warning off; kept where the proxy is kept).
    """
    false_alarms = _config.false_proxy_alarms()
    if false_alarms:
        _compat.silence_proxy_check()
        if topo.rank == 0:
            logger.info(
                "mpi4jax_dist: %s: named like a proxy but a launcher's variable; "
                "JAX's proxy warning turned off.",
                ", ".join(false_alarms),
            )


def prepare_connection(topo):
    """Exempt the coordinator from proxies; bind rank 0's service to it alone.

    Returns what undoes the bind setting once JAX has read it, or None.
    """
    host, _ = _config.split_host_port(topo.coordinator_address, "coordinator address")
    proxies = _config.exempt_from_proxy(host)
    if not _config.caught_by_proxy(host):
        # No proxy can catch the coordinator's traffic: JAX's warning on every rank
        # that the variables "may cause a hang" would not be true.
        _compat.silence_proxy_check()
    if proxies and topo.rank == 0:
        logger.warning(
            "mpi4jax_dist: %s set; added %s to no_grpc_proxy so that JAX reaches its "
            "coordinator directly, and turned JAX's proxy warning off (%s=keep leaves "
            "both alone).",
            ", ".join(proxies),
            host,
            _config.PROXY,
        )
    if topo.rank == 0:
        return _config.default_bind_address(topo.coordinator_address)
    return None
