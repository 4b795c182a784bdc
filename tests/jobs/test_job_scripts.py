"""The job scripts in examples/ (PBS Pro + PALS, Slurm), run as they are.

Each script names its launcher in one variable (``MPIEXEC``, ``SRUN``) and that
launcher's site flags in another (``MPIEXEC_FLAGS``, ``SRUN_FLAGS``). The tests set
them to the local mpiexec and MPICH's pretend nodes, fake the allocation the batch
system would give (``PBS_NODEFILE``; ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``)
and run the script itself with bash: its node and rank counts, its diagnostics
first, its GPU wrapper and the program. A stub launcher that only records its
arguments shows the commands a real site gets.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.same_under_every_jax]

EXAMPLES = util.ROOT / "examples"
PROGRAM = util.SCRIPTS / "job_program.py"
PREFIX = "RESULT "
TIMEOUT = 120  # seconds per script: two launches of a few seconds each
NODES = ("nodeA", "nodeB")
PER_NODE = 2  # ranks (GPUs) per pretend node


def _run(script: str, *args, **env) -> subprocess.CompletedProcess:
    """Run ``bash examples/<script> args`` from the repository root, with this
    Python's bin first on PATH (its python and mpiexec) and JAX on CPU; each
    rank's exit as users meet it (util.clean_env's full_exit)."""
    path = f"{util.BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    cmd = ["bash", str(EXAMPLES / script), *map(str, args)]
    return util.run_command(
        cmd, env=util.clean_env(full_exit=True, PATH=path, **env), timeout=TIMEOUT
    )


def _check_job(proc, device=lambda local: {"cuda_visible_devices": str(local)}):
    """Assert: exit 0; the diagnostics (rank 0's report) before the program; one
    line per rank, with JAX's process index the rank, and the device variables
    ``device(local rank)`` gives."""
    shown = f"\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, f"exit status {proc.returncode}{shown}"
    out = proc.stdout
    n = len(NODES) * PER_NODE
    assert out.startswith(f"{len(NODES)} nodes, {PER_NODE} "), shown
    assert f", {n} " in out.splitlines()[0], shown
    first_result = out.find(PREFIX)
    assert first_result >= 0, f"no program output{shown}"
    for line in ("launcher      mpich-hydra", "coordinator   ", "check         "):
        assert 0 <= out.find(line) < first_result, f"{line!r} not before it{shown}"
    assert "mpi4jax.allreduce == psum: True" in out, shown
    results = [
        json.loads(line[len(PREFIX) :])
        for line in out.splitlines()
        if line.startswith(PREFIX)
    ]
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == list(range(n)) and len(results) == n, shown
    for rank, r in by_rank.items():
        node, local = divmod(rank, PER_NODE)  # --ppn / ntasks-per-node: blocks
        assert (r["size"], r["process_count"]) == (n, n), r
        assert r["process_index"] == rank, r
        assert (r["node_index"], r["num_nodes"], r["local_rank"]) == (
            node,
            len(NODES),
            local,
        ), r
        assert {k: r[k] for k in device(local)} == device(local), r


def test_pbs_pals(tmp_path):
    util.needs_pretend_nodes()
    nodefile = tmp_path / "nodefile"  # select=2: each node once
    nodefile.write_text("".join(f"{node}\n" for node in NODES))
    proc = _run(
        "pbs_pals.sh",
        "python",
        PROGRAM,
        PBS_NODEFILE=nodefile,
        GPUS_PER_NODE=PER_NODE,
        MPIEXEC=util.mpiexec(),
        MPIEXEC_FLAGS=f"-launcher fork -f {nodefile}",
    )
    _check_job(proc)


def test_pbs_aurora(tmp_path):
    """One tile per rank: one GPU of two tiles per pretend node, under FLAT (tiles
    numbered across the node) and COMPOSITE (gpu.tile)."""
    util.needs_pretend_nodes()
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{node}\n" for node in NODES))
    for hierarchy, mask in (("FLAT", "{local}"), ("COMPOSITE", "0.{local}")):
        proc = _run(
            "pbs_aurora.sh",
            "python",
            PROGRAM,
            PBS_NODEFILE=nodefile,
            GPUS_PER_NODE=1,
            TILES_PER_GPU=PER_NODE,
            ZE_FLAT_DEVICE_HIERARCHY=hierarchy,
            MPIEXEC=util.mpiexec(),
            MPIEXEC_FLAGS=f"-launcher fork -f {nodefile}",
        )
        _check_job(
            proc,
            lambda local, mask=mask: {
                "ze_affinity_mask": mask.format(local=local),
                "cuda_visible_devices": None,
            },
        )


def test_slurm(tmp_path):
    util.needs_pretend_nodes()
    hosts = ",".join(f"{node}:{PER_NODE}" for node in NODES)
    proc = _run(
        "slurm.sh",
        "python",
        PROGRAM,
        SLURM_NNODES=len(NODES),
        SLURM_NTASKS_PER_NODE=PER_NODE,
        # What the batch step leaves to the ranks an mpiexec starts in it: the
        # wrapper must take the launcher's local rank, not SLURM_LOCALID.
        SLURM_LOCALID=0,
        SLURM_PROCID=0,
        SRUN=util.mpiexec(),
        SRUN_FLAGS=f"-launcher fork -hosts {hosts}",
    )
    _check_job(proc)


# --- the commands a real site gets, and a failing diagnostics run --------------------

STUB = """#!/bin/bash
echo "$*" >> "{log}"
case " $* " in *" -m mpi4jax_dist "*) exit {diag_status};; esac
"""


def _stub(tmp_path, diag_status: int):
    log = tmp_path / "launches"
    stub = tmp_path / "launcher"
    stub.write_text(STUB.format(log=log, diag_status=diag_status))
    stub.chmod(0o755)
    return stub, log


WRAP = "examples/set_affinity_gpu.sh"
DIAG = f"{WRAP} python -m mpi4jax_dist --check"
CASES = {
    "pbs_pals.sh": (
        "MPIEXEC",
        "-n 8 --ppn 4 --depth=16 --cpu-bind depth",
        "pbs_pals.sh: the diagnostics failed",
    ),
    "pbs_aurora.sh": (
        "MPIEXEC",
        "-n 24 --ppn 12 --cpu-bind list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:"
        "61-68:69-76:77-84:85-92:93-100",
        "pbs_aurora.sh: the diagnostics failed",
    ),
    "slurm.sh": (
        "SRUN",
        "-n 8 --mpi=pmix --cpu-bind=cores",
        "slurm.sh: the diagnostics failed",
    ),
}


def _allocation(tmp_path) -> dict:
    """Two nodes of four GPUs, as each batch system says it."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\nx1\nx2\nx2\n")  # select=2:mpiprocs=2: nodes repeated
    return dict(PBS_NODEFILE=nodefile, SLURM_NNODES=2, SLURM_NTASKS_PER_NODE=4)


