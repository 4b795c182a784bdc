"""The settings a process bootstraps with, and the checks on them: a later call
must ask for what the first did (one JAX world per process), and MPI must see the
ranks the launcher started."""

from __future__ import annotations

from .. import _config, _mpi

# JAX's own default for initialization_timeout.
DEFAULT_TIMEOUT_S = 300


def check_comm(asked, chosen) -> None:
    """Raise unless ``asked`` (None: any) is ``chosen`` or congruent to it."""
    from mpi4py import MPI

    if asked is not None and MPI.Comm.Compare(asked, chosen) not in (
        MPI.IDENT,
        MPI.CONGRUENT,
    ):
        raise RuntimeError(
            "mpi4jax_dist already bootstrapped on another communicator: one JAX "
            "world per process. Pass the same comm= to every call."
        )


def check_port(asked: int | None, coordinator_address: str) -> None:
    """Raise unless ``asked`` (None: any) is the coordinator's port."""
    if asked is None:
        return
    _, chosen = _config.split_host_port(coordinator_address, "coordinator address")
    if asked != chosen:
        raise RuntimeError(
            f"coordinator port {asked} asked for, but this process already "
            f"bootstrapped with the coordinator at "
            f"{coordinator_address}. Set "
            f"{_config.COORDINATOR_PORT} (or pass the port) before the first "
            f"call, the same on every call."
        )


def takes_timeout(asked: float | None, timeout_s: float, explicit: bool) -> bool:
    """Return whether ``asked`` is a new timeout to take: one differs from
    ``timeout_s`` where no call asked for one before (``explicit``).

    Raises:
        RuntimeError: another timeout was asked for before.
    """
    if asked is None or asked == timeout_s:
        return False
    if explicit:
        raise RuntimeError(
            f"initialization_timeout={asked:g} asked for, but this "
            f"process already bootstraps with {timeout_s:g} s. Pass the "
            f"same timeout to every call."
        )
    return True


def check_launch_size(comm, info) -> None:
    """Stop when the launcher started N ranks but MPI says otherwise.

    Args:
        comm: the job's communicator (checked only where it is the world).
        info: what :func:`mpi4jax_dist.launch.detect.detect` found, or None.
    """
    from mpi4py import MPI

    if info is None or info.size is None:
        return
    if MPI.Comm.Compare(comm, MPI.COMM_WORLD) != MPI.IDENT:
        return
    if comm.Get_size() != info.size:
        raise RuntimeError(
            f"The launcher ({info.launcher}) started {info.size} ranks but MPI says "
            f"this job has {comm.Get_size()}: mpi4py talks to another MPI than the "
            f"mpiexec that started it (mpi4py uses: {_mpi.mpi_library()}). Start the "
            f"job with the mpiexec of that MPI, or rebuild mpi4py against the "
            f"launcher's (pip install --no-binary mpi4py mpi4py, with its mpicc on "
            f"PATH)."
        )
