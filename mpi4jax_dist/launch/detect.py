"""Was this process started by an MPI launcher? Pure functions over an environment.

Nothing here imports ``mpi4py.MPI``: answering must never start MPI. The variables
only decide whether touching MPI is safe and name the launcher in diagnostics; rank,
size and local rank always come from MPI itself (:mod:`mpi4jax_dist.launch.bootstrap`),
but for which rank prints mpi4jax's version warning at import (:func:`launcher_rank`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Launcher:
    """The variables one launcher sets on every rank.

    ``markers``: any one of them present means this launcher started us.
    ``require``: all of these must be present as well (for launchers recognised by a
    combination, such as Slurm, whose variables a batch script also carries).
    ``size``: the variable holding the number of ranks, where there is one.
    """

    name: str
    markers: tuple[str, ...]
    require: tuple[str, ...] = ()
    size: str | None = None


# Most specific first: several launchers set PMI_* or PMIX_* variables too.
LAUNCHERS = (
    # HPE Cray PALS (mpiexec under PBS Pro on Cray EX systems).
    Launcher("cray-pals", ("PALS_RANKID", "PALS_APID"), size=None),
    # Cray ALPS (aprun).
    Launcher("cray-alps", ("ALPS_APP_PE",), size=None),
    # IBM Spectrum LSF jsrun (also sets OMPI_* for Spectrum MPI).
    Launcher("ibm-jsrun", ("JSM_NAMESPACE_RANK",), size="JSM_NAMESPACE_SIZE"),
    # Flux (flux run / flux submit).
    Launcher("flux", ("FLUX_TASK_RANK",), size="FLUX_JOB_SIZE"),
    # Open MPI mpirun/mpiexec (ORTE in 4.x, PRRTE in 5.x).
    Launcher("openmpi", ("OMPI_COMM_WORLD_RANK",), size="OMPI_COMM_WORLD_SIZE"),
    # MVAPICH2 mpirun_rsh (its Hydra mpiexec sets PMI_* as well).
    Launcher("mvapich", ("MV2_COMM_WORLD_RANK",), size="MV2_COMM_WORLD_SIZE"),
    # Hydra's own local-rank variable: MPICH or Intel MPI mpiexec, also inside a Slurm
    # allocation (whose batch step leaves SLURM_PROCID=0 behind). Intel's Hydra sets
    # I_MPI_HYDRA_UUID on every rank (Intel MPI 2021 from PyPI, impi-rt, sets no
    # I_MPI_ROOT); a sourced Intel environment sets I_MPI_ROOT.
    Launcher(
        "intel-mpi",
        ("MPI_LOCALRANKID",),
        require=("I_MPI_HYDRA_UUID",),
        size="PMI_SIZE",
    ),
    Launcher(
        "intel-mpi", ("MPI_LOCALRANKID",), require=("I_MPI_ROOT",), size="PMI_SIZE"
    ),
    Launcher("mpich-hydra", ("MPI_LOCALRANKID",), size="PMI_SIZE"),
    # Slurm srun with the PMI-2 or PMIx plugin.
    Launcher(
        "slurm-pmix", ("PMIX_RANK",), require=("SLURM_PROCID",), size="SLURM_NTASKS"
    ),
    Launcher(
        "slurm-pmi", ("PMI_RANK", "PMI_FD"), require=("SLURM_PROCID",), size="PMI_SIZE"
    ),
    # Any other PMIx launcher (prterun, a PMIx-based mpiexec).
    Launcher("pmix", ("PMIX_RANK",), size=None),
    # Any other PMI-1/PMI-2 launcher (gforker, remshell, older Hydra).
    Launcher("pmi", ("PMI_RANK", "PMI_FD"), size="PMI_SIZE"),
)


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about how this process was started."""

    launcher: str
    size: int | None
    variables: dict


def detect(env: Mapping[str, str]) -> LaunchInfo | None:
    """Return the MPI launcher that started this process, or None.

    Args:
        env: the environment to look at (``os.environ`` in real use).
    """
    for launcher in LAUNCHERS:
        if not any(m in env for m in launcher.markers):
            continue
        if not all(r in env for r in launcher.require):
            continue
        return LaunchInfo(
            launcher.name,
            _int_or_none(env.get(launcher.size or "")),
            _variables(launcher, env),
        )
    return None


# The variables that hold this process's rank, where a launcher sets one (the
# marker variables above that are ranks, and Slurm's task number).
RANK_VARIABLES = (
    "PALS_RANKID",
    "ALPS_APP_PE",
    "JSM_NAMESPACE_RANK",
    "FLUX_TASK_RANK",
    "OMPI_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
)


def launcher_rank(env: Mapping[str, str]) -> int | None:
    """Return the rank the launcher's variables give this process, or None.

    Only for what must be decided before MPI is up and costs nothing when wrong
    (which rank prints mpi4jax's version warning at import); the rank itself
    comes from MPI.
    """
    if detect(env) is None:
        return None
    for name in RANK_VARIABLES:
        rank = _int_or_none(env.get(name))
        if rank is not None:
            return rank
    return None


def mpi_initialized_here() -> bool:
    """Return True when mpi4py.MPI is imported in this process and MPI is up.

    Looks in ``sys.modules`` only, so a process that never imported mpi4py.MPI is not
    made to import it.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        return bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())
    except Exception:  # a half-imported or broken module: not ours to judge
        return False


def _int_or_none(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _variables(launcher: Launcher, env: Mapping[str, str]) -> dict:
    names = set(launcher.markers) | set(launcher.require)
    if launcher.size:
        names.add(launcher.size)
    prefixes = (
        "PMI_",
        "PMIX_",
        "OMPI_COMM_WORLD_",
        "MPI_LOCAL",
        "PALS_",
        "ALPS_APP_",
        "MV2_COMM_WORLD_",
        "JSM_NAMESPACE_",
        "FLUX_TASK_",
        "PRTE_LAUNCHED",
    )
    names.update(k for k in env if k.startswith(prefixes))
    return {k: env[k] for k in sorted(names) if k in env}
