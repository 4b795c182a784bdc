"""Ranks that disagree on a collective fail, named, and never return a value.

Each test runs one case of tests/scripts/desync.py in a job of its own: every rank
first makes two matching calls (a check made only on a communicator's first call
has passed by then), then the odd ranks make a different call. The verdict is read
from what ran: the job's exit status, the one report the communicator's rank 0
prints (the call's number, each side in names, the script's source lines, the odd
ranks first), that no rank printed a value, and the seconds it took. Without the
checks (MPI4JAX_DIST_CHECKS=0) the same case returns wrong numbers with exit
status 0: the fault the checks guard against. Serially:
python -m pytest tests/jobs/test_desync.py. Under Open MPI (CI's stage beside .venv's
suite) only the cases whose outcome is the MPI's own run: the others (marked
same_under_every_mpi) test the package's logic alike under every MPI.
"""

import re
import time

import pytest
import util

pytestmark = [pytest.mark.mpi_skip, util.same_under_every_jax, util.every_mpi]

REPORT = "disagree on its call"
SCRIPT = (util.SCRIPTS / "desync.py").read_text().splitlines()


def line_of(text: str) -> int:
    """The line of desync.py that holds ``text`` (once)."""
    found = [i + 1 for i, line in enumerate(SCRIPT) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def desync(case: str, n: int = 2, timeout: float = 120, **env):
    """Run the case on ``n`` ranks: ``(proc, seconds)``."""
    start = time.perf_counter()
    proc = util.run_mpi(
        "desync.py",
        n,
        timeout=timeout,
        check=False,
        env=util.clean_env(CASE=case, **env),
    )
    return proc, time.perf_counter() - start


def values(proc) -> list[str]:
    """What each rank printed it got (``RESULT <rank> <values>``)."""
    return [text.split(" ", 1)[1] for text in util.result_texts(proc.stdout)]


def output(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def assert_reported(proc, took, *sides, limit=60):
    """The job failed within ``limit`` s, printed one report naming ``sides`` (in
    that order: the odd ranks first) and no rank printed a value."""
    assert proc.returncode != 0, output(proc)
    assert took < limit, output(proc)
    reports = [line for line in proc.stderr.splitlines() if REPORT in line]
    assert len(reports) == 1, output(proc)
    report = reports[0]
    where = [report.find(side) for side in sides]
    assert all(i >= 0 for i in where) and where == sorted(where), (sides, report)
    assert "No rank returned a value" in report, report
    assert "RESULT" not in proc.stdout, output(proc)
    return report


SMALL = line_of('if case == "op"')  # the line after holds the call


@pytest.mark.parametrize(
    "case, env, odd, others",
    [
        (
            "op",
            {},
            f"rank 1 in allreduce #3 MAX float32[4] at desync.py:{SMALL + 1}",
            "rank 0 in allreduce #3 SUM float32[4]",
        ),
        pytest.param(
            "dtype",
            {},
            "rank 1 in allreduce #3 SUM int32[4]",
            "rank 0 in allreduce #3 SUM float32[4]",
            marks=util.variant,
        ),
        pytest.param(
            "bytes",
            {},
            "rank 1 in allreduce #3 SUM int16[8]",
            "rank 0 in allreduce #3 SUM float32[4]",
            marks=util.variant,
        ),
        pytest.param(
            "count",
            {},
            "rank 1 in allreduce #3 SUM float32[8]",
            "rank 0 in allreduce #3 SUM float32[4]",
            marks=util.variant,
        ),
        # Header and payload in one message on one side, apart on the other.
        (
            "large",
            {"LARGE": 4096},
            "rank 1 in allreduce #3 SUM float32[8192]",
            "rank 0 in allreduce #3 SUM float32[4096]",
        ),
        # Both apart, the first chunk of different sizes.
        pytest.param(
            "large",
            {"LARGE": 1 << 18},
            "rank 1 in allreduce #3 SUM float32[524288]",
            "rank 0 in allreduce #3 SUM float32[262144]",
            marks=util.variant,
        ),
        pytest.param(
            "kind",
            {"LARGE": 8192},
            "rank 1 in iallreduce #3 SUM float32[8192]",
            "rank 0 in allreduce #3 SUM float32[8192]",
            marks=util.variant,
        ),
    ],
    ids=["op", "dtype", "bytes", "count", "combined-vs-apart", "apart", "kind"],
)
def test_ranks_that_disagree_fail_named(case, env, odd, others):
    """Each disagreement ends the job non-zero in seconds with one report: the
    call's number, both sides in names and where the script made them. Under
    Open MPI too, where ranks whose first messages differed in size (one rank's
    payload with its header, the other's apart, or both apart in chunks of
    different sizes) crashed in Open MPI on the longer message."""
    proc, took = desync(case, **env)
    # The lines sort alike here (rank 0 first on a tie of one rank each).
    assert_reported(proc, took, others, odd)
    assert re.search(r"at desync\.py:\d+", proc.stderr), output(proc)


def at(text: str, function: str = "<lambda>") -> str:
    """Where the report says desync.py's line holding ``text`` made its call."""
    return f"at desync.py:{line_of(text)} in {function}"


@util.same_under_every_mpi
def test_a_call_skipped_in_the_middle_fails_before_a_value():
    """Rank 1 skips the middle one of three eager calls of one signature: its
    third call met rank 0's second, which returned their sum with exit status 0
    (and then the job hung). Both ranks now fail in seconds on that call, the
    report naming both lines, and the only value printed is the first call's."""
    proc, took = desync("skip", timeout=90)
    assert_reported(
        proc,
        took,
        f"rank 0 in allreduce #4 SUM float32[4] {at('# skip: b', 'run_case')};",
        f"rank 1 in allreduce #4 SUM float32[4] {at('# skip: c', 'run_case')}.",
        limit=30,
    )
    got = sorted(util.result_texts(proc.stdout, "VALUE "))
    assert got == [f"{r} a [1.0, 3.0, 5.0, 7.0]" for r in "01"], output(proc)


@util.same_under_every_mpi
@pytest.mark.parametrize(
    "env, call, count",
    [
        ({}, "allreduce", 4),
        ({"EAGER": 1}, "allreduce", 4),
        # The header apart from the payload, judged as soon as it completes.
        ({"LARGE": 1 << 15}, "allreduce", 1 << 15),
        ({"CALL": "iallreduce"}, "iallreduce", 4),
        ({"CALL": "iallreduce", "EAGER": 1, "LARGE": 1 << 15}, "iallreduce", 1 << 15),
    ],
    ids=["jit", "eager", "jit-apart", "iallreduce", "iallreduce-eager-apart"],
)
def test_one_signature_from_two_lines_fails_naming_both(env, call, count):
    """The ranks make one call alike but for its line (rank 1 at one, rank 0 at
    another): the call fails on both, the report naming the two lines."""
    suffix = f", {call}"
    proc, took = desync("lines", **env)
    assert_reported(
        proc,
        took,
        f"rank 0 in {call} #3 SUM float32[{count}] {at('# lines: others' + suffix)};",
        f"rank 1 in {call} #3 SUM float32[{count}] {at('# lines: odd' + suffix)}.",
        limit=30,
    )


@util.same_under_every_mpi
def test_a_cond_on_the_rank_fails_unless_its_branches_share_a_site():
    """An allreduce in each branch of a lax.cond on the rank: by default the two
    lines disagree and the report names both; given one site= name, the two
    calls match and every rank gets x0 + 2 * x1."""
    proc, took = desync("cond")
    assert_reported(
        proc,
        took,
        f"rank 0 in allreduce #3 SUM float32[4] {at('# cond: even')};",
        f"rank 1 in allreduce #3 SUM float32[4] {at('# cond: odd')}.",
        limit=30,
    )
    proc, _ = desync("cond", SITE="halo")
    assert proc.returncode == 0, output(proc)
    assert REPORT not in proc.stderr, output(proc)
    assert values(proc) == ["float32[2.0, 5.0, 8.0, 11.0]"] * 2, output(proc)


@util.same_under_every_mpi
def test_places_past_the_table_are_still_compared():
    """Past the 4096 places the extension keeps, a call carries its place's key
    without its text: two lines still disagree (the report gives the keys), and
    the branches of a cond given one site= name still match."""
    proc, took = desync("lines", FILL_SITES=1)
    report = assert_reported(proc, took, "rank 0 in allreduce #3", limit=30)
    keys = re.findall(
        r"rank (\d) in allreduce #3 SUM float32\[4\] \(site key (\d+)\)", report
    )
    assert [r for r, _ in keys] == ["0", "1"] and keys[0][1] != keys[1][1], report
    proc, _ = desync("cond", SITE="halo", FILL_SITES=1)
    assert proc.returncode == 0, output(proc)
    assert values(proc) == ["float32[2.0, 5.0, 8.0, 11.0]"] * 2, output(proc)


@util.same_under_every_mpi
def test_a_named_branch_against_an_unnamed_one_names_both():
    """site= on one side only is a disagreement too: the report shows the name
    beside the line where it was given."""
    proc, took = desync("cond", SITE="halo", SITE_ODD_ONLY=1)
    assert_reported(
        proc,
        took,
        f"rank 0 in allreduce #3 SUM float32[4] {at('# cond: even')};",
        f"rank 1 in allreduce #3 SUM float32[4] {at('# cond: odd')} (site 'halo').",
        limit=30,
    )


@util.same_under_every_mpi
def test_the_odd_rank_is_named_first_once():
    """4 ranks, rank 2 the odd one: it leads the one report, the others after it in
    one run of ranks; only the communicator's rank 0 prints it."""
    proc, took = desync("op", n=4, ODD=2)
    report = assert_reported(
        proc,
        took,
        "rank 2 in allreduce #3 MAX float32[4]",
        "ranks 0-1, 3 in allreduce #3 SUM float32[4]",
    )
    assert "communicator 'MPI_COMM_WORLD' (4 ranks)" in report


@util.same_under_every_mpi
def test_an_order_mismatch_in_one_jit_names_both_lines():
    """In one jitted function rank 0 reduces a then b, rank 1 b then a: the
    report names the two source lines, not the chunk size."""
    proc, took = desync("order")
    report = assert_reported(proc, took, "rank 0 in allreduce #3 SUM float32[4]")
    first_a = [i + 1 for i, line in enumerate(SCRIPT) if "a = allreduce(a)" in line]
    first_b = [
        i + 1 for i, line in enumerate(SCRIPT) if "b = allreduce(b, op=MPI.MAX)" in line
    ]
    # Rank 1 (odd) reduces b first: its line is the first of b's; rank 0's is a's
    # second (the else branch).
    assert f"MAX float32[4] at desync.py:{first_b[0]} in both" in report, report
    assert f"SUM float32[4] at desync.py:{first_a[1]} in both" in report, report
    assert "chunks" not in report, report


@pytest.mark.parametrize("case", [pytest.param("kind", marks=util.variant), "count"])
def test_the_collective_timeout_changes_no_answer(case):
    """Under MPI4JAX_DIST_COLLECTIVE_TIMEOUT every call is non-blocking inside; a
    blocking call against a non-blocking one, or 4 elements against 8, still
    fails named, long before the timeout."""
    proc, took = desync(case, MPI4JAX_DIST_COLLECTIVE_TIMEOUT=30)
    sides = {
        "kind": ("rank 0 in allreduce #3", "rank 1 in iallreduce #3"),
        "count": ("float32[4]", "float32[8]"),
    }[case]
    assert_reported(proc, took, *sides, limit=25)


def test_without_the_checks_the_answer_is_wrong():
    """The fault the checks guard against: MPI4JAX_DIST_CHECKS=0, rank 0 MAX
    against rank 1 SUM, and the job exits 0 with a wrong sum on some rank (SUM is
    [1, 3, 5, 7]; MPICH gives both ranks [1, 2, 5, 7], Intel MPI both the MAX
    [1, 2, 3, 4], Open MPI rank 0 the MAX)."""
    proc, _ = desync("op", ODD=0, MPI4JAX_DIST_CHECKS=0)
    assert proc.returncode == 0, output(proc)
    got = values(proc)
    assert len(got) == 2 and got != ["float32[1.0, 3.0, 5.0, 7.0]"] * 2, output(proc)


@pytest.mark.parametrize(
    "env",
    [
        {"STEPS": 300, "MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES": "16K"},
        pytest.param(
            {"STEPS": 300, "MPI4PY_RC_THREAD_LEVEL": "serialized"},
            marks=util.same_under_every_mpi,
        ),
        pytest.param(
            {"STEPS": 100, "MPI4JAX_DIST_COLLECTIVE_TIMEOUT": 30},
            marks=util.same_under_every_mpi,
        ),
    ],
    ids=["multiple-chunked", "serialized", "collective-timeout"],
)
def test_no_false_alarm_in_a_long_run_of_matched_calls(env):
    """Hundreds of steps of matched calls, small and large, blocking and not: no
    report, the right values, exit 0."""
    proc, _ = desync("loop", **env)
    assert proc.returncode == 0, output(proc)
    assert REPORT not in proc.stderr, output(proc)
    assert values(proc) == ["float32[0.5, 1.5, 2.5, 3.5]"] * 2, output(proc)
    assert sorted(re.findall(r"BIG \d (True|False)", proc.stdout)) == ["True", "True"]


@util.same_under_every_mpi
def test_a_deadlock_at_one_line_is_named_from_the_record():
    """``allreduce`` on rank 0 against ``iallreduce`` on rank 1, of 4 bytes, the
    checks off (with them the watchdog's standstill names it first:
    tests/jobs/test_standstill.py): MPI matches neither with the other, and both ranks
    wait at one line of Python (one jitted call), which the hang timeout took for
    one long step. The record tells them apart by the call each is in, on its
    communicator, and the report names both."""
    proc, took = desync("kind", MPI4JAX_DIST_HANG_TIMEOUT=5, MPI4JAX_DIST_CHECKS=0)
    assert proc.returncode != 0, output(proc)
    assert took < 60, output(proc)
    assert "the job is hung" in proc.stderr, output(proc)
    for call, rank in (("allreduce", 0), ("iallreduce", 1)):
        assert re.search(
            rf"  1 rank in {call} #3 SUM float32\[4\] on communicator "
            rf"'MPI_COMM_WORLD' \(2 ranks\) at desync\.py:\d+ in \S+, "
            rf"at desync\.py:{line_of('out = jax.jit(iallreduce if odd')} .*: "
            rf"rank {rank}\n",
            proc.stderr,
        ), output(proc)


@util.same_under_every_mpi
def test_a_communicator_the_ranks_disagreed_on_takes_no_more_calls():
    """Where the job goes on (fail-fast off, the error caught), the next call on
    the communicator is refused on every rank, naming the call they disagreed on:
    a reduction of it may still be pending in MPI (as where one rank's payload
    goes apart from its header and another's with it)."""
    proc, _ = desync("op", AGAIN=1, MPI4JAX_DIST_FAIL_FAST=0)
    assert proc.returncode == 0, output(proc)
    assert len(re.findall(r"CAUGHT \d (Jax|Xla)RuntimeError", proc.stdout)) == 2
    refused = re.findall(r"AGAIN \d refused: .*disagreed on its call #3,", proc.stdout)
    assert len(refused) == 2, output(proc)


@util.same_under_every_mpi
def test_the_first_call_s_set_up_is_under_the_collective_timeout():
    """3 ranks: the first allreduce on a new communicator makes its private
    duplicate with every rank, and rank 2 waits in an mpi4py Barrier instead
    (mpi4jax's Clone() there hung without a word). Under the collective timeout
    the set-up is polled like the call: the job ends in seconds, rank 2 named as
    not having entered the call."""
    proc, took = desync("setup", n=3, ODD=2, MPI4JAX_DIST_COLLECTIVE_TIMEOUT=5)
    assert proc.returncode != 0, output(proc)
    assert took < 60, output(proc)
    assert re.search(
        # The watchdog's elapsed time, 3 digits: 5, 5.01, ...
        r"waited 5(\.\d+)? s in mpi4jax_dist\.allreduce, call 1 on a communicator of 3 "
        r"ranks \(MPI4JAX_DIST_COLLECTIVE_TIMEOUT\); not entered by rank 2",
        proc.stderr,
    ), output(proc)
