"""``python -m mpi4jax_dist timeline DIR`` on files no job wrote: cut short, forged,
missing. Each gets a line and is left out, read in part, or named missing; the
reading is bounded by the files' sizes, not by what they say."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpi4jax_dist.diagnostics import timeline as report
from mpi4jax_dist.timing.timeline import EVENT, FORMAT


def write_rank(folder, rank, size, events=(), **meta):
    """A rank's files as a job writes them; ``events``: (enter, leave) pairs in
    ms, numbered 1, 2, ... on one communicator."""
    record = np.zeros(len(events), dtype=EVENT)
    for i, (enter, leave) in enumerate(events):
        record[i]["enter_ns"] = record[i]["wait_ns"] = int(enter * 1e6)
        record[i]["leave_ns"] = int(leave * 1e6)
        record[i]["comm"], record[i]["seq"], record[i]["count"] = 1, i + 1, 4
        record[i]["site"], record[i]["kind"], record[i]["type"] = 1, 1, 11
    record.tofile(folder / f"rank-{rank:05d}.events")
    body = {
        "format": FORMAT,
        "rank": rank,
        "size": size,
        "start": {"offset_ns": 0, "error_ns": 0, "at_ns": 0},
        "end": {"offset_ns": 0, "error_ns": 0, "at_ns": 10**9},
        "started_ns": 0,
        "stopped_ns": 10**9,
        "events": len(events),
        "lost": 0,
        "sites": {"1": "step.py:3 in body"},
        "comms": {"1": {"key": "ab", "name": "MPI_COMM_WORLD", "size": size}},
    }
    body.update(meta)
    (folder / f"rank-{rank:05d}.json").write_text(json.dumps(body))


def test_the_last_rank_from_files(tmp_path):
    write_rank(tmp_path, 0, 2, [(0, 10), (20, 30)])
    write_rank(tmp_path, 1, 2, [(9, 10), (21, 30)])
    text = report.report(tmp_path)
    assert "2 calls; a rank's time in one" in text, text
    assert "last to arrive: rank 1 in 2 of 2" in text, text
    assert (tmp_path / "trace.json").exists()


def test_a_forged_size_is_not_believed(tmp_path):
    """A JSON that says 10^12 ranks: one line, counted from the files read, in no
    more memory than they hold."""
    write_rank(tmp_path, 0, 10**12, [(0, 1)])
    text = report.report(tmp_path)
    assert (
        f"no timeline from {10**12 - 1} of {10**12} ranks (the first: rank 1)" in text
    )


def test_files_cut_short_forged_or_linked_are_named_and_left_out(tmp_path):
    write_rank(tmp_path, 0, 3, [(0, 1), (2, 3)])
    with open(tmp_path / "rank-00000.events", "ab") as out:
        out.write(b"x" * 10)  # a rank killed while writing
    write_rank(tmp_path, 1, 3, [(0, 1)], format="something else")
    os.symlink(tmp_path / "rank-00000.json", tmp_path / "rank-00002.json")
    ranks, notes = report.read(tmp_path)
    assert [r.rank for r in ranks] == [0] and len(ranks[0].events) == 2
    text = "\n".join(notes)
    assert "rank-00000.events: 10 bytes past its last whole event" in text
    assert "rank-00001.json: not a timeline of mpi4jax_dist" in text
    assert "rank-00002.json: not a regular file" in text


def test_a_rank_that_died_keeps_what_it_wrote(tmp_path):
    write_rank(tmp_path, 0, 2, [(0, 1)])
    write_rank(tmp_path, 1, 2, [(0, 1)])
    meta = json.loads((tmp_path / "rank-00001.json").read_text())
    for key in ("events", "end", "stopped_ns"):
        del meta[key]
    (tmp_path / "rank-00001.json").write_text(json.dumps(meta))
    text = report.report(tmp_path)
    assert "rank 1: no end written (the rank died, or is still running)" in text


def test_a_folder_without_a_timeline(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no rank-N.json"):
        report.read(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        report.read(tmp_path / "nothing")


def test_each_rank_is_moved_onto_rank_0_s_clock(tmp_path):
    """Rank 1's clock runs 1 s ahead of rank 0's: it entered at 5 ms (rank 0's
    clock), written 1,005 ms, and rank 0 at 8 ms; so rank 0 came last. Read on
    their own clocks, rank 1 would."""
    clock = {"offset_ns": 10**9, "error_ns": 0, "at_ns": 10**9}
    write_rank(tmp_path, 0, 2, [(8, 10)])
    write_rank(tmp_path, 1, 2, [(1005, 1010)], start=clock, end=clock)
    text = report.report(tmp_path)
    assert "last to arrive: rank 0 in 1 of 1" in text, text
    # Rank 1 waited 3 ms of its 5 in the call, rank 0 none of its 2: 3 of 7 ms.
    assert "of all of it, 43 % waiting for the last rank to arrive" in text, text


def test_the_trace_holds_whole_ranks_up_to_its_limit(tmp_path, monkeypatch):
    """At 10^5 ranks every call would not open in Perfetto: the trace keeps the
    first ranks whose calls fit, and the summary says which."""
    monkeypatch.setattr(report, "MAX_TRACE_SLICES", 5)
    for rank in range(3):
        write_rank(tmp_path, rank, 3, [(0, 1), (2, 3)])
    text = report.report(tmp_path)
    assert "trace.json, its first 2 ranks of 3" in text, text
    trace = json.loads((tmp_path / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["pid"] for e in slices}) == [0, 1] and len(slices) == 4


def test_values_of_the_wrong_type_are_named_not_raised(tmp_path):
    write_rank(tmp_path, 0, 2, [(0, 1)], stopped_ns="soon")
    write_rank(tmp_path, 1, 2, [(0, 1)], comms={"1": 5}, sites={"1": ["a list"]})
    text = report.report(tmp_path)
    assert "rank-00000.json: its 'stopped_ns' is not a number: left out" in text
    assert "(no site): allreduce SUM float32[4] on a communicator" in text, text


def test_the_bootstrap_s_calls_name_the_last_to_arrive_and_forged_rows_are_dropped(
    tmp_path,
):
    """Rank 1 entered the bootstrap 5 ms after rank 0: the line names it. Rows of
    the wrong shape or type, or times past 2^62 ns, are left out unread."""
    boot = [["Idup", "arrival", 1_000_000, 9_000_000]]
    forged = [["Idup"], ["Idup", "arrival", 10**30, 1], "row", ["Idup", 3, 1, 2]]
    write_rank(tmp_path, 0, 2, [(10, 11)], bootstrap=boot + forged)
    late = [["Idup", "arrival", 6_000_000, 9_000_000]]
    write_rank(tmp_path, 1, 2, [(10, 11)], bootstrap=late + [["Split", "topology"]])
    text = report.report(tmp_path)
    assert (
        "the bootstrap (jax.distributed.initialize()'s MPI calls, 2 ranks): "
        "8.000 ms from the first's entry to the last's end on the median rank; the "
        "last to arrive: rank 1, 5.000 ms after the first; the longest call: Idup "
        "(arrival), 5.500 ms median"
    ) in text, text
    trace = json.loads((tmp_path / "trace.json").read_text())
    booted = [e for e in trace["traceEvents"] if e.get("cat") == "bootstrap"]
    assert [(e["pid"], e["ts"]) for e in booted] == [(0, 0.0), (1, 5000.0)], booted
    write_rank(tmp_path, 0, 2, [(10, 11)], bootstrap={"not": "a list"})
    write_rank(tmp_path, 1, 2, [(10, 11)])
    assert "the bootstrap" not in report.report(tmp_path)
