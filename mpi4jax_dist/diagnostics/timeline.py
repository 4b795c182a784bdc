"""``python -m mpi4jax_dist timeline DIR``: the ranks' timelines
(:mod:`mpi4jax_dist.timing.timeline`) on one clock, as a trace and a summary.

Each rank's times are moved onto rank 0's clock by its measured offset (drawn
linearly from the start's to the end's, where both were measured). A call is
matched across ranks by its communicator's key and its number there; its last
rank to arrive is the one that entered last, and each rank's time in it splits
into the wait for that rank (from its own entry, or its wait's for a
non-blocking call, to the last entry) and the transfer after it. The trace, in
the Chrome trace-event format that https://ui.perfetto.dev and chrome://tracing
open, has a row per rank and a slice per call.

Bounded by what it reads: a file is read only as far as its size (an events
file to its last whole event, a JSON file up to ``MAX_META_BYTES``), nothing a
file says sizes anything, and a file that is not a rank's (wrong name, format,
rank, or a link) gets one line saying so and is left out.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from ..timing.timeline import EVENT, FORMAT

MAX_META_BYTES = 16 << 20
_NAME = re.compile(r"rank-(\d+)\.json")
_KINDS = {1: "allreduce", 2: "iallreduce"}
_OPS = ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")
# XLA's element types (xla_data.proto's PrimitiveType) as NumPy names them.
_TYPES = {
    1: "bool",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "uint8",
    7: "uint16",
    8: "uint32",
    9: "uint64",
    11: "float32",
    12: "float64",
    15: "complex64",
    18: "complex128",
}


class Rank:
    """One rank's timeline as read: its JSON and events, times on rank 0's clock."""

    def __init__(self, meta: dict, events: np.ndarray):
        self.meta, self.events = meta, events
        self.rank = meta["rank"]

    def to_rank_0(self, t: np.ndarray) -> np.ndarray:
        """``t`` (this rank's clock, ns) on rank 0's clock."""
        start, end = self.meta["start"], self.meta.get("end") or {}
        if end.get("offset_ns") is None or end["at_ns"] <= start["at_ns"]:
            return t - start["offset_ns"]
        slope = (end["offset_ns"] - start["offset_ns"]) / (
            end["at_ns"] - start["at_ns"]
        )
        return t - (start["offset_ns"] + slope * (t - start["at_ns"])).astype(np.int64)

    def call_text(self, e) -> str:
        kind = _KINDS.get(int(e["kind"]), "call")
        op = _OPS[e["op"]] if e["op"] < len(_OPS) else "?"
        dtype = _TYPES.get(int(e["type"]), "?")
        return f"{kind} {op} {dtype}[{int(e['count'])}]"

    def site(self, site_id: int) -> str:
        return self.meta.get("sites", {}).get(str(site_id)) or "(no site)"

    def comm(self, comm_id: int) -> dict:
        return self.meta.get("comms", {}).get(str(comm_id)) or {}


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _check_meta(meta, rank: int) -> str | None:
    """Why ``meta`` is not rank ``rank``'s timeline JSON, or None."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"not a timeline of mpi4jax_dist (its format is not {FORMAT!r})"
    if meta.get("rank") != rank:
        return f"says rank {meta.get('rank')!r}, its name rank {rank}"
    size = meta.get("size")
    if not isinstance(size, int) or not 0 <= rank < size:
        return f"says a job of {size!r} ranks"
    start = meta.get("start")
    if not isinstance(start, dict) or not all(
        isinstance(start.get(k), int) for k in ("offset_ns", "at_ns")
    ):
        return "its clock was not measured against rank 0's: it cannot be aligned"
    end = meta.get("end")
    if end is not None and not (
        isinstance(end, dict)
        and isinstance(end.get("at_ns"), int)
        and isinstance(end.get("offset_ns"), (int, type(None)))
    ):
        return "its end's clock offset is not a number"
    for key in ("sites", "comms"):
        if not isinstance(meta.get(key, {}), dict):
            return f"its {key!r} is not a table"
    return None


def read(directory) -> tuple[list[Rank], list[str]]:
    """The ranks' timelines in ``directory`` (by rank) and a line for each file
    left out or read in part.

    Raises:
        FileNotFoundError: ``directory`` holds no ``rank-N.json``, or is no folder.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    ranks, notes = [], []
    for path in sorted(folder.iterdir()):
        match = _NAME.fullmatch(path.name)
        if not match:
            continue
        rank = int(match.group(1))
        if not _regular(path) or path.stat().st_size > MAX_META_BYTES:
            notes.append(f"{path.name}: not a regular file of at most 16 MiB: left out")
            continue
        try:
            meta = json.loads(path.read_text(errors="replace"))
        except ValueError as err:
            notes.append(f"{path.name}: not JSON ({err}): left out")
            continue
        why = _check_meta(meta, rank)
        if why:
            notes.append(f"{path.name}: {why}: left out")
            continue
        events_path = path.with_suffix(".events")
        events = np.zeros(0, dtype=EVENT)
        if "events" not in meta:
            notes.append(
                f"rank {rank}: no end written (the rank died, or is still running): "
                "its calls up to the last time its memory filled"
            )
        if _regular(events_path):
            size = events_path.stat().st_size
            if size % EVENT.itemsize:
                notes.append(
                    f"{events_path.name}: {size % EVENT.itemsize} bytes past its "
                    "last whole event: left out"
                )
            events = np.fromfile(events_path, dtype=EVENT, count=size // EVENT.itemsize)
        elif meta.get("events"):
            notes.append(f"rank {rank}: its {events_path.name} is missing")
        if meta.get("lost"):
            notes.append(f"rank {rank}: {meta['lost']} calls lost to a failed write")
        ranks.append(Rank(meta, events))
    if not ranks and not notes:
        raise FileNotFoundError(f"{folder} holds no rank-N.json of a timeline")
    if ranks:
        # Counted from the ranks read, not from the size a file says.
        size = ranks[0].meta["size"]
        present = sorted(r.rank for r in ranks if r.rank < size)
        first = next((i for i, r in enumerate(present) if i != r), len(present))
        if len(present) < size:
            notes.append(
                f"no timeline from {size - len(present)} of {size} ranks "
                f"(the first: rank {first}): their calls' last rank may be one "
                "of them"
            )
    return ranks, notes


def calls(ranks: list[Rank]) -> dict:
    """Every rank's calls on rank 0's clock, matched across ranks: a dict of
    columns, one row per call of a rank, sorted by communicator, number, entry."""
    cols: dict = {k: [] for k in ("rank", "comm", "seq", "enter", "wait", "leave")}
    cols.update(site=[], text=[], size=[], comm_name=[])
    for r in ranks:
        e = r.events
        if not len(e):
            continue
        cols["rank"].append(np.full(len(e), r.rank))
        keys = [r.comm(int(c)) for c in e["comm"]]
        cols["comm"].append(np.array([k.get("key", f"?{r.rank}") for k in keys]))
        names = [k.get("name", "a communicator") for k in keys]
        cols["comm_name"].append(np.array(names, dtype=object))
        cols["size"].append(np.array([k.get("size", 0) for k in keys]))
        cols["seq"].append(e["seq"])
        for name in ("enter", "wait", "leave"):
            cols[name].append(r.to_rank_0(e[f"{name}_ns"]))
        cols["site"].append(np.array([r.site(int(s)) for s in e["site"]], dtype=object))
        cols["text"].append(np.array([r.call_text(x) for x in e], dtype=object))
    if not cols["rank"]:
        return {}
    table = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.lexsort((table["enter"], table["seq"], table["comm"]))
    table = {k: v[order] for k, v in table.items()}
    same = (table["comm"][1:] == table["comm"][:-1]) & (
        table["seq"][1:] == table["seq"][:-1]
    )
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    lengths = np.diff(np.concatenate((starts, [len(order)])))
    last = starts + lengths - 1  # sorted by entry: the last to arrive
    table["call"] = np.repeat(np.arange(len(starts)), lengths)
    table["last_rank"] = np.repeat(table["rank"][last], lengths)
    table["complete"] = np.repeat(lengths, lengths) == table["size"]
    in_call = table["leave"] - table["wait"]
    waiting = np.clip(np.repeat(table["enter"][last], lengths) - table["wait"], 0, None)
    table["in_call"] = in_call
    table["waiting"] = np.minimum(waiting, in_call)
    return table


def _ms(ns) -> str:
    return f"{ns / 1e6:.3f} ms"


def summary(ranks: list[Rank], table: dict, notes: list[str]) -> str:
    """The summary's text: the job, then each call site, the most time first."""
    lines = []
    size = ranks[0].meta["size"] if ranks else 0
    if not table:
        return "\n".join(
            [f"timeline of {len(ranks)} of {size} ranks: no calls"] + notes
        )
    n_calls = int(table["call"].max()) + 1
    span = int(table["leave"].max() - table["enter"].min())
    lines.append(
        f"timeline of {len(ranks)} of {size} ranks: {n_calls} calls, "
        f"{_ms(span)} from the first entry to the last return (rank 0's clock)"
    )
    shares = []
    for r in ranks:
        run = r.meta.get("stopped_ns", 0) - r.meta.get("started_ns", 0)
        mine = table["rank"] == r.rank
        if run > 0:
            shares.append((float(table["in_call"][mine].sum()) / run, r.rank))
    if shares:
        shares.sort()
        median = shares[len(shares) // 2][0]
        lines.append(
            f"in collectives: {100 * median:.1f} % of the median rank's time "
            f"(least: rank {shares[0][1]}, {100 * shares[0][0]:.1f} %; most: rank "
            f"{shares[-1][1]}, {100 * shares[-1][0]:.1f} %)"
        )
    lines.append("per call site, the most time first:")
    sites = {}
    for i, site in enumerate(table["site"]):
        key = (site, table["text"][i], table["comm_name"][i])
        sites.setdefault(key, []).append(i)
    by_time = sorted(sites.items(), key=lambda kv: -table["in_call"][kv[1]].sum())
    for (site, text, comm), rows in by_time:
        rows = np.array(rows)
        in_call, waiting = table["in_call"][rows], table["waiting"][rows]
        count = len(np.unique(table["call"][rows]))
        lines.append(f"  {site}: {text} on {comm}")
        waited = 100 * float(waiting.sum()) / (float(in_call.sum()) or 1.0)
        lines.append(
            f"    {count} call{'s' if count != 1 else ''}; a rank's time in one: "
            f"{_ms(np.median(in_call))} median, {_ms(np.percentile(in_call, 99))} "
            f"p99; of all of it, {waited:.0f} % waiting for the last rank to "
            f"arrive, {100 - waited:.0f} % after"
        )
        lines.append("    " + _last_text(table, rows))
    lines.append(_clocks_text(ranks))
    return "\n".join(lines + notes)


def _clocks_text(ranks: list[Rank]) -> str:
    """How far the clocks' alignment can be off at the start and the end (half
    the round trips on each rank's path to rank 0), and how far the offsets
    moved between them (drift, or the errors)."""
    error = max(r.meta["start"].get("error_ns") or 0 for r in ranks)
    text = f"clocks: on rank 0's within {error / 1e3:.1f} µs at the start"
    ends = [(r, r.meta.get("end") or {}) for r in ranks]
    ends = [(r, e) for r, e in ends if e.get("offset_ns") is not None]
    if ends:
        end_error = max(e.get("error_ns") or 0 for _, e in ends)
        moved = max(abs(e["offset_ns"] - r.meta["start"]["offset_ns"]) for r, e in ends)
        text += (
            f", {end_error / 1e3:.1f} µs at the end; the offsets moved at most "
            f"{moved / 1e3:.1f} µs between them"
        )
    if len(ends) < len(ranks):
        text += f"; {len(ranks) - len(ends)} ranks' end not measured"
    return text


def _last_text(table: dict, rows: np.ndarray) -> str:
    """Which ranks arrived last at these rows' calls, most often first."""
    complete = rows[table["complete"][rows]]
    if not len(complete):
        return (
            "last to arrive: unknown (no call seen on every rank of its communicator)"
        )
    calls, first = np.unique(table["call"][complete], return_index=True)
    lasts = table["last_rank"][complete][first]
    ranks, counts = np.unique(lasts, return_counts=True)
    top = np.argsort(-counts, kind="stable")[:3]
    said = ", ".join(
        f"rank {int(ranks[i])} in {int(counts[i])} of {len(calls)}" for i in top
    )
    return f"last to arrive: {said}"


def write_trace(ranks: list[Rank], table: dict, path: Path) -> None:
    """The Chrome trace-event file: a row per rank, a slice per call (and its
    wait, for a non-blocking call), times in µs from the first entry."""
    t0 = int(table["enter"].min()) if table else 0
    with open(path, "w") as out:
        out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True

        def emit(event):
            nonlocal first
            out.write(("" if first else ",\n") + json.dumps(event))
            first = False

        for r in ranks:
            name = f"rank {r.rank} ({r.meta.get('host', '?')})"
            emit(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": r.rank,
                    "args": {"name": name},
                }
            )
            emit(
                {
                    "ph": "M",
                    "name": "process_sort_index",
                    "pid": r.rank,
                    "args": {"sort_index": r.rank},
                }
            )
        for i in range(len(table.get("rank", ()))):
            rank = int(table["rank"][i])
            start = (int(table["enter"][i]) - t0) / 1e3
            # "allreduce #12 SUM float32[4] at step.py:40 in body"
            kind, rest = table["text"][i].split(" ", 1)
            name = f"{kind} #{int(table['seq'][i])} {rest} at {table['site'][i]}"
            emit(
                {
                    "ph": "X",
                    "cat": "collective",
                    "name": name,
                    "pid": rank,
                    "tid": 0,
                    "ts": start,
                    "dur": (int(table["leave"][i]) - int(table["enter"][i])) / 1e3,
                    "args": {
                        "waiting for the last rank (us)": int(table["waiting"][i])
                        / 1e3,
                        "last to arrive": int(table["last_rank"][i]),
                    },
                }
            )
        out.write("\n]}\n")


def report(directory, trace: str | None = None) -> str:
    """Read ``directory``'s timeline, write its trace (default
    ``DIR/trace.json``) and return the summary's text."""
    ranks, notes = read(directory)
    table = calls(ranks)
    path = Path(trace) if trace else Path(directory) / "trace.json"
    write_trace(ranks, table, path)
    return summary(ranks, table, notes) + f"\ntrace: {path} (https://ui.perfetto.dev)"
