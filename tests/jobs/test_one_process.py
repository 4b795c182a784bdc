"""One script, any launch: ``python script.py`` is a one-process JAX world.

With ``import mpi4jax_dist``, the script that initializes under ``mpiexec`` also runs
without a launcher (``OneProcessCluster``, asked last): no MPI started, nothing
listening beyond loopback, and JAX's own environments (here Slurm without MPI) still
asked before it. Real processes; the Slurm launch is faked by its variables.
"""

from __future__ import annotations

import ipaddress
import sys

import numpy as np
import pytest
import util
from util import skip_in_mpi_job

from mpi4jax_dist import _compat
from mpi4jax_dist.launch import cluster

pytestmark = util.every_mpi

TIMEOUT = 120
SCRIPT = util.SCRIPTS / "any_launch.py"
# What any_launch.py computes, whatever the number of processes.
EXPECTED_MEAN = float(np.mean(np.sin(np.arange(4096, dtype=np.float32))))


def results(proc, n: int) -> list[dict]:
    """The RESULT lines of ``proc``, one per process, by process index."""
    return util.result_lines(proc, n, "process_index")


def plain(**env):
    """``python any_launch.py``, no launcher."""
    cmd = [sys.executable, str(SCRIPT)]
    return util.run_command(cmd, env=util.clean_env(**env), timeout=TIMEOUT)


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_asked_last_and_ours_first():
    registry = _compat.ClusterEnv._cluster_types
    assert registry[0] is cluster.Mpi4jaxDistCluster
    assert registry[-1] is cluster.OneProcessCluster
    assert registry.count(cluster.OneProcessCluster) == 1
    assert not cluster.OneProcessCluster.opt_in_only_method


@util.same_under_every_mpi
@skip_in_mpi_job
def test_present_only_without_launcher_and_switch():
    code = (
        "import mpi4jax_dist, sys; "
        "from mpi4jax_dist.launch.cluster import OneProcessCluster as C; "
        "print(C.is_env_present(), 'mpi4py.MPI' in sys.modules)"
    )

    def ask(**env):
        cmd = [sys.executable, "-c", code]
        proc = util.run_command(cmd, env=util.clean_env(**env), timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert ask() == ["True", "False"]
    assert ask(MPI4JAX_DIST_ONE_PROCESS=0) == ["False", "False"]
    assert ask(MPI4JAX_DIST_DISABLE=1) == ["False", "False"]
    # Under a launcher (faked: MPICH's variables) the MPI env answers, not this one.
    assert ask(PMI_RANK=0, PMI_SIZE=1, MPI_LOCALRANKID=0) == ["False", "False"]


@util.same_under_every_mpi
@skip_in_mpi_job
def test_env_registered_after_ours_is_asked_first():
    """A site's own ClusterEnv, defined after ``import mpi4jax_dist``, lands behind
    the fallback in JAX's list; the fallback steps aside while it is present."""
    code = """
import mpi4jax_dist
from mpi4jax_dist.launch import cluster
from mpi4jax_dist import _compat

class SiteCluster(_compat.ClusterEnv):
    name = "site"
    present = True

    @classmethod
    def is_env_present(cls):
        return cls.present

last = _compat.ClusterEnv._cluster_types[-1] is SiteCluster
with_site = cluster.OneProcessCluster.is_env_present()
SiteCluster.present = False
print(last, with_site, cluster.OneProcessCluster.is_env_present())
"""
    cmd = [sys.executable, "-c", code]
    proc = util.run_command(cmd, env=util.clean_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "True"]


@skip_in_mpi_job
@pytest.mark.parametrize(
    "launch", [pytest.param("python", marks=util.same_under_every_mpi), "mpiexec -n 2"]
)
def test_one_script_any_launch(launch, tmp_path):
    if launch == "python":
        # A timeline asked for: it needs MPI, which a one-process run does not
        # start; said, not silently left out.
        proc = plain(MPI4JAX_DIST_TIMELINE=tmp_path / "timeline")
        found = results(proc, 1)
        assert (
            "MPI4JAX_DIST_TIMELINE is set, but a one-process run (no launcher) writes "
            "no timeline" in proc.stderr
        ), proc.stderr
        assert not (tmp_path / "timeline").exists()
    else:
        proc = util.run_mpi(SCRIPT, 2, env=util.clean_env(), timeout=TIMEOUT)
        found = results(proc, 2)
    for r in found:
        assert r["process_count"] == len(found)
        assert r["mean"] == pytest.approx(EXPECTED_MEAN, rel=1e-5, abs=1e-6)
        assert r["cluster_env"] == (
            "OneProcessCluster" if launch == "python" else "Mpi4jaxDistCluster"
        )
    if launch == "python":
        (r,) = found
        assert r["mpi_started"] is False
        assert r["listening"], "JAX's coordination service listens somewhere"
        assert all(loopback(ip) for ip in r["listening"]), r["listening"]


@util.same_under_every_mpi
@skip_in_mpi_job
def test_jax_slurm_env_still_asked_before_the_fallback():
    """``python script.py`` in a Slurm step without MPI (srun without --mpi: no PMI
    variables): JAX's SlurmCluster gives the world, not the fallback."""
    slurm = dict(
        SLURM_JOB_ID=4001,
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS=1,
        SLURM_PROCID=0,
        SLURM_LOCALID=0,
        SLURM_STEP_NUM_NODES=1,
    )
    (r,) = results(plain(**slurm), 1)
    assert r["cluster_env"] == "SlurmCluster"
    assert r["mean"] == pytest.approx(EXPECTED_MEAN, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "MPI4JAX_DIST_HANG_TIMEOUT",
        pytest.param("MPI4JAX_DIST_COLLECTIVE_TIMEOUT", marks=util.variant),
    ],
)
def test_a_bad_setting_is_an_error_in_one_process_too(name):
    """Under a launcher the bootstrap refuses ``=ten``; without one the
    one-process world refuses it alike, naming the variable, instead of running
    without the timeout the user asked for."""
    proc = plain(**{name: "ten"})
    assert proc.returncode != 0, proc.stdout
    assert f"{name}='ten' is not a number of seconds" in proc.stderr, proc.stderr
