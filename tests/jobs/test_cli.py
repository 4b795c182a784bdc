"""``python -m mpi4jax_dist``: --version, --help and the report, as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import util

import mpi4jax_dist


def _run(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    """Run ``python -m mpi4jax_dist args`` without a launcher, with a timeout."""
    return subprocess.run(
        [sys.executable, "-m", "mpi4jax_dist", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or util.clean_env(),
    )


def _shown(proc) -> str:
    return f"\nexit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


@util.variant
def test_version():
    proc = _run("--version")
    assert proc.returncode == 0, _shown(proc)
    assert proc.stdout == f"mpi4jax_dist {mpi4jax_dist.__version__}\n", _shown(proc)


@util.variant
def test_version_touches_neither_mpi_nor_jax_backend():
    code = (
        "import sys\n"
        "from mpi4jax_dist.diagnostics.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "from jax._src import xla_bridge\n"
        "print('MPI', 'mpi4py.MPI' in sys.modules)\n"
        "print('backend', xla_bridge.backends_are_initialized())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=util.clean_env(),
    )
    assert proc.returncode == 0, _shown(proc)
    assert proc.stdout.splitlines()[1:] == ["MPI False", "backend False"], _shown(proc)


@util.variant
def test_help_is_plain_text():
    proc = _run("--help")
    assert proc.returncode == 0, _shown(proc)
    for markup in ("``", ":func:", ":data:", ":class:"):
        assert markup not in proc.stdout, f"{markup!r} in --help:{_shown(proc)}"
    assert "mpiexec -n 2 python -m mpi4jax_dist --check" in proc.stdout
    assert 'eval "$(python -m mpi4jax_dist env)"' in proc.stdout
    assert "--version" in proc.stdout


@util.variant
def test_report_without_launcher_and_without_mpiexec_on_path(tmp_path):
    """No launcher variables and no mpiexec on PATH: the report says so, rather than
    ``mpiexec None: None`` and a launcher named ``mpi``; it names the mpiexec beside
    this Python (a virtual environment's, which a job started by its full path)."""
    env = util.clean_env(PATH=str(tmp_path))  # an empty folder: no mpiexec
    proc = _run(env=env)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, _shown(proc)  # size 1, no launcher: a problem
    assert (
        "launcher      none recognised: no launcher variables in the environment"
        in lines
    ), _shown(proc)
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    assert any(
        line.startswith(f"mpiexec       {beside} (beside this Python; not on PATH): ")
        for line in lines
    ), _shown(proc)
    assert "None" not in "\n".join(lines[:3]), _shown(proc)
    assert any("size 1 and no launcher variables" in line for line in lines)
    report = json.loads(_run("--json", env=env).stdout)
    assert report["launcher"] is None
    assert report["launcher_variables"] == {}
    assert report["mpi"]["mpiexec"] == beside
    assert report["mpi"]["mpiexec_on_path"] is False


def test_check_prints_what_readme_shows():
    """``--check`` prints the lines README.rst shows, in its order (details under
    ``--verbose``, which prints those lines and more)."""
    readme = (util.ROOT / "README.rst").read_text()
    shown = readme.split("A good run prints, from rank 0:", 1)[1]
    shown = shown.split(".. code-block:: text", 1)[1].split("\n\n")[1]
    heads = [line.split()[0] for line in shown.splitlines() if line.strip()]
    proc = util.run_mpi(["-m", "mpi4jax_dist"], 2, "--check", timeout=120)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == heads, _shown(proc)
    verbose = util.run_mpi(["-m", "mpi4jax_dist"], 2, "--check", "--verbose")
    more = verbose.stdout.splitlines()
    assert len(more) > len(lines) + 10, _shown(verbose)
    assert all(line.split()[0] in {x.split()[0] for x in more} for line in lines[:-1])


@util.same_under_every_jax
def test_report_under_mpiexec_names_the_launcher_by_its_variables():
    proc = util.run_mpi(["-m", "mpi4jax_dist"], 2, "--verbose")
    lines = proc.stdout.splitlines()
    launcher = util.expected_launcher()
    assert lines[0] == f"launcher      {launcher}, recognised by its variables:"
    assert lines[1].startswith("  ") and "=" in lines[1], _shown(proc)
    mpiexec = next(line for line in lines if line.startswith("mpiexec "))
    assert "None" not in mpiexec, _shown(proc)
    report = json.loads(util.run_mpi(["-m", "mpi4jax_dist"], 2, "--json").stdout)
    assert report["launcher"] == launcher and report["launcher_variables"]


# A psum that fails on every rank (what a blocked Gloo connection does on a
# cluster, tests/cluster/test_slurm_cluster.py): here global_mesh raises in its place.
_FAILING_CHECK = """
import runpy, sys
import mpi4jax_dist.interop as interop
def broken(*args, **kwargs):
    raise RuntimeError("simulated: Gloo context initialization failed")
interop.global_mesh = broken
sys.argv = ["mpi4jax_dist", *sys.argv[1:]]
runpy.run_module("mpi4jax_dist", run_name="__main__")
"""


def test_check_reports_a_failing_collective_without_traceback(tmp_path):
    script = tmp_path / "failing_check.py"
    script.write_text(_FAILING_CHECK)
    proc = util.run_mpi(
        script, 2, "--check", "--timeout", "30", check=False, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, _shown(proc)
    assert "Traceback" not in output, _shown(proc)
    for rank in (0, 1):
        assert (
            f"PROBLEM       rank {rank}: JAX's psum across the 2 processes failed: "
            "RuntimeError: simulated: Gloo context initialization failed"
        ) in proc.stdout.splitlines(), _shown(proc)
    assert "check         psum correct: False" in proc.stdout, _shown(proc)
    # --json: the whole of standard output is the JSON report.
    proc = util.run_mpi(script, 2, "--check", "--json", check=False, timeout=120)
    assert proc.returncode == 1, _shown(proc)
    report = json.loads(proc.stdout)
    assert report["check"]["psum_correct"] is False
    assert len(report["problems"]) == 2, report["problems"]
