import os
import sys

# tests/util.py is imported as `util` by the test modules.
sys.path.insert(0, os.path.dirname(__file__))
# JAX on the CPU everywhere in the test session, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402
import util  # noqa: E402


@pytest.fixture(scope="session")
def world(jax_world):
    """JAX initialized once per test process through mpi4jax_dist: the package's
    own pytest plugin's fixture (turned on in pyproject.toml)."""
    return jax_world


def pytest_ignore_collect(collection_path, config):
    """Under mpiexec (--with-mpi), collect only the folders of tests run with peers
    (util.WITH_PEERS): the tests of the others would only repeat the serial
    session on every rank. A file named on the command line is collected all the
    same."""
    if (
        config.getoption("--with-mpi")
        and collection_path.parent == util.HERE
        and collection_path.is_dir()
        and collection_path.name not in util.WITH_PEERS
    ):
        return True
    return None
