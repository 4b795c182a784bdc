"""Serial: which environments count as an MPI launch (faked launcher variables)."""

import pytest
import util

from mpi4jax_dist.launch import detect

pytestmark = util.same_under_every_jax

# (launcher variables as each launcher sets them, expected name, expected size)
LAUNCHES = [
    (
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "4",
            "PMI_FD": "7",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
            "PMI_HOSTNAME": "n1",
        },
        "mpich-hydra",
        4,
    ),
    (
        {
            "PMI_RANK": "0",
            "PMI_SIZE": "2",
            "MPI_LOCALRANKID": "0",
            "I_MPI_ROOT": "/opt/intel/mpi",
        },
        "intel-mpi",
        2,
    ),
    (
        # Intel MPI 2021 from PyPI (impi-rt): its Hydra sets no I_MPI_ROOT, but
        # I_MPI_HYDRA_UUID on every rank (and HYDRA_BSTRAP_PROXY_ID).
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "2",
            "PMI_FD": "9",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
            "I_MPI_HYDRA_UUID": "1f470000-55ac-6b8c-8b61-06000e30ef75",
            "HYDRA_BSTRAP_PROXY_ID": "0",
        },
        "intel-mpi",
        2,
    ),
    (
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "PMIX_RANK": "3",
            "PRTE_LAUNCHED": "1",
        },
        "openmpi",
        8,
    ),
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-x"}, "pmix", None),
    (
        {
            "MV2_COMM_WORLD_RANK": "0",
            "MV2_COMM_WORLD_SIZE": "16",
            "MV2_COMM_WORLD_LOCAL_RANK": "0",
        },
        "mvapich",
        16,
    ),
    (
        {
            "PALS_RANKID": "5",
            "PALS_LOCAL_RANKID": "1",
            "PALS_NODEID": "2",
            "PALS_APID": "abc",
            "PMI_RANK": "5",
            "PMI_SIZE": "8",
        },
        "cray-pals",
        None,
    ),
    ({"ALPS_APP_PE": "2", "ALPS_APP_ID": "123"}, "cray-alps", None),
    (
        {
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "4",
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "PMI_FD": "9",
        },
        "slurm-pmi",
        4,
    ),
    (
        {
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "4",
            "PMIX_RANK": "3",
        },
        "slurm-pmix",
        4,
    ),
    (
        {
            "JSM_NAMESPACE_RANK": "0",
            "JSM_NAMESPACE_SIZE": "6",
            "JSM_NAMESPACE_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_RANK": "0",
        },
        "ibm-jsrun",
        6,
    ),
    (
        {
            "FLUX_TASK_RANK": "1",
            "FLUX_JOB_SIZE": "2",
            "FLUX_TASK_LOCAL_ID": "1",
            "PMI_RANK": "1",
        },
        "flux",
        2,
    ),
    # mpiexec inside a Slurm allocation: Hydra's variables win over the batch step's.
    (
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "PMI_RANK": "2",
            "PMI_SIZE": "4",
            "MPI_LOCALRANKID": "0",
        },
        "mpich-hydra",
        4,
    ),
]

NOT_LAUNCHES = [
    {},
    {"HOME": "/root", "PATH": "/usr/bin"},
    # A Slurm batch script or plain srun without an MPI plugin is not an MPI launch.
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},
    {"OMPI_MCA_btl": "self"},  # a user's Open MPI setting, not a launch
]


@pytest.mark.parametrize(
    "env, name, size", LAUNCHES, ids=[case[1] for case in LAUNCHES]
)
def test_launchers_detected(env, name, size):
    info = detect.detect(env)
    assert info is not None
    assert (info.launcher, info.size) == (name, size)
    assert set(info.variables) <= set(env)


@pytest.mark.parametrize("env", NOT_LAUNCHES)
def test_plain_runs_not_detected(env):
    assert detect.detect(env) is None
    assert detect.launcher_rank(env) is None


@pytest.mark.parametrize(
    "env, rank",
    [
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, 1),
        ({"OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3"}, 3),
        ({"PALS_RANKID": "7", "PALS_APID": "x", "PMI_RANK": "7"}, 7),
        ({"SLURM_PROCID": "2", "PMIX_RANK": "2"}, 2),
        ({"PMIX_RANK": "x"}, None),  # not a number: not known
        ({"SLURM_PROCID": "0"}, None),  # a batch script: no launch
    ],
)
def test_the_launcher_s_rank_where_it_sets_one(env, rank):
    """Only for which rank prints mpi4jax's warning at import; the rank the
    package uses comes from MPI."""
    assert detect.launcher_rank(env) == rank
