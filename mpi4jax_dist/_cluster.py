"""Our two ClusterEnvs: the one JAX asks first (MPI launches; thin, it delegates to
the bootstrap), and the one it asks last (a plain ``python script.py``: a
one-process world on loopback)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from . import (
    _config,
    _cpu_collectives,
    _devices,
    _failfast,
    _hangs,
    _jax_compat,
    _launch,
    _network,
    _topology,
)

logger = logging.getLogger("mpi4jax_dist")

_explicit = False  # True while mpi4jax_dist.initialize() is asking JAX for us
_proxy_alarm_checked = False
_gloo_address_chosen = False


class Mpi4jaxDistCluster(_jax_compat.ClusterEnv):
    """MPI launches, seen through mpi4py: rank, size and node layout from MPI."""

    name = "mpi4jax_dist"
    opt_in_only_method = False

    @classmethod
    def is_env_present(cls) -> bool:
        # Asked for every JAX user at jax.distributed.initialize(): cheap, never
        # raises, never starts MPI.
        try:
            if _explicit:
                return True
            if _config.disabled():
                return False
            env = _config.environ()
            return _launch.detect(env) is not None or _launch.mpi_initialized_here()
        except Exception:
            return False

    @classmethod
    def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
        # JAX asks for the address only when it has none, just before every rank
        # connects: the place to prepare the connection and hold the other ranks
        # until rank 0's service listens.
        port = _config.coordinator_port(override_coordinator_port)
        topo = _bootstrapped(port=port, timeout_s=timeout_secs)
        restore = _prepare_connection(topo)
        _topology.release(on_listening=restore)
        return topo.coordinator_address

    @classmethod
    def get_process_count(cls) -> int:
        return _bootstrapped().size

    @classmethod
    def get_process_id(cls) -> int:
        return _bootstrapped().rank

    @classmethod
    def get_local_process_id(cls) -> int | None:
        # JAX turns this into local_device_ids=[value]; it is only called when the
        # user gave no local_device_ids. A block of several devices cannot pass that
        # way, so it is set directly and JAX told nothing.
        # (JAX before 0.12 applies [value] to CUDA's and ROCm's devices, not to
        # Intel's: set here for every platform, and JAX told the one id too.)
        topo = _bootstrapped()
        ids = _devices.local_device_ids(topo.local_rank, topo.local_size)
        if ids is None:
            return None
        _jax_compat.restrict_visible_devices(ids)
        return ids[0] if len(ids) == 1 else None


def _bootstrapped(**settings) -> _topology.Topology:
    """Return the topology (bootstrapping on first call) for the JAX world being
    initialized, in which a failing rank now ends the job (``_failfast``)."""
    topo = _topology.topology(**settings)
    _cpu_collectives.settle()
    _cpu_collectives.use_private_world()
    _failfast.install(topo.rank, topo.size)
    # Stacks on SIGUSR1 and the collective timeout's watchdog (whose Dup every
    # rank makes here, or none does).
    _hangs.install(
        topo.rank,
        topo.size,
        _topology.current().collective_timeout_s,
        _topology.watchdog_comm(),
    )
    _silence_false_proxy_alarm(topo)
    _choose_gloo_address(topo)
    if _config.cache_every_process():
        # Per-rank programs (an mpi4jax code's) are cached on every rank, as they
        # were before jax.distributed made all but rank 0 stop writing.
        _jax_compat.cache_on_every_process()
    return topo


def _choose_gloo_address(topo) -> None:
    """Give JAX's Gloo collectives an address the other processes reach (once).

    The one this host reaches the coordinator from, or ``MPI4JAX_DIST_INTERFACE``'s
    (:func:`_network.collectives_address`), instead of what the host name resolves
    to. Where that cannot be done, and rank 0's host name resolves to loopback in
    a job of several nodes, rank 0 says so in one warning before the first
    collective (which would otherwise fail after Gloo's timeout).

    Raises:
        ValueError: ``MPI4JAX_DIST_INTERFACE`` names no interface of this host, or
            one without an address.
    """
    global _gloo_address_chosen
    if _gloo_address_chosen or topo.size < 2:
        return
    _gloo_address_chosen = True
    try:
        address = _network.collectives_address(
            topo.coordinator_address, _config.interface()
        )
    except OSError as err:  # no route to the coordinator: JAX will say more
        why = f"no address for them ({err})"
    else:
        if _jax_compat.publish_gloo_address(address):
            logger.info(
                "mpi4jax_dist: rank %d: JAX's Gloo collectives on %s",
                topo.rank,
                address,
            )
            return
        why = f"this JAX cannot be told their address ({address})"
    loopback = _network.hostname_on_loopback()
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
    bootstrap proxy process. A real proxy setting keeps JAX's warning (and gets
    this package's own message, :func:`_prepare_connection`).
    """
    global _proxy_alarm_checked
    if _proxy_alarm_checked:
        return
    _proxy_alarm_checked = True
    false_alarms = _config.false_proxy_alarms()
    if false_alarms:
        _jax_compat.silence_proxy_check()
        if topo.rank == 0:
            logger.info(
                "mpi4jax_dist: %s: named like a proxy but a launcher's variable; "
                "JAX's proxy warning turned off.",
                ", ".join(false_alarms),
            )


def _prepare_connection(topo):
    """Exempt the coordinator from proxies; bind rank 0's service to it alone.

    Returns what undoes the bind setting once JAX has read it, or None.
    """
    host, _ = _config.split_host_port(topo.coordinator_address, "coordinator address")
    proxies = _config.exempt_from_proxy(host)
    if proxies and topo.rank == 0:
        logger.warning(
            "mpi4jax_dist: %s set; added %s to no_grpc_proxy so that JAX reaches its "
            "coordinator directly (%s=keep leaves proxies alone).",
            ", ".join(proxies),
            host,
            _config.PROXY,
        )
    if topo.rank == 0:
        return _config.default_bind_address(topo.coordinator_address)
    return None


@contextlib.contextmanager
def explicitly_requested():
    """Report the env present while ``mpi4jax_dist.initialize`` runs, whatever the
    launcher variables say (the user asked for it by name)."""
    global _explicit
    _explicit = True
    try:
        yield
    finally:
        _explicit = False


class OneProcessCluster(_jax_compat.ClusterEnv):
    """No launcher and no MPI: ``python script.py`` is a world of one process.

    Asked last, after every ClusterEnv JAX knows (Slurm without MPI, TPU VMs,
    Kubernetes, ...), so it shadows none of them: JAX's own error, "coordinator_address
    should be defined", is what it replaces. MPI is not started; JAX's coordination
    service listens on 127.0.0.1 only, on a free port held until it binds.
    ``MPI4JAX_DIST_ONE_PROCESS=0`` (or ``MPI4JAX_DIST_DISABLE=1``) turns it off.
    """

    name = "mpi4jax_dist_one_process"
    opt_in_only_method = False

    @classmethod
    def is_env_present(cls) -> bool:
        try:
            if not _config.one_process():
                return False
            env = _config.environ()
            if _launch.detect(env) is not None or _launch.mpi_initialized_here():
                return False
            # Envs registered after ours (a site's own) are asked before it too.
            registry = _jax_compat.ClusterEnv._cluster_types
            later = registry[registry.index(cls) + 1 :]
            return not any(
                not other.opt_in_only_method and other.is_env_present()
                for other in later
            )
        except Exception:
            return False

    @classmethod
    def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
        port = _config.coordinator_port(override_coordinator_port)
        host = "127.0.0.1"
        if port is None:
            reservation = _network.reserve_port(host)
            port = reservation.getsockname()[1]
        else:
            reservation = None
            _network.check_port_free(host, port)
        address = _network.format_address(host, port)
        restore = _config.default_bind_address(address)
        deadline = time.monotonic() + (timeout_secs or 300)

        def when_listening():
            # JAX has read the bind address once its service listens.
            _network.wait_accepting(host, port, deadline, 1e-4, 0.05)
            if reservation is not None:
                reservation.close()
            if restore is not None:
                restore()

        threading.Thread(
            target=when_listening, name="mpi4jax_dist-one-process", daemon=True
        ).start()
        logger.info(
            "mpi4jax_dist: no MPI launcher: a one-process JAX world, coordinator on "
            "%s (%s=0 turns this off).",
            address,
            _config.ONE_PROCESS,
        )
        return address

    @classmethod
    def get_process_count(cls) -> int:
        return 1

    @classmethod
    def get_process_id(cls) -> int:
        return 0
