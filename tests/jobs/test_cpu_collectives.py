"""JAX's own CPU collectives over MPI (``MPI4JAX_DIST_CPU_COLLECTIVES=mpi``).

Real jobs: the switch's collectives against NumPy at 2 and 4 ranks, interleaved with
mpi4jax in one jitted function; and each refusal, which must say what to do. They
start their own mpiexec (the one beside this Python: MPICH's in .venv, Open MPI's in
tools/test.sh's Open MPI stage), so they run in the serial session.
"""

from __future__ import annotations

import re
import sys

import pytest
import util
from util import skip_in_mpi_job

from mpi4jax_dist import _config, _ffi

pytestmark = util.every_mpi

TIMEOUT = 180
SWITCH = {_config.CPU_COLLECTIVES: "mpi"}
OPS = ("psum", "pmax", "all_gather", "psum_scatter", "ppermute", "all_to_all")
OPS += ("interleaved",)


def needs_wrapper():
    if _ffi.mpiabi_library() is None:
        pytest.skip("the MPI wrapper library is not built (tools/setup.sh builds it)")


def results(proc, n: int) -> list[dict]:
    """The RESULT lines of ``proc``, one per rank, by rank."""
    return util.result_lines(proc, n, "rank")


def test_switch_values():
    assert _config.cpu_collectives({}) is None
    assert _config.cpu_collectives({_config.CPU_COLLECTIVES: " MPI "}) == "mpi"
    assert _config.cpu_collectives({_config.CPU_COLLECTIVES: "gloo"}) == "gloo"
    with pytest.raises(ValueError, match="MPI4JAX_DIST_CPU_COLLECTIVES='nccl'"):
        _config.cpu_collectives({_config.CPU_COLLECTIVES: "nccl"})


@util.variant
@util.same_under_every_mpi
@skip_in_mpi_job
def test_env_lines_for_job_scripts():
    needs_wrapper()
    cmd = [sys.executable, "-m", "mpi4jax_dist", "env"]
    proc = util.run_command(cmd, env=util.clean_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = dict(
        line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines()
    )
    assert lines[_config.CPU_COLLECTIVES] == "mpi"
    assert lines[_config.JAX_CPU_COLLECTIVES] == "mpi"
    assert lines[_config.TRAMPOLINE_LIB] == str(_ffi.mpiabi_library())


@skip_in_mpi_job
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=util.variant)])
def test_collectives_over_mpi_against_numpy(n, tmp_path):
    """psum, pmax, all_gather, psum_scatter, ppermute, all_to_all over MPI, and
    mpi4jax's allreduce between them in one jitted function; the job exits 0.
    With the timeline on, XLA's collectives over MPI are on it beside the
    package's allreduce, named by their MPI function."""
    needs_wrapper()
    timeline = tmp_path / "timeline"
    env = util.clean_env(MPI4JAX_DIST_TIMELINE=timeline, **SWITCH)
    proc = util.run_mpi("mpi_collectives.py", n, env=env, timeout=TIMEOUT)
    for r in results(proc, n):
        assert r["impl"] == "mpi" and r["wrapper_loaded"] is True, r
        assert r["errors"] == {} and r["ok"], r["errors"]
        assert sorted(r["ops"]) == sorted(OPS), r["ops"]
        # XLA passed MPI_COMM_WORLD and got the bootstrap's private duplicate of
        # it, on which no collective of the program's main thread runs.
        world = r["xla_world"]
        assert world["private"] and world["congruent"], world
        assert world["redirects"] > 0, world
        assert r["reported_redirects"] == world["redirects"], r
        assert r["reported_world"] == {"private": True, "congruent": True}, r
    merged = util.run_command(
        [sys.executable, "-m", "mpi4jax_dist", "timeline", str(timeline)],
        env=util.clean_env(),
        timeout=120,
    )
    assert merged.returncode == 0, merged.stderr
    # Each rank's block holds 3 elements: the arrays are float32[3n].
    xla = f"a program of XLA's: MPI_%s on XLA's communicator ({n} ranks)\n    1 call;"
    for call in (f"Allreduce MAX float32[{3 * n}]", f"Allgather float32[{3 * n}]"):
        assert xla % call in merged.stdout, merged.stdout
    assert f"MPI_Allreduce SUM float32[{3 * n}] on XLA's" in merged.stdout
    assert re.search(
        rf"mpi_collectives\.py:\d+ in <lambda>: allreduce SUM float32\[{3 * n}\]",
        merged.stdout,
    ), merged.stdout


