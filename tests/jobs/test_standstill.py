"""Ranks that all wait in calls MPI cannot match end the job within seconds, named,
with no variable set (mpi4jax_dist/faults/standstill.py); ranks that wait long in
calls MPI completes, or in programs dispatched ahead, are left alone.

Each test runs one case of tests/scripts/standstill.py in a job of its own, with
the environment cleaned of every MPI4JAX_DIST_ variable: the verdict is what ran
(the exit status, the report's lines, the seconds, that the waiting ranks printed
no value). Without the watchdog's checks (``MPI4JAX_DIST_CHECKS=0``, the hang
timeout off) the same case waits until the test's own limit: the fault they guard
against. Serially: python -m pytest tests/jobs/test_standstill.py.
"""

import re
import subprocess
import time

import pytest
import util

pytestmark = [pytest.mark.mpi_skip, util.same_under_every_jax]

HEADLINE = (
    "waits in a collective that cannot complete, or has reached its exit, with no "
    "progress for 3 s or more"
)
WORLD = re.escape("on communicator 'MPI_COMM_WORLD' (2 ranks)")


def standstill(case: str, n: int = 2, timeout: float = 120, **env):
    """Run the case on ``n`` ranks: ``(proc, seconds)``."""
    start = time.perf_counter()
    proc = util.run_mpi(
        "standstill.py",
        n,
        timeout=timeout,
        check=False,
        env=util.clean_env(CASE=case, MPI4JAX_NO_WARN_JAX_VERSION=1, **env),
    )
    return proc, time.perf_counter() - start


def output(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def report(proc) -> str:
    """The report's lines, the ranks' stacks left out."""
    lines = proc.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if HEADLINE in line)
    return "\n".join(line for line in lines[start:] if not line.startswith("[rank"))


def expand(ranks: str) -> set[int]:
    """``0-2, 5`` as {0, 1, 2, 5}."""
    out = set()
    for run in ranks.split(","):
        first, _, last = run.strip().partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


