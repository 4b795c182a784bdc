"""mpi4jax_dist's pytest plugin (pytest_mpi4jax_dist.py), on a users' suite of its
own: the jax_world fixture and marker with --jax-world, a skip without it."""

import textwrap

import util

pytestmark = util.skip_in_mpi_job

SUITE = """
import jax
import pytest
from mpi4py import MPI


def test_first_starts_the_backend_on_its_own():
    # The world must be up before this runs, or the tests below could not have it.
    assert float(jax.numpy.ones(3).sum()) == 3.0


@pytest.mark.jax_world
def test_marked_gets_the_world():
    comm = MPI.COMM_WORLD
    assert (jax.process_index(), jax.process_count()) == (comm.rank, comm.size)


def test_fixture_is_the_topology(jax_world):
    comm = MPI.COMM_WORLD
    assert (jax_world.rank, jax_world.size) == (comm.rank, comm.size)
"""


def _run(tmp_path, *options):
    (tmp_path / "test_users_suite.py").write_text(textwrap.dedent(SUITE))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's
    return util.run_mpi(
        ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"],
        2,
        "-c",
        tmp_path / "pytest.ini",
        tmp_path / "test_users_suite.py",
        *options,
        timeout=180,
        check=False,
    )


def test_jax_world_with_the_option(tmp_path):
    proc = _run(tmp_path, "--jax-world")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("3 passed") == 2  # on each rank


@util.variant
def test_marked_test_skipped_without_the_option(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("1 passed, 2 skipped") == 2
    assert "needs an initialized JAX world: run pytest with --jax-world" in proc.stdout
