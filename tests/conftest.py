import os
import sys

# tests/util.py is imported as `util` by the test modules.
sys.path.insert(0, os.path.dirname(__file__))
# JAX on the CPU everywhere in the test session, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def world(jax_world):
    """JAX initialized once per test process through mpi4jax_dist: the package's
    own pytest plugin's fixture (turned on in pyproject.toml)."""
    return jax_world