@util.same_under_every_mpi
@skip_in_mpi_job
def test_too_late_says_what_to_do():
    """jax imported before mpi4jax_dist: jaxlib loaded without the wrapper."""
    needs_wrapper()
    code = (
        "import jax, mpi4jax_dist\n"
        "try:\n"
        "    jax.distributed.initialize()\n"
        "except RuntimeError as err:\n"
        "    print('REFUSED ' + str(err))\n"
    )
    proc = util.run_mpi(["-c", code], 2, env=util.clean_env(**SWITCH), timeout=90)
    # The marker and the message are one string, so one write: unbuffered, print
    # writes each argument apart, and the launcher may put the other rank's
    # between them.
    refused = util.result_texts(proc.stdout, marker="REFUSED ")
    assert len(refused) == 2, proc.stdout + proc.stderr
    assert "Import mpi4jax_dist before jax" in refused[0]
    assert 'eval "$(python -m mpi4jax_dist env)"' in refused[0]


@util.variant
@util.same_under_every_mpi
@skip_in_mpi_job
def test_more_than_one_device_says_what_to_do():
    needs_wrapper()
    code = (
        "import mpi4jax_dist, jax\n"
        "try:\n"
        "    mpi4jax_dist.initialize()\n"
        "except RuntimeError as err:\n"
        "    print('REFUSED ' + str(err))\n"
    )
    env = util.clean_env(JAX_NUM_CPU_DEVICES=2, **SWITCH)
    proc = util.run_mpi(["-c", code], 2, env=env, timeout=90)
    refused = util.result_texts(proc.stdout, marker="REFUSED ")
    assert len(refused) == 2, proc.stdout + proc.stderr
    assert "one CPU device per process" in refused[0]
    assert "takes one CPU device per process" in refused[0]


def test_not_built_says_what_to_do(monkeypatch):
    from mpi4jax_dist import xla_mpi

    monkeypatch.setattr(_ffi, "mpiabi_library", lambda: None)
    with pytest.raises(RuntimeError, match="needs mpi4jax_dist's MPI wrapper"):
        xla_mpi.env_lines()


