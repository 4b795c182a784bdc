"""The package's public names do not collide with what users' tools look for."""

import subprocess
import sys

import util

pytestmark = util.skip_in_mpi_job


def test_pytest_does_not_collect_the_request_class(tmp_path):
    """``from mpi4jax_dist import Request`` in a user's test module: ``Request``,
    whose method is named ``test``, is no test class to pytest."""
    (tmp_path / "test_user.py").write_text(
        "from mpi4jax_dist import Request, iallreduce\n\n\n"
        "def test_something():\n"
        "    assert callable(iallreduce) and callable(Request.test)\n"
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


def test_the_package_exports_no_generic_names():
    """No ``wait``, ``test`` or ``overlap`` at the package's top level: they are
    the methods of ``Request``."""
    import mpi4jax_dist

    generic = {"wait", "test", "overlap"}
    assert not generic & set(mpi4jax_dist.__all__)
    assert not any(hasattr(mpi4jax_dist, name) for name in generic)
    assert generic <= set(dir(mpi4jax_dist.Request))


def test_cg_module_exports_its_api_only():
    from mpi4jax_dist import cg

    assert all(hasattr(cg, name) for name in cg.__all__)
    assert not {"jax", "jnp", "np", "logger", "lax"} & set(cg.__all__)


def test_global_mesh_takes_jax_axis_types():
    import jax
    import pytest

    import mpi4jax_dist

    kinds = jax.sharding.AxisType
    for kind in (kinds.Auto, kinds.Explicit):
        assert mpi4jax_dist.global_mesh(axis_type=kind).axis_types == (kind,)
    assert mpi4jax_dist.global_mesh(axis_type="explicit").axis_types == (
        kinds.Explicit,
    )
    with pytest.raises(ValueError, match="axis_type=.*expected 'auto' or"):
        mpi4jax_dist.global_mesh(axis_type=kinds.Manual)
