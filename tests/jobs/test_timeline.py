"""The timeline (MPI4JAX_DIST_TIMELINE, mpi4jax_dist.timeline) on real jobs, and
``python -m mpi4jax_dist timeline DIR`` on what they wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import util


def show(proc) -> str:
    return f"\nexit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def merge(folder, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpi4jax_dist", "timeline", str(folder), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=util.clean_env(),
    )


def slices(trace: dict, category: str = "collective") -> dict[int, list[dict]]:
    """The trace's calls of ``category`` by rank (its pid), in the order of their
    start."""
    by_rank: dict[int, list[dict]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X" and event["cat"] == category:
            by_rank.setdefault(event["pid"], []).append(event)
    return {r: sorted(e, key=lambda e: e["ts"]) for r, e in by_rank.items()}


def test_the_summary_names_the_rank_that_arrives_late_and_the_trace_holds_every_call(
    tmp_path,
):
    """Rank 1 of 3 sleeps 30 ms before each of 10 allreduces: the summary names it
    as the last to arrive at them, the others' time in the call is mostly waiting
    for it, and the merged trace holds every rank's calls in order (a warm-up
    allreduce, the 10, an iallreduce), on clocks found equal (one host). Rank 1
    also reaches jax.distributed.initialize() 1 s late: the bootstrap's line
    names it, and the trace holds each rank's bootstrap calls."""
    folder = tmp_path / "timeline"
    env = util.clean_env(
        MPI4JAX_DIST_TIMELINE=folder, CALLS=10, LATE_RANK=1, LATE_S=0.03, BOOT_LATE_S=1
    )
    proc = util.run_mpi("timeline_job.py", 3, env=env)
    assert proc.stdout.count("DONE") == 3, show(proc)
    for rank in range(3):
        meta = json.loads((folder / f"rank-{rank:05d}.json").read_text())
        assert meta["events"] == 12 and meta["lost"] == 0, meta
        for when in ("start", "end"):
            # One host, one CLOCK_MONOTONIC: the offsets measured are ~0.
            assert abs(meta[when]["offset_ns"]) < 2_000_000, meta[when]
    merged = merge(folder)
    assert merged.returncode == 0, show(merged)
    site = re.search(
        r"  timeline_job\.py:\d+ in <lambda>: allreduce SUM float32\[4\] on "
        r"communicator 'MPI_COMM_WORLD' \(3 ranks\)\n"
        r"    11 calls; a rank's time in one: [\d.]+ ms median, [\d.]+ ms p99; of "
        r"all of it, (\d+) % waiting for the last rank to arrive, \d+ % after\n"
        r"    last to arrive: rank 1 in (\d+) of 11",
        merged.stdout,
    )
    assert site, show(merged)
    assert int(site.group(2)) >= 10, show(merged)
    # Ranks 0 and 2 wait ~30 ms for rank 1 in each call, rank 1 ~0: ~2/3 of it.
    assert int(site.group(1)) >= 50, show(merged)
    trace = json.loads((folder / "trace.json").read_text())
    for calls in slices(trace).values():
        names = [c["name"] for c in calls]
        assert len(names) == 12, names
        for seq, name in enumerate(names[:11], start=1):
            assert name.startswith(f"allreduce #{seq} SUM float32[4] at "), names
        assert names[11].startswith("iallreduce #12 SUM float32[4] at "), names
    assert sorted(slices(trace)) == [0, 1, 2]
    # The bootstrap, before the timeline's start: rank 1 reached it 1 s late.
    boot = re.search(
        r"the bootstrap \(jax\.distributed\.initialize\(\)'s MPI calls, 3 ranks\): "
        r"[\d.]+ ms from the first's entry to the last's end on the median rank; the "
        r"last to arrive: rank 1, ([\d.]+) ms after the first",
        merged.stdout,
    )
    assert boot and float(boot.group(1)) > 900, show(merged)
    booted = slices(trace, "bootstrap")
    assert sorted(booted) == [0, 1, 2], booted
    for calls in booted.values():
        assert calls[0]["name"] == "bootstrap Idup (arrival)", calls


@util.same_under_every_jax
def test_a_region_is_timed_alone(tmp_path):
    """``with mpi4jax_dist.timeline(DIR):`` times the calls of its block only."""
    folder = tmp_path / "region"
    env = util.clean_env(REGION=folder, CALLS=3)
    proc = util.run_mpi("timeline_job.py", 2, env=env)
    assert proc.stdout.count("DONE") == 2, show(proc)
    for rank in range(2):
        meta = json.loads((folder / f"rank-{rank:05d}.json").read_text())
        assert meta["events"] == 3, meta
        assert meta["asked_by"] == "mpi4jax_dist.timeline", meta
    merged = merge(folder)
    assert "3 calls" in merged.stdout, show(merged)


@util.same_under_every_jax
def test_a_folder_no_rank_can_write_is_one_line():
    """The job ends at initialize, rank 0 printing one line that names the
    variable and the folder; no rank waits."""
    env = util.clean_env(MPI4JAX_DIST_TIMELINE="/proc/no/timeline", CALLS=1)
    proc = util.run_mpi("timeline_job.py", 2, env=env, check=False, timeout=120)
    assert proc.returncode != 0, show(proc)
    line = (
        "MPI4JAX_DIST_TIMELINE: the timeline's folder '/proc/no/timeline' cannot be "
        "written on 2 of 2 ranks (the first: rank 0)"
    )
    assert proc.stderr.count(line) == 1, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