@util.variant
@util.same_under_every_mpi
@skip_in_mpi_job
def test_benchmark_says_which_collectives_ran():
    """benchmarks/allreduce.py under the switch: its psum and gspmd rows run over
    MPI, and its header and JSON say so."""
    needs_wrapper()
    out = util.ROOT / "benchmarks" / "allreduce.py"
    args = ["--sizes", "4", "--impls", "psum,gspmd", "--samples", "2"]
    proc = util.run_mpi(
        [str(out), *args], 2, env=util.clean_env(**SWITCH), timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = proc.stdout.splitlines()[0]
    assert "CPU collectives mpi" in header, header


# Irecv and Isend of one int each on COMM_SELF through the wrapper's own ABI, then
# one MPIABI_Waitall of them all with the statuses ignored; argv: the library.
_WAITALL = """
import ctypes, sys
import numpy as np
from mpi4py import MPI
lib = ctypes.CDLL(sys.argv[1])
size_t = ctypes.c_size_t
def const(name):
    return size_t.in_dll(lib, "MPIABI_" + name).value
SELF, INT, IGNORE, NULL = map(const, ("COMM_SELF", "INT", "STATUSES_IGNORE",
                                      "REQUEST_NULL"))
n = 20
send, recv = np.arange(n, dtype=np.intc), np.full(n, -1, dtype=np.intc)
requests = (size_t * (2 * n))()
post = ctypes.c_void_p, ctypes.c_int, size_t, ctypes.c_int, ctypes.c_int, size_t
for name in ("MPIABI_Irecv", "MPIABI_Isend"):
    getattr(lib, name).argtypes = [*post, ctypes.c_void_p]
lib.MPIABI_Waitall.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
def slot(i):
    return ctypes.addressof(requests) + i * ctypes.sizeof(size_t)
for i in range(n):
    assert lib.MPIABI_Irecv(recv.ctypes.data + 4 * i, 1, INT, 0, i, SELF, slot(i)) == 0
    assert lib.MPIABI_Isend(send.ctypes.data + 4 * i, 1, INT, 0, i, SELF,
                            slot(n + i)) == 0
rc = lib.MPIABI_Waitall(2 * n, requests, IGNORE)
print("RESULT", rc, recv.tolist() == list(range(n)),
      all(r == NULL for r in requests), IGNORE)
"""


@skip_in_mpi_job
def test_waitall_with_statuses_ignored_beyond_its_stack_arrays():
    """MPIABI_Waitall of 40 requests (more than the 16 its stack arrays hold) with
    the statuses ignored completes them all. Open MPI's MPI_STATUSES_IGNORE is a
    null pointer, which the wrapper took for a failed malloc: MPI_ERR_NO_MEM and no
    wait (tools/test.sh runs this file under Open MPI too; MPICH's is (void *)1)."""
    needs_wrapper()
    proc = util.run_mpi(
        ["-c", _WAITALL, _ffi.mpiabi_library()], 1, env=util.clean_env(), timeout=90
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    _, rc, received, nulled, ignore = line.split()
    assert (rc, received, nulled) == ("0", "True", "True"), (line, proc.stderr)


# --- the hang reports name XLA's call ---------------------------------------------

HUNG = (
    r"mpi4jax_dist: no rank of 4 made progress for [\d.]+ s "
    r"\(MPI4JAX_DIST_HANG_TIMEOUT\), and they do not all stand at one place: the job "
    r"is hung\. Where the ranks stand, the odd ones out first:\n"
)
XLA_CALL = (
    r"XLA's MPI_Allreduce #(\d+) SUM float32\[4\] on 4 ranks, at stall\.py:\d+ in "
)


def hung_in_psum(**env):
    """tests/scripts/stall.py's psum job under the switch, with a 2 s hang timeout:
    JAX's psum is XLA's MPI_Allreduce in the MPI wrapper."""
    needs_wrapper()
    env = util.clean_env(
        MPI4JAX_NO_WARN_JAX_VERSION="1",
        TF_CPP_MIN_LOG_LEVEL="3",
        MODE="psum",
        STALL_S="60",
        **SWITCH,
        **{
            # stall.py imports jax first: the job script's lines, as the docs say.
            _config.TRAMPOLINE_LIB: str(_ffi.mpiabi_library()),
            _config.JAX_CPU_COLLECTIVES: "mpi",
            _config.HANG_TIMEOUT: "2",
        },
        **env,
    )
    proc = util.run_mpi("stall.py", 4, check=False, timeout=120, env=env)
    assert proc.returncode != 0, proc.stderr[-4000:]
    return proc.stderr


@util.same_under_every_jax
@util.same_under_every_mpi
def test_the_hang_report_names_the_xla_call_the_ranks_wait_in():
    """Rank 3 sleeps while ranks 0-2 wait in a psum over MPI: their Python frame
    is only the jitted call, and the report says which of XLA's calls into MPI
    they are in (the wrapper's record): its number on XLA's communicator (the
    second there: one psum ran before), op, type and count."""
    stderr = hung_in_psum()
    found = re.search(
        HUNG + r"  1 rank at stall\.py:\d+ in stalled_compute: .*: rank 3\n"
        r"  3 ranks in " + XLA_CALL + r"<lambda>: .*: ranks 0-2\n",
        stderr,
    )
    assert found and found.group(1) == "2", stderr[-4000:]


@util.same_under_every_jax
@util.same_under_every_mpi
def test_a_rank_holding_the_gil_in_an_xla_call_is_placed_from_c():
    """Rank 3's main thread waits in a psum over MPI that no other rank makes
    while another of its threads holds the GIL; the others reach their exit. Rank
    3's Python cannot answer: its C thread does, quoting the wrapper's record
    through the reader the bootstrap handed it."""
    stderr = hung_in_psum(GIL="thread", STALL_RANK="3")
    found = re.search(
        HUNG + r"  ranks 0-2 reached their exit .*\n"
        r"  rank 3 answered from C only \(a thread holds the GIL\): placed below by "
        r"the stacks written then\n"
        r"  1 rank in " + XLA_CALL + r"<lambda>: .*: rank 3\n",
        stderr,
    )
    assert found and found.group(1) == "3", stderr[-4000:]
