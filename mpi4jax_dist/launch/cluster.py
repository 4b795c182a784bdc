"""Our two ClusterEnvs: the one JAX asks first (MPI launches; getters only, which
delegate to the bootstrap and the session), and the one it asks last (a plain
``python script.py``: a one-process world on loopback)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from .. import _compat, _config
from ..faults import settings as fault_settings
from . import bootstrap, detect, devices, network, session

logger = logging.getLogger("mpi4jax_dist")

_explicit = False  # True while mpi4jax_dist.initialize() is asking JAX for us


class Mpi4jaxDistCluster(_compat.ClusterEnv):
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
            return detect.detect(env) is not None or detect.mpi_initialized_here()
        except Exception:
            return False

    @classmethod
    def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
        # JAX asks for the address only when it has none, just before every rank
        # connects: the place to prepare the connection and hold the other ranks
        # until rank 0's service listens.
        # JAX hands JAX_COORDINATOR_PORT on (jax >= 0.8.1): a bad value is the
        # bootstrap's to report, once, for the job (bootstrap._variable_port).
        variable = _config.environ().get(_config.COORDINATOR_PORT)
        if override_coordinator_port in (None, "", variable):
            port = None
        else:
            port = _config.coordinator_port(override_coordinator_port)
        topo = session.bootstrapped(port=port, timeout_s=timeout_secs)
        restore = session.prepare_connection(topo)
        bootstrap.release(on_listening=restore)
        return topo.coordinator_address

    @classmethod
    def get_process_count(cls) -> int:
        return session.bootstrapped().size

    @classmethod
    def get_process_id(cls) -> int:
        return session.bootstrapped().rank

    @classmethod
    def get_local_process_id(cls) -> int | None:
        # JAX turns this into local_device_ids=[value]; it is only called when the
        # user gave no local_device_ids. A block of several devices cannot pass that
        # way, so it is set directly and JAX told nothing.
        # (JAX before 0.12 applies [value] to CUDA's and ROCm's devices, not to
        # Intel's: set here for every platform, and JAX told the one id too.)
        topo = session.bootstrapped()
        ids = devices.local_device_ids(topo.local_rank, topo.local_size)
        if ids is None:
            return None
        _compat.restrict_visible_devices(ids)
        return ids[0] if len(ids) == 1 else None


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


class OneProcessCluster(_compat.ClusterEnv):
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
            if detect.detect(env) is not None or detect.mpi_initialized_here():
                return False
            # Envs registered after ours (a site's own) are asked before it too.
            later = _compat.cluster_types_after(cls)
            return not any(
                not other.opt_in_only_method and other.is_env_present()
                for other in later
            )
        except Exception:
            return False

    @classmethod
    def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
        # The settings the bootstrap checks under a launcher, checked alike here:
        # a bad value is an error (or a switch's, a warning) in a one-process run
        # too, never ignored.
        _, bad = fault_settings.this_process()
        bad = bad or _config.first_bad_setting()
        if bad is not None:
            raise ValueError(bad)
        if _config.timeline_dir() is not None:  # it needs MPI, not started here
            logger.warning(
                "mpi4jax_dist: %s is set, but a one-process run (no launcher) writes "
                "no timeline: run the script under mpiexec to time its collectives.",
                _config.TIMELINE,
            )
        port = _config.coordinator_port(override_coordinator_port)
        host = "127.0.0.1"
        if port is None:
            reservation = network.reserve_port(host)
            port = reservation.getsockname()[1]
        else:
            reservation = None
            network.check_port_free(host, port)
        address = network.format_address(host, port)
        restore = _config.default_bind_address(address)
        deadline = time.monotonic() + (timeout_secs or 300)

        def when_listening():
            # JAX has read the bind address once its service listens.
            network.wait_accepting(host, port, deadline, 1e-4, 0.05)
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