CASES = {
    # case: (environment, what each side is named as)
    "padding": (
        {},
        [
            rf"rank 0: in allreduce #2 SUM float32\[4\] {WORLD}",
            rf"rank 1: in allreduce #2 SUM float32\[32\] {WORLD}",
            r"call #2: its ranks wait in 2 different calls \(above\), which MPI "
            r"cannot match",
        ],
    ),
    "padding-large": (
        {"LARGE": 1 << 20},
        [rf"rank 1: in allreduce #2 SUM float32\[1048576\] {WORLD}"],
    ),
    "kind": (
        {},
        [
            rf"rank 0: in allreduce #2 SUM float32\[4\] {WORLD}",
            rf"rank 1: in iallreduce #2 SUM float32\[4\] {WORLD}",
        ],
    ),
    "extra": (
        {},
        [
            rf"rank 0: in allreduce #2 SUM float32\[4\] {WORLD}",
            r"rank 1: reached the exit \(the end of the program, or sys\.exit\)",
            r"call #2: 1 of its 2 ranks waits in it; the others are not in it",
        ],
    ),
    "trips": (
        {},
        [
            r"rank 0: reached the exit",
            rf"rank 1: in allreduce #5 SUM float32\[4\] {WORLD}",
        ],
    ),
    "comm": (
        {},
        [
            rf"rank 0: in allreduce #2 SUM float32\[4\] {WORLD}",
            r"rank 1: in allreduce #1 SUM float32\[4\] on a communicator "
            r"\(2 ranks\) at standstill\.py:\d+ in allreduce \(the first there: "
            r"making its duplicates\)",
        ],
    ),
    "helper": (
        {},
        [
            r"ranks 0-1: in allreduce #1 SUM float32\[4\] on a communicator "
            r"\(2 ranks\) at standstill\.py:\d+ in helper \(the first there",
            r"call #1: a first call, its communicator's private duplicates not made "
            r"in 10 s",
        ],
    ),
    "exit": (
        {},
        [
            rf"rank 0: in allreduce #2 SUM float32\[4\] {WORLD}",
            r"rank 1: reached the exit",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_calls_that_cannot_match_end_the_job_named_within_seconds(name):
    """With no variable set: the job ends non-zero within seconds of the last
    rank's arrival, one report names what each rank waits in (or that it reached
    its exit) on which communicator and where, and no waiting rank printed a
    value. (Blocking against non-blocking above 16 KiB, where both post their
    header apart and MPI matches the headers, is named by the header check:
    tests/jobs/test_desync.py's kind case.)"""
    env, sides = CASES[name]
    proc, took = standstill(name.split("-")[0], **env)
    assert proc.returncode != 0, output(proc)
    # First calls on two communicators of one group, both still making their
    # duplicates, are told apart only after standstill.SETUP_S (10 s).
    assert took < (55 if name == "helper" else 40), output(proc)
    assert proc.stderr.count(HEADLINE) == 1, output(proc)
    text = report(proc)
    for side in sides:
        assert re.search(side, text), text
    assert "MPI_Abort ends the job." in text
    # Communicators that differ read apart, the same line and number or not.
    keys = re.findall(r"rank \d: in .* key ([0-9a-f]{6})\)", text)
    assert len(set(keys)) == len(keys), text
    waiting = {
        rank
        for ranks in re.findall(r"^  ranks? ([\d, -]+): in ", text, re.M)
        for rank in expand(ranks)
    }
    printed = {int(r) for r in re.findall(r"^RESULT (\d)", proc.stdout, re.M)}
    assert waiting and not waiting & printed, output(proc)


def test_without_the_checks_and_the_hang_timeout_the_job_waits():
    """The fault the check guards against: the same case with the watchdog's
    checks and the hang timeout off waits until the test's own limit."""
    with pytest.raises(pytest.fail.Exception, match="did not finish in 15 s"):
        util.run_mpi(
            "standstill.py",
            2,
            timeout=15,
            check=False,
            env=util.clean_env(
                CASE="kind",
                MPI4JAX_NO_WARN_JAX_VERSION=1,
                MPI4JAX_DIST_CHECKS=0,
                MPI4JAX_DIST_HANG_TIMEOUT=0,
            ),
        )


@pytest.fixture(scope="module")
def slow_own(tmp_path_factory):
    """tests/pmpi/slow_own.c built with this MPI's compiler wrapper."""
    mpicc = util.BIN / "mpicc"
    if not mpicc.exists():
        pytest.skip("no mpicc beside this Python to build the interposer with")
    library = tmp_path_factory.mktemp("pmpi") / "libslow_own.so"
    source = util.HERE / "pmpi" / "slow_own.c"
    subprocess.run(
        [str(mpicc), "-shared", "-fPIC", "-O2", "-o", str(library), str(source)],
        check=True,
        timeout=120,
    )
    return library


@pytest.mark.parametrize("n, split", [(2, ""), (4, "1")], ids=["one-call", "two-comms"])
def test_ranks_that_wait_long_in_calls_mpi_completes_are_left_alone(slow_own, n, split):
    """Every rank waits 8 s in each call MPI completes (started late by
    tests/pmpi/slow_own.c): in one call alike on 2 ranks, or on 4 ranks in two
    calls on two halves of the world at once, which rank 0 must find complete
    (each entered alike by all its communicator's members). No report, exit 0,
    the right sums."""
    proc, took = standstill(
        "live",
        n=n,
        timeout=180,
        SPLIT=split,
        STEPS=1,
        SLOW_OWN_S=8,
        LD_PRELOAD=slow_own,
    )
    assert proc.returncode == 0, output(proc)
    assert HEADLINE not in proc.stderr, output(proc)
    assert took > 8, took  # the call was held
    # x = [0, 1, 2, 3] + rank, summed once over the ranks of its communicator
    members = [[0, 1]] if n == 2 else [[0, 2], [1, 3]]
    expected = {}
    for group in members:
        for rank in group:
            once = [sum(i + r for r in group) for i in range(4)]
            expected[rank] = once
    got = dict(text.split(" ", 1) for text in util.result_texts(proc.stdout))
    want = {str(r): f"float32{[float(v) for v in vs]}" for r, vs in expected.items()}
    assert got == want, output(proc)


def test_programs_dispatched_ahead_are_no_hang():
    """JAX's usual loop: steps of tenths of a second dispatched ahead, 9 s of them,
    the result read at the end at a line that differs between the ranks, the hang
    timeout at 5 s: the main thread waits in C past the timeout, and each step's
    allreduce ends (the record's progress). No report, exit 0 (08163be, which
    counted Python alone, reported this job as hung)."""
    proc, _ = standstill(
        "ahead", SECONDS=9, WORK=4000, MPI4JAX_DIST_HANG_TIMEOUT=5, timeout=240
    )
    assert proc.returncode == 0, output(proc)
    assert "MPI4JAX_DIST_HANG_TIMEOUT" not in proc.stderr, output(proc)
    # The main thread waited in C for the queue longer than the timeout.
    # (mpiexec may put both ranks' lines on one.)
    waited = re.findall(r"WAITED \d ([\d.]+) DISPATCH", proc.stdout)
    assert len(waited) == 2 and min(map(float, waited)) > 5, output(proc)


# --- the hang timeout, on by default --------------------------------------------


def test_the_hang_timeout_is_on_by_default():
    """Unset: 600 s (PyTorch's NCCL default); 0: off; set: as set."""
    from mpi4jax_dist import _config

    assert _config.hang_timeout({}) == 600.0
    assert _config.hang_timeout({_config.HANG_TIMEOUT: "0"}) is None
    assert _config.hang_timeout({_config.HANG_TIMEOUT: "90"}) == 90.0
    assert not _config.hang_timeout_set({})


def test_the_hang_timeout_tells_calls_of_one_line_on_two_communicators_apart():
    """The checks off (no standstill watchdog), the hang timeout at 5 s: two calls
    of one helper (one source line) in one jit, on two new duplicates of the
    world, in the other order on rank 1. Both ranks stand at one line of Python
    in call #1 of one line, each making its communicator's duplicates: before,
    one place (never reported: the job waited until killed); now such first calls
    stand apart (no set-up every member entered waits that long), and the report
    names both."""
    proc, took = standstill(
        "helper", MPI4JAX_DIST_CHECKS=0, MPI4JAX_DIST_HANG_TIMEOUT=5
    )
    assert proc.returncode != 0, output(proc)
    assert took < 60, output(proc)
    assert "they do not all stand at one place: the job is hung" in proc.stderr
    groups = re.findall(
        r"  1 rank in allreduce #1 SUM float32\[4\] on a communicator \(2 ranks\) "
        r"at standstill\.py:\d+ in helper \(the first there: making its "
        r"duplicates\), .*: rank (\d)\n",
        proc.stderr,
    )
    assert sorted(groups) == ["0", "1"], output(proc)


def test_a_report_of_ranks_at_one_place_says_so():
    """A hang report whose ranks, asked for their stacks, all stand at one place
    does not say they do not (the verdict found them apart a moment before)."""
    from mpi4jax_dist.faults import report

    place = [("step.py", 12, "body")]
    reply = {"place": place, "source": ["x = f(x)"], "call": ""}
    text = report.hang_report({0: reply, 1: dict(reply)}, 2, 700.0, {"stderr"})
    assert "do not all stand at one place" not in text, text
    assert "they stand at one place: the job is hung there" in text, text
    apart = dict(reply, place=[("step.py", 14, "body")])
    text = report.hang_report({0: reply, 1: apart}, 2, 700.0, {"stderr"})
    assert "they do not all stand at one place: the job is hung" in text, text


def test_the_collective_timeout_names_a_missing_rank_at_its_exit():
    """Under the collective timeout (5 s, the checks off), rank 1 ends its program
    while rank 0 waits for it in one more call: the line says rank 1 did not
    enter the call and reached its exit (before: "entered by every rank that
    could say; no answer from ...")."""
    proc, took = standstill(
        "extra", MPI4JAX_DIST_CHECKS=0, MPI4JAX_DIST_COLLECTIVE_TIMEOUT=5
    )
    assert proc.returncode != 0, output(proc)
    assert took < 60, output(proc)
    assert re.search(
        r"call 2 on communicator 'MPI_COMM_WORLD' \(2 ranks\) "
        r"\(MPI4JAX_DIST_COLLECTIVE_TIMEOUT\); not entered by rank 1 \(their last "
        r"call there: 1\), of which rank 1 reached its exit",
        proc.stderr,
    ), output(proc)


ANSWER_WHILE_RANK_0_SLEEPS = """
import time
from mpi4py import MPI
from mpi4jax_dist.faults import standstill
comm = MPI.COMM_WORLD
for how in ("ssend", "send_unwaited"):
    comm.Barrier()
    if comm.rank == 0:
        # Rank 0 receives late, as one starved of its core would: 2 s after rank 1
        # said it sends (after the barrier alone, a rank 1 kept off its core by a
        # loaded machine sent after rank 0 had woken: CI, 2026-12-07).
        comm.recv(source=1, tag=6)
        time.sleep(2)
        comm.recv(source=1, tag=7)
        continue
    comm.send(None, dest=0, tag=6)
    wall, cpu = time.monotonic(), time.process_time()
    if how == "ssend":
        comm.ssend({"kind": "reply", "calls": "x" * 300}, dest=0, tag=7)
    else:
        standstill.send_unwaited(comm, {"kind": "reply", "calls": "x" * 300}, 0, 7)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    print(f"{how} {wall:.3f} s wall {cpu:.3f} s CPU", flush=True)
comm.Barrier()
print("UNFINISHED", sum(not r.Test() for r in standstill._unfinished), flush=True)
"""


def test_an_answer_to_rank_0_does_not_wait_for_it_to_receive():
    """The watchdogs' answers to rank 0 (its asks, its requests for the stacks)
    are sent without waiting. Over TCP, a blocking send of a few hundred bytes
    spins until the receiver receives: in the Slurm cluster's stall test, a rank
    answering that way on the reporting rank 0's core kept rank 0 from running,
    and the report came 60 s late, naming no rank (CI, 2026-12-07). The control,
    a synchronous send (``ssend``: it waits for the receiver, as that send did; a
    plain ``send`` there may also go at once, eagerly, and did in two CI runs of
    the same day), shows the wait in the same job."""
    if util.mpi_family() != "mpich":
        pytest.skip("MPICH's variables choose TCP here")
    tcp = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "MPIR_CVAR_NOLOCAL": 1}
    proc = util.run_mpi(
        ["-c", ANSWER_WHILE_RANK_0_SLEEPS],
        2,
        timeout=60,
        env=util.clean_env(**tcp, **util.SPIN),
    )
    took = dict(
        (how, (float(wall), float(cpu)))
        for how, wall, cpu in re.findall(
            r"^(\S+) (\S+) s wall (\S+) s CPU$", proc.stdout, re.M
        )
    )
    assert took["ssend"][0] > 1.5, output(proc)  # the fault, shown
    assert took["send_unwaited"][0] < 0.5 and took["send_unwaited"][1] < 0.5, took
    assert "UNFINISHED 0" in proc.stdout, output(proc)  # received, then tested
