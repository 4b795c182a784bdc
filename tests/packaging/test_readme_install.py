"""Serial: README.rst's install block runs as written, from the root of a copy of
the repository, on a machine like CI's (Python, gcc and pip; no MPI loaded, so the
block's own fallback installs MPICH from PyPI), into a fresh virtual environment
under a HOME of its own (the block's ``~/venvs/jax``). Then a 2-rank job of that
environment initializes JAX through the package and sums with mpi4jax's
allreduce. Minutes (mpi4py and mpi4jax are built from source, as the block asks):
tools/test.sh --full runs it, CI does not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.full_only, pytest.mark.timeout(1200)]

JOB = """
import jax, jax.numpy as jnp, mpi4jax, mpi4jax_dist
jax.distributed.initialize()
from mpi4py import MPI
total = mpi4jax.allreduce(jnp.ones(3) * (jax.process_index() + 1), op=MPI.SUM)
print("RESULT", jax.process_index(), jax.process_count(), float(total[0]), flush=True)
"""


def readme_block() -> str:
    """The code block under README.rst's "Installing on a cluster"."""
    text = (util.ROOT / "README.rst").read_text()
    section = text.split("Installing on a cluster", 1)[1]
    match = re.search(r"\.\. code-block:: bash\n\n((?:    .*\n|\n)+)", section)
    assert match, "README.rst: no bash block under 'Installing on a cluster'"
    return "\n".join(line[4:] for line in match.group(1).splitlines())


def test_readme_install_block_runs_as_written(tmp_path):
    clone = tmp_path / "mpi4jax_dist"
    util.copy_repository(clone)
    home = tmp_path / "home"
    home.mkdir()
    # The machine's own PATH: no MPI of this suite's environment on it.
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if p and p != venv_bin
    )
    env = {
        k: v
        for k, v in util.clean_env().items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MPICC")
    }
    env.update(HOME=str(home), PATH=path, PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert shutil.which("python", path=path), f"no python on PATH={path}"
    proc = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + readme_block()],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bin_dir = home / "venvs" / "jax" / "bin"
    job = subprocess.run(
        [str(bin_dir / "mpiexec"), "-n", "2", str(bin_dir / "python"), "-c", JOB],
        cwd=tmp_path,
        env={**env, "PATH": f"{bin_dir}{os.pathsep}{path}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert sorted(util.result_texts(job.stdout)) == ["0 2 3.0", "1 2 3.0"], job.stdout
