"""mpi4jax's tokens made inside the program (MPI4JAX_DIST_TOKENS_IN_PROGRAM,
:func:`mpi4jax_dist._compat.tokens_in_program`, on by default on the JAX versions
it ran on).

Each case runs tests/scripts/tokens_in_program.py in a 2-rank job of its own (the
setting is read when the first op is lowered, and changes JAX's lowering for the
whole process). Serially: python -m pytest tests/jobs/test_tokens_in_program.py.
"""

import re

import pytest
import util

pytestmark = [pytest.mark.mpi_skip, pytest.mark.usefixtures("mpi4jax_installed")]


@pytest.fixture
def mpi4jax_installed():
    pytest.importorskip("mpi4jax")


def run(setting: str | None, **env) -> dict[int, dict[str, str]]:
    if setting is not None:
        env["MPI4JAX_DIST_TOKENS_IN_PROGRAM"] = setting
    proc = util.run_mpi(
        "tokens_in_program.py", 2, timeout=300, env=util.clean_env(**env)
    )
    found = {0: {}, 1: {}}
    for rank, key, value in re.findall(r"^rank (\d): (\S+) (.*)$", proc.stdout, re.M):
        found[int(rank)][key] = value
    return found


RUNTIME_TOKENS = {
    "token-params": "1",
    "ordered-effects": "1",
    "python-dispatches": "10",
    "crossed": "0",
    "barrier-waited": "True",
}


IN_PROGRAM = {
    "token-params": "0",
    "ordered-effects": "0",
    "python-dispatches": "0",
    "crossed": "0",
    "barrier-waited": "True",
}


def test_tokens_in_program_give_the_cpp_dispatch_and_keep_the_order():
    """By default, on a JAX it ran on: the program takes and returns no runtime
    token, its executable has no ordered effect, its calls after the first take
    JAX's C++ path; programs dispatched back to back keep their order across
    ranks (PJRT CPU launches a device's programs one after the other), and
    ``jax.effects_barrier()`` still waits for a program that is running."""
    import jax

    from mpi4jax_dist import _compat

    ran = jax.__version_info__[:2] in _compat.TOKENS_IN_PROGRAM_RAN
    for rank, found in run(None).items():
        assert found == (IN_PROGRAM if ran else RUNTIME_TOKENS), (rank, found)


def test_a_lost_order_between_programs_is_seen():
    """Fault injection: one rank dispatches two programs the other way round, as
    a lost order would; the count of crossed results sees it."""
    for rank, found in run(None, SWAP="1", ROUNDS="20").items():
        assert int(found["crossed"]) > 0, (rank, found)


def test_runtime_tokens_when_turned_off():
    """``MPI4JAX_DIST_TOKENS_IN_PROGRAM=0``: JAX's convention, a runtime token in
    and out and every call through JAX's Python dispatch; the same order and
    barrier."""
    for rank, found in run("0", ROUNDS="20").items():
        assert found == RUNTIME_TOKENS, (rank, found)


def test_runtime_tokens_with_several_cpu_devices():
    """On, with two CPU devices in each process: JAX's convention still. PJRT
    orders launches per device, and programs on two devices crossed their
    allreduces where JAX's token, moved between devices, ordered them."""
    for rank, found in run("1", JAX_NUM_CPU_DEVICES=2, ROUNDS="20").items():
        assert found == RUNTIME_TOKENS, (rank, found)
