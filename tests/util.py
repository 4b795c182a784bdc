"""Helpers for tests that start MPI jobs in a subprocess, with a timeout."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpi4jax_dist.launch import detect

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = HERE / "scripts"
# sitecustomize.py: a job's Pythons skip CPython's last collections at exit.
QUICK_EXIT = HERE / "quick_exit"
BIN = Path(sys.executable).parent

# Variables a launcher leaves in our own environment: a child mpiexec must not see
# them, or it joins (or confuses) the job this test runs in. The user's own MPI
# settings (OMPI_MCA_*, OMPI_ALLOW_RUN_AS_ROOT, ...) stay.
_LAUNCHER_PREFIXES = (
    "PMI_",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "PMIX_SERVER",
    "OMPI_COMM_WORLD_",
    "OMPI_UNIVERSE",
    "OMPI_FIRST",
    "MPI_LOCAL",
    "HYDRA_",
    "PRTE_LAUNCHED",
    "PALS_",
    "MV2_",
    "JSM_",
    "FLUX_",
    "SLURM_",
    "ALPS_",
)


def mpiexec() -> str:
    """Return ``TEST_MPIEXEC`` where set (a site's MPI installed beside another, as
    Debian's ``mpiexec.mpich``: tools/site_mpi.sh), else the mpiexec beside this
    Python (the venv's), else the one on PATH."""
    chosen = os.environ.get("TEST_MPIEXEC")
    if chosen:
        return shutil.which(chosen) or chosen
    here = BIN / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec beside this Python nor on PATH; run tools/setup.sh")
    return found


@functools.cache
def mpi_family() -> str:
    """Return ``openmpi``, ``impi`` (Intel MPI) or ``mpich``: whose mpiexec
    :func:`mpiexec` is."""
    out = subprocess.run(
        [mpiexec(), "--version"], capture_output=True, text=True, timeout=30
    )
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "prte" in text or "openrte" in text:
        return "openmpi"
    return "impi" if "intel(r) mpi" in text else "mpich"


def expected_launcher() -> str:
    """Return the launcher name mpi4jax_dist should report under :func:`mpiexec`."""
    return {"openmpi": "openmpi", "mpich": "mpich-hydra", "impi": "intel-mpi"}[
        mpi_family()
    ]


def needs_pretend_nodes():
    """Skip unless MPICH's fork launcher can pretend several nodes on this host."""
    if mpi_family() != "mpich":
        pytest.skip(
            "pretend nodes need MPICH's -launcher fork -hosts; this mpiexec "
            f"is {mpi_family()}'s"
        )


def in_mpi_job() -> bool:
    """Return True when this test process itself runs under an MPI launcher."""
    return detect.detect(os.environ) is not None


skip_in_mpi_job = pytest.mark.skipif(
    in_mpi_job(),
    reason="starts its own mpiexec: runs in the serial session (python -m pytest)",
)

# One process whose outcome is the same on every rank: under mpiexec each rank
# would only repeat it.
serial_only = pytest.mark.skipif(
    in_mpi_job(),
    reason="one process, alike on every rank: runs in the serial session",
)


# What a test checks is the package's own logic, alike under every MPI (a process
# with no launcher, a switch, a message, a port): tools/test.sh runs it under
# MPICH, and its Open MPI and Intel MPI stages, which are there for what differs
# between the MPIs, leave it out (-m "not same_under_every_mpi").
same_under_every_mpi = pytest.mark.same_under_every_mpi

# What a test checks differs between MPIs (their launchers, aborts, thread levels,
# libraries): tools/test.sh runs it under Open MPI and Intel MPI too (-m every_mpi).
every_mpi = pytest.mark.every_mpi

# What a test checks does not meet what changes between JAX versions (stacks on a
# signal, a stopped process, the package's C thread), or meets it only as the tests
# kept do (the launcher, network, limit and benchmark tests): the stages of another
# JAX in tools/test.sh leave it out (-m "not same_under_every_jax").
same_under_every_jax = pytest.mark.same_under_every_jax


# A further case of a mechanism that another test of its file already runs under
# every MPI and JAX (another value of the same variable, another exit code, a
# second pretend layout): tools/test.sh runs it in .venv, and its stages of another
# MPI or JAX leave it out (-m "not variant") unless given --full: CI's two cores
# spend less on what repeats, and each mechanism still meets every MPI and JAX.
variant = pytest.mark.variant


# Minutes of builds that CI's two cores cannot spend on every run (README's install
# block in a fresh environment): tools/test.sh runs it with --full, before a release.
full_only = pytest.mark.full_only


# What a test asserts needs more than two ranks to show: ranks with two distinct
# neighbours, a reduction of the package's own over more than a pair, groups of
# several ranks, a rank order or layout beyond ranks 0 and 1. tools/test.sh runs
# these, and only these, under mpiexec -n 4 (-m more_ranks); every test marked mpi
# runs under mpiexec -n 2.
more_ranks = pytest.mark.more_ranks


# The folders of tests run with peers (tests/peers, and tests/gpu's, which need a
# GPU): the only ones collected under mpiexec --with-mpi (tests/conftest.py). The
# others' tests run in one process, or start their own jobs (tests/jobs). Not
# "mpi": pytest-mpi takes a test for one marked mpi where "mpi" is among its
# keywords, which hold the names of its folders.
WITH_PEERS = ("peers", "gpu")


# Variables that change what mpi4jax_dist or JAX choose: set only by the tests that
# are about them.
_CHOICES = (
    "MPI4JAX_DIST_",
    "JAX_COORDINATOR_",
    "JAX_LOCAL_DEVICE_IDS",
    "JAX_NUM_CPU_DEVICES",
    "no_grpc_proxy",
    # which devices a process sees: set by the tests that mean it
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
    "ZE_FLAT_DEVICE_HIERARCHY",
    "GPU_VENDOR",
    "GPUS_PER_NODE",
    "TILES_PER_GPU",
)


# The tests' jobs oversubscribe the cores (4 ranks on 2, two jobs at a time). A rank
# waiting in an MPI call polls: MPICH's yields by sched_yield, which on an
# oversubscribed core passes it to another waiting rank rather than to one with
# work, and Open MPI's and Intel MPI's spin (a rank waiting 10 s in a barrier: 9.95
# to 9.99 CPU-s under each). Each is told to sleep instead: MPICH by
# MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (nanosleep), Open MPI by a nanosleep of 100 us as
# its yield, Intel MPI by a usleep of 100 us (I_MPI_THREAD_YIELD=3): 1.6, 0.7 and
# 0.9 CPU-s in that barrier (2026-12-08), and the answers are the same (tests/jobs'
# test_hangs.py and test_standstill.py under MPICH: 290 CPU-s without, 219 with, in
# 223-228 s either way, 2026-12-07). Each MPI ignores the others' variables.
# clean_env sets them unless the environment does; a test whose check is a rank's
# CPU while MPI waits runs with MPI's default way of waiting (SPIN).
YIELD = {
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_threads_pthreads_yield_strategy": "nanosleep",
    "OMPI_MCA_threads_pthreads_nanosleep_time": "100000",
    "I_MPI_THREAD_YIELD": "3",
    "I_MPI_THREAD_SLEEP": "100",
}
SPIN = {
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0",
    "OMPI_MCA_threads_pthreads_yield_strategy": "sched_yield",
    "I_MPI_THREAD_YIELD": "0",
}


def clean_env(*, full_exit: bool = False, **extra) -> dict:
    """Return os.environ without launcher variables or our settings, with JAX on CPU
    and the MPI's waiting ranks sleeping (:data:`YIELD`), plus ``extra``.

    The job's Pythons skip CPython's last garbage collections at exit
    (tests/quick_exit/sitecustomize.py says why), unless ``full_exit``: a test of
    a plain exit as users meet it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES + _CHOICES)
    }
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    for name, value in YIELD.items():
        env.setdefault(name, value)
    # The scripts import their helpers (launch_common) from their own folder, which
    # Python leaves off sys.path under PYTHONSAFEPATH=1 (how an installed copy of the
    # package is tested rather than the source tree's): it is named here.
    ours = [str(SCRIPTS)] if full_exit else [str(SCRIPTS), str(QUICK_EXIT)]
    env["PYTHONPATH"] = os.pathsep.join(
        ours + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if os.geteuid() == 0:  # Open MPI refuses root without these; MPICH ignores them
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_mpi(
    script,
    n: int,
    *args,
    hosts: str | None = None,
    timeout: float = 180,
    env: dict | None = None,
    check: bool = True,
    mpiexec_args=(),
    python: str = sys.executable,
    nofile: tuple[int, int] | None = None,
):
    """Run ``mpiexec -n n python script args`` and return the CompletedProcess.

    Args:
        script: a path, the name of a file in tests/scripts/, or a list of
            Python's own arguments (``["-m", "mpi4jax_dist"]``).
        hosts: MPICH's pretend nodes, e.g. ``"nodeA:2,nodeB:2"`` (fork launcher).
        timeout: seconds before the whole job is killed (the test then fails).
        check: fail the test, showing the output, when the exit status is not 0.
        python: the interpreter the ranks run (default: this one).
        nofile: ``(soft, hard)`` open-file limits for mpiexec and the ranks,
            set by a small Python that then becomes mpiexec (no fork of this
            process, which JAX warns against).
    """
    if isinstance(script, (list, tuple)):  # Python's own arguments, e.g. ["-m", "x"]
        python_args = [str(a) for a in script]
    else:
        path = Path(script)
        if not path.is_absolute() and not path.exists():
            path = SCRIPTS / script
        python_args = [str(path)]
    cmd = [mpiexec()]
    if hosts is not None:
        needs_pretend_nodes()
        cmd += ["-launcher", "fork", "-hosts", hosts]
    if mpi_family() == "openmpi":  # more ranks than the 2 cores here
        cmd += ["--oversubscribe"]
    cmd += [*mpiexec_args, "-n", str(n), python, *python_args, *map(str, args)]
    if nofile is not None:
        cmd = [sys.executable, "-c", _WITH_NOFILE, *map(str, nofile), *cmd]
    proc = run_command(cmd, env=clean_env() if env is None else env, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def run_command(cmd, *, env: dict, timeout: float, cwd=ROOT):
    """Run ``cmd`` in ``cwd`` (default: the repository root) and return the
    CompletedProcess (text output captured); past ``timeout`` seconds the test
    fails, showing what the command had printed."""
    try:
        return subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{_text(err)}")


# argv: soft hard command...: set the open-file limits, then become the command.
_WITH_NOFILE = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execvp(sys.argv[3], sys.argv[3:])"
)


def _text(err) -> str:
    out = err.stdout or b""
    out = out.decode(errors="replace") if isinstance(out, bytes) else out
    errs = err.stderr or b""
    errs = errs.decode(errors="replace") if isinstance(errs, bytes) else errs
    return out + errs


def all_ranks(ok, what):
    """Assert ``ok`` on every rank of COMM_WORLD, failing on all if it fails on one.

    The outcome is gathered first, so that one failing rank does not leave the
    others waiting in the next collective.
    """
    from mpi4py import MPI

    failed = MPI.COMM_WORLD.allgather(None if ok else what)
    bad = {rank: msg for rank, msg in enumerate(failed) if msg is not None}
    assert not bad, f"failed on ranks {sorted(bad)}: {bad}"


def load_benchmark(name: str, folder: Path = ROOT / "benchmarks"):
    """Import ``benchmarks/<name>.py`` (or ``<folder>/<name>.py``) as a module (its
    ``main`` and helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"benchmark_{name}", folder / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as import does: dataclasses look it up
    spec.loader.exec_module(module)
    return module


def load_conf(name: str):
    """Import a module of the build machinery, ``conf/<name>.py`` (its functions;
    importing it builds nothing), as setup.py does: with ``conf/`` on sys.path."""
    import importlib

    conf = str(ROOT / "conf")
    if conf not in sys.path:
        sys.path.insert(0, conf)
    return importlib.import_module(name)


def exact_inputs(dtype: str, op: str, rank: int, seed: int, n: int = 37):
    """Per-rank inputs for an allreduce with ``op`` (an MPI op's name) whose result
    is exact and fits ``dtype`` at 4 ranks; drawn from ``seed + rank``."""
    import numpy as np

    rng = np.random.default_rng(seed + rank)
    if dtype == "bool" or op in ("LAND", "LOR", "LXOR"):
        base = rng.integers(0, 2, n)
    elif op == "PROD":
        base = rng.integers(1, 3, n)  # 2**4 fits int8
    elif op in ("BAND", "BOR", "BXOR"):
        base = rng.integers(0, 128, n)
    else:
        base = rng.integers(0, 50, n) - (25 if dtype[0] in "fic" else 0)
    if dtype.startswith("complex"):
        return (base + 1j * rng.integers(0, 2, n)).astype(dtype)
    return base.astype(dtype)


def repository_files() -> list[str]:
    """Return the tree's files as a clean clone would have them, with uncommitted
    changes and new files: git's tracked and untracked, less the ignored."""
    proc = run_command(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        env=clean_env(),
        timeout=60,
    )
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout (git ls-files: {proc.stderr.strip()})")
    return [f for f in proc.stdout.split("\0") if (ROOT / f).is_file()]


def copy_repository(dest: Path) -> None:
    """Copy :func:`repository_files` to ``dest``: building there writes nothing
    into the tree."""
    for name in repository_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes((ROOT / name).read_bytes())


def result_texts(stdout: str, marker: str = "RESULT ") -> list[str]:
    """The texts (JSON, for ``RESULT ``) after each ``marker`` in ``stdout``, to
    the end of its line.

    Split on the marker, not on lines: a launcher's output forwarding can put two
    ranks' lines on one (seen under Intel MPI's Hydra and, under load, MPICH's).
    """
    return [chunk.splitlines()[0] for chunk in stdout.split(marker)[1:]]


def seconds_from(mark: str, stdout: str, start: float, end: float) -> float:
    """Seconds from a job's cause to ``end``: a rank prints ``<mark> AT <t>``
    (``time.monotonic()``, one clock for every process of a machine) just before
    the cause, and the earliest such line counts; where none came, from ``start``,
    the launch, which is stricter. From the launch, a check also counts the ranks'
    JAX start-ups, seconds under CI's load: a job that failed at once took 32 s
    from its launch in CI's lanes, of a 30 s check (2026-12-07)."""
    stamps = [
        float(found.group(0))
        for text in result_texts(stdout, f"{mark} AT ")
        if (found := re.match(r"\d+\.\d+", text))
    ]
    return end - (min(stamps) if stamps else start)


def result_lines(proc, n: int, key: str) -> list[dict]:
    """Return the ``RESULT {json}`` records of a job that exited 0, ``n`` of them,
    sorted by ``key`` (:func:`result_texts`)."""
    shown = f"\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, shown
    found = [json.loads(text) for text in result_texts(proc.stdout)]
    assert len(found) == n, f"expected {n} RESULT lines{shown}"
    return sorted(found, key=lambda r: r[key])
