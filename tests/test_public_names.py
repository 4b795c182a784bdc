"""The package's public names do not collide with what users' tools look for."""

import subprocess
import sys

import util

pytestmark = util.skip_in_mpi_job


def test_pytest_does_not_collect_the_imported_test_function(tmp_path):
    """``from mpi4jax_dist import test`` in a user's test module: pytest would
    collect ``test(req)`` as a test and fail on its missing fixture ``req``."""
    (tmp_path / "test_user.py").write_text(
        "from mpi4jax_dist import iallreduce, test, wait\n\n\n"
        "def test_something():\n"
        "    assert callable(test) and callable(wait) and callable(iallreduce)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "test_user.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout


def test_cg_module_exports_its_api_only():
    from mpi4jax_dist import cg

    assert all(hasattr(cg, name) for name in cg.__all__)
    assert not {"jax", "jnp", "np", "logger", "lax"} & set(cg.__all__)
