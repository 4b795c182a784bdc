"""mpi4jax_dist's pytest plugin for the suites of mpi4jax codes: JAX initialized
from MPI once.

mpi4jax codes test with ``mpiexec -n N python -m pytest --with-mpi`` (pytest-mpi).
Installed with the package, and off unless asked for: ``--jax-world`` on the
command line, or ``jax_world = true`` in the ini file (``[tool.pytest.ini_options]``
of pyproject.toml). Then:

- the session fixture ``jax_world`` calls :func:`mpi4jax_dist.initialize` once,
  before any test starts JAX's backend, and returns the :class:`Topology`; under
  an MPI launcher, before the first test runs when any test of the session asks
  for it, so that a test that starts the backend without it can run first;
- the marker ``@pytest.mark.jax_world`` gives a test that fixture without naming
  it (a test that needs an initialized JAX world, e.g. one that calls ``psum``
  across processes).

Without the option a test that is marked, or asks for the fixture, is skipped with
a sentence that says how to turn the plugin on. Outside an MPI launch the world is
one process. A top-level module (not in the package), so that pytest loading it
imports neither JAX nor MPI.
"""

from __future__ import annotations

import pytest

OPTION = "--jax-world"
INI = "jax_world"
MARKER = "jax_world"
FIXTURE = "jax_world"
_WORLD_NEEDED = pytest.StashKey[bool]()
_SKIP = (
    f"needs an initialized JAX world: run pytest with {OPTION} (or set {INI} = "
    f"true in the ini file)"
)


def pytest_addoption(parser) -> None:
    group = parser.getgroup("mpi4jax_dist")
    group.addoption(
        OPTION,
        action="store_true",
        default=False,
        help="initialize JAX from MPI once per session (mpi4jax_dist): the "
        "jax_world fixture and marker",
    )
    parser.addini(
        INI,
        type="bool",
        default=False,
        help="like --jax-world: the jax_world fixture and marker of mpi4jax_dist",
    )


def enabled(config) -> bool:
    """Return whether the option or the ini setting turned the plugin on."""
    return bool(config.getoption(OPTION) or config.getini(INI))


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: the test needs JAX initialized from MPI (mpi4jax_dist); "
        f"{OPTION} or the ini setting {INI} = true turns it on",
    )


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        if not enabled(config):
            item.add_marker(pytest.mark.skip(reason=_SKIP))
        elif FIXTURE not in getattr(item, "fixturenames", [FIXTURE]):
            item.fixturenames.append(FIXTURE)
    config.stash[_WORLD_NEEDED] = enabled(config) and any(
        FIXTURE in getattr(item, "fixturenames", ()) for item in items
    )


@pytest.fixture(autouse=True)
def _jax_world_before_any_test(request):
    """Under an MPI launcher, the world before the first test runs, not at the first
    test that asks for it: a test before that one that starts JAX's backend
    (eagerly, or by compiling) would leave it unable to initialize, and which test
    failed would depend on the order they ran in. Only when some test of the
    session asks for the world; outside a launcher, at the first that does."""
    if not request.config.stash.get(_WORLD_NEEDED, False):
        return
    import os

    from mpi4jax_dist.launch import detect

    if detect.detect(os.environ) is not None:
        request.getfixturevalue(FIXTURE)


@pytest.fixture(scope="session")
def jax_world(request):
    """JAX initialized from MPI through mpi4jax_dist, once; the Topology.

    Skips the test (with a sentence saying how) when the plugin is off.
    """
    if not enabled(request.config):
        pytest.skip(_SKIP)
    import mpi4jax_dist

    return mpi4jax_dist.initialize()