@pytest.mark.parametrize("script", sorted(CASES))
def test_site_commands(tmp_path, script):
    """Without the test's flags: the site's, the diagnostics, then hello.py."""
    var, flags, _ = CASES[script]
    stub, log = _stub(tmp_path, 0)
    proc = _run(script, **{var: stub}, **_allocation(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.read_text().splitlines() == [
        f"{flags} {DIAG}",
        f"{flags} {WRAP} python examples/hello.py",
    ]


@pytest.mark.parametrize("script", sorted(CASES))
def test_failing_diagnostics_stop_the_job(tmp_path, script):
    var, flags, message = CASES[script]
    stub, log = _stub(tmp_path, 1)
    proc = _run(script, "python", "prog.py", **{var: stub}, **_allocation(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert log.read_text().splitlines() == [f"{flags} {DIAG}"]


def test_pbs_program_variable(tmp_path):
    """qsub passes no arguments: PROGRAM names the program."""
    stub, log = _stub(tmp_path, 0)
    proc = _run(
        "pbs_pals.sh",
        MPIEXEC=stub,
        PROGRAM="python my_job.py --steps 3",
        **_allocation(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        log.read_text().splitlines()[-1].endswith(f"{WRAP} python my_job.py --steps 3")
    )


AURORA = {"GPU_VENDOR": "intel", "GPUS_PER_NODE": 6, "TILES_PER_GPU": 2}
SHOW = "CUDA_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES ZE_AFFINITY_MASK"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"PALS_LOCAL_RANKID": 5}, "1 - -"),  # 5 % GPUS_PER_NODE=4
        ({"MPI_LOCALRANKID": 3, "SLURM_LOCALID": 0}, "3 - -"),  # mpiexec in Slurm
        ({"OMPI_COMM_WORLD_LOCAL_RANK": 2}, "2 - -"),
        ({"SLURM_LOCALID": 1}, "1 - -"),  # srun
        ({"PALS_LOCAL_RANKID": 6, "GPU_VENDOR": "nvidia"}, "2 - -"),
        ({"PALS_LOCAL_RANKID": 6, "GPU_VENDOR": "amd"}, "- 2 -"),
        # Aurora: 12 tiles a node; under FLAT (the default) tile 7 is device 7,
        # under COMPOSITE it is GPU 3's tile 1.
        ({"PALS_LOCAL_RANKID": 7, **AURORA}, "- - 7"),
        (
            {"PALS_LOCAL_RANKID": 7, "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", **AURORA},
            "- - 7",
        ),
        (
            {"PALS_LOCAL_RANKID": 7, "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE", **AURORA},
            "- - 3.1",
        ),
        ({"PALS_LOCAL_RANKID": 11, **AURORA}, "- - 11"),
        (
            {"PALS_LOCAL_RANKID": 7, "ZE_FLAT_DEVICE_HIERARCHY": "flat", **AURORA},
            "- - 7",
        ),
        ({"PALS_LOCAL_RANKID": 3, "GPU_VENDOR": "intel", "GPUS_PER_NODE": 6}, "- - 3"),
    ],
)
def test_affinity_wrapper(env, expected):
    """The variable of each vendor, and only that one."""
    show = " ".join(f'"${{{v}:--}}"' for v in SHOW.split())
    proc = _run(
        "set_affinity_gpu.sh",
        "bash",
        "-c",
        f"echo {show}",
        **{"GPUS_PER_NODE": 4, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{expected}\n"


def test_affinity_wrapper_unknown_vendor():
    proc = _run("set_affinity_gpu.sh", "true", PALS_LOCAL_RANKID=0, GPU_VENDOR="arm")
    assert proc.returncode == 1
    assert "GPU_VENDOR=arm is not nvidia, amd or intel" in proc.stderr


def test_affinity_wrapper_without_launcher():
    proc = _run("set_affinity_gpu.sh", "true")
    assert proc.returncode == 1
    assert "no local rank" in proc.stderr


def test_scripts_parse():
    """bash -n on each script, shellcheck where installed; the wrapper the job
    scripts execute by path is executable."""
    scripts = sorted(EXAMPLES.glob("*.sh"))
    assert {s.name for s in scripts} >= {*CASES, "set_affinity_gpu.sh"}
    for script in scripts:
        proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"
    assert os.access(EXAMPLES / "set_affinity_gpu.sh", os.X_OK)
    if shutil.which("shellcheck") is None:
        return
    proc = subprocess.run(
        ["shellcheck", *map(str, scripts)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
