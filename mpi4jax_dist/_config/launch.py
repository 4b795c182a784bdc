"""What the launch reads: the switches of the cluster envs, the CPU collectives
and MPItrampoline's library (``xla_mpi.py``), the coordinator's address, port,
interface and bind address, the compilation cache's rule (``launch/``), and the
variables that decide MPI's thread level."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .env import environ, get_bool

DISABLE = "MPI4JAX_DIST_DISABLE"
ONE_PROCESS = "MPI4JAX_DIST_ONE_PROCESS"
CPU_COLLECTIVES = "MPI4JAX_DIST_CPU_COLLECTIVES"
# Read by jaxlib's MPItrampoline when jaxlib loads, and by JAX's config.
TRAMPOLINE_LIB = "MPITRAMPOLINE_LIB"
JAX_CPU_COLLECTIVES = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
CACHE_EVERY_PROCESS = "MPI4JAX_DIST_CACHE_EVERY_PROCESS"
INTERFACE = "MPI4JAX_DIST_INTERFACE"
COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"
# What decides MPI's thread level: Cray MPICH caps what MPI_Init_thread provides
# at MPICH_MAX_THREAD_SAFETY (single, funneled, serialized or multiple; unset:
# below multiple), and mpi4py asks for mpi4py.rc.thread_level, which
# MPI4PY_RC_THREAD_LEVEL sets (default multiple).
THREAD_LEVEL_VARIABLES = ("MPICH_MAX_THREAD_SAFETY", "MPI4PY_RC_THREAD_LEVEL")


def disabled(env: Mapping[str, str] | None = None) -> bool:
    """Return True when ``MPI4JAX_DIST_DISABLE`` turns automatic detection off."""
    return get_bool(DISABLE, False, env)


def one_process(env: Mapping[str, str] | None = None) -> bool:
    """Return True unless ``MPI4JAX_DIST_ONE_PROCESS=0`` (or
    ``MPI4JAX_DIST_DISABLE``) turns off the one-process world a plain ``python
    script.py`` gets from ``jax.distributed.initialize()``."""
    return not disabled(env) and get_bool(ONE_PROCESS, True, env)


def cpu_collectives(env: Mapping[str, str] | None = None) -> str | None:
    """Return ``"mpi"`` or ``"gloo"`` from ``MPI4JAX_DIST_CPU_COLLECTIVES``, or None
    (unset: JAX's own choice, gloo under ``jax.distributed``)."""
    env = environ() if env is None else env
    value = env.get(CPU_COLLECTIVES, "").strip().lower()
    if value in ("", "default"):
        return None
    if value not in ("mpi", "gloo"):
        raise ValueError(
            f"{CPU_COLLECTIVES}={env.get(CPU_COLLECTIVES)!r}: expected mpi (JAX's "
            f"cross-process collectives on CPU over MPI) or gloo (over TCP, JAX's "
            f"default); unset it for JAX's default."
        )
    return value


def trampoline_lib(env: Mapping[str, str] | None = None) -> str | None:
    """Return the library ``MPITRAMPOLINE_LIB`` names for jaxlib's MPItrampoline."""
    env = environ() if env is None else env
    return env.get(TRAMPOLINE_LIB) or None


def cache_every_process(env: Mapping[str, str] | None = None) -> bool:
    """Return True unless ``MPI4JAX_DIST_CACHE_EVERY_PROCESS=0`` keeps JAX's rule
    for the persistent compilation cache: only process 0 writes entries, also for
    the programs no other process compiles (see
    ``_compat.cache_on_every_process``)."""
    return get_bool(CACHE_EVERY_PROCESS, True, env)


def interface(env: Mapping[str, str] | None = None) -> str | None:
    """Return the network interface named by ``MPI4JAX_DIST_INTERFACE``, if any."""
    env = environ() if env is None else env
    value = env.get(INTERFACE, "").strip()
    return value or None


def parse_port(value, name: str) -> int:
    """Return ``value`` as a TCP port number, or raise naming ``name``."""
    try:
        port = int(str(value).strip())
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{name}={value!r} is not a TCP port; expected an integer from 1 to "
            f"65535 (or unset it to let rank 0 choose a free port)."
        )
    return port


def coordinator_port(override=None, env: Mapping[str, str] | None = None) -> int | None:
    """Return the coordinator port: ``override`` (what JAX passes), else the variable.

    JAX reads ``JAX_COORDINATOR_PORT`` itself and hands it to the cluster env as
    ``override_coordinator_port`` (jax >= 0.8.1); older versions do not, so the
    variable is read here as well.
    """
    env = environ() if env is None else env
    if override not in (None, ""):
        return parse_port(override, COORDINATOR_PORT)
    value = env.get(COORDINATOR_PORT)
    if value in (None, ""):
        return None
    return parse_port(value, COORDINATOR_PORT)


def split_host_port(address: str, name: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) and validate it, naming ``name``."""
    host, sep, port = str(address).strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host:
        raise ValueError(
            f"{name}={address!r} is not of the form host:port "
            f"(for example 10.0.0.1:1234 or [fd00::1]:1234)."
        )
    return host, parse_port(port, name)


def coordinator_address(env: Mapping[str, str] | None = None) -> str | None:
    """Return a validated ``JAX_COORDINATOR_ADDRESS``, or None when unset."""
    env = environ() if env is None else env
    value = env.get(COORDINATOR_ADDRESS)
    if not value:
        return None
    split_host_port(value, COORDINATOR_ADDRESS)
    return value.strip()


def thread_level_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return those of ``THREAD_LEVEL_VARIABLES`` that are set, with their values."""
    env = environ() if env is None else env
    return {name: env[name] for name in THREAD_LEVEL_VARIABLES if name in env}


def default_bind_address(address: str):
    """Bind JAX's coordination service to ``address`` unless the user chose one.

    JAX binds it to every interface (``[::]:port``) by default, and gRPC there asks
    for no credentials. JAX reads ``JAX_COORDINATOR_BIND_ADDRESS`` after cluster
    detection, so it is set here; returns a function that takes it back once JAX has
    read it (child processes must not inherit a port of ours), or None.
    """
    if os.environ.get(BIND_ADDRESS):
        return None
    os.environ[BIND_ADDRESS] = address

    def restore():
        if os.environ.get(BIND_ADDRESS) == address:
            del os.environ[BIND_ADDRESS]

    return restore
