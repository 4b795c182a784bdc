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

import functools
import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from ..ops.common import OPS
from ..timing.timeline import EVENT, FORMAT

MAX_META_BYTES = 16 << 20
# The most calls the trace holds: Perfetto opens a few million slices.
MAX_TRACE_SLICES = 2_000_000
# The most of the bootstrap's calls read from a rank's file (it makes about ten).
MAX_BOOTSTRAP_CALLS = 1000
_NAME = re.compile(r"rank-(\d+)\.json")
_KINDS = {1: "allreduce", 2: "iallreduce"}
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
        kind = self.meta.get("kinds", {}).get(str(int(e["kind"])))
        kind = kind if isinstance(kind, str) else _KINDS.get(int(e["kind"]), "call")
        # A call of XLA's may have no op (255: MPI_Allgather), no type (0) and
        # no one count (-1: MPI_Comm_split, MPI_Reduce_scatter's counts).
        op = "" if e["op"] == 255 else OPS[e["op"]] if e["op"] < len(OPS) else "?"
        count = int(e["count"])
        dtype = _TYPES.get(int(e["type"]), "?" if e["type"] or count >= 0 else "")
        shape = f"{dtype}[{count}]" if count >= 0 else dtype
        return " ".join(part for part in (kind, op, shape) if part)

    @functools.cached_property
    def bootstrap(self) -> list[tuple[str, str, int, int]]:
        """The bootstrap's MPI calls that ended (name, phase, entry and end on
        rank 0's clock), as far as the file gives them rightly typed: at most
        ``MAX_BOOTSTRAP_CALLS``; read once, for the summary and the trace."""
        rows = self.meta.get("bootstrap")
        if not isinstance(rows, list):
            return []
        kept = [
            row
            for row in rows[:MAX_BOOTSTRAP_CALLS]
            if isinstance(row, list)
            and len(row) == 4
            and all(isinstance(v, str) for v in row[:2])
            and all(isinstance(v, int) and 0 < v < 1 << 62 for v in row[2:])
        ]
        if not kept:
            return []
        times = self.to_rank_0(np.array([row[2:] for row in kept], dtype=np.int64))
        return [
            (n, p, int(a), int(b))
            for (n, p, *_), (a, b) in zip(kept, times, strict=True)
        ]

    def site(self, site_id: int) -> str:
        text = self.meta.get("sites", {}).get(str(site_id))
        return text if isinstance(text, str) and text else "(no site)"

    def comm(self, comm_id: int) -> dict:
        """The communicator's key, name and size, as far as the file gives them
        rightly typed."""
        comm = self.meta.get("comms", {}).get(str(comm_id))
        if not isinstance(comm, dict):
            return {}
        size = comm.get("size")
        return {
            "key": str(comm.get("key", f"?{self.rank}")),
            "name": str(comm.get("name", "a communicator")),
            "size": size if isinstance(size, int) else 0,
        }


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
    if not isinstance(start.get("error_ns"), (int, type(None))):
        return "its start's clock error is not a number"
    end = meta.get("end")
    if end is not None and not (
        isinstance(end, dict)
        and isinstance(end.get("at_ns"), int)
        and isinstance(end.get("offset_ns"), (int, type(None)))
        and isinstance(end.get("error_ns"), (int, type(None)))
    ):
        return "its end's clock offset is not a number"
    for key in ("started_ns", "stopped_ns", "events", "lost"):
        if not isinstance(meta.get(key, 0), int):
            return f"its {key!r} is not a number"
    for key in ("sites", "comms", "kinds"):
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


class _Names:
    """Texts numbered as met, so that the table holds small integers, not
    strings: at 10^5 ranks a string per call would not fit."""

    def __init__(self):
        self.index: dict = {}
        self.texts: list = []

    def codes(self, texts: list) -> np.ndarray:
        for text in texts:
            if text not in self.index:
                self.index[text] = len(self.texts)
                self.texts.append(text)
        return np.array([self.index[t] for t in texts], dtype=np.int64)


def _coded(values: np.ndarray, text_of, names: _Names) -> np.ndarray:
    """Each of ``values`` (a rank's ids) as the number of its text in
    ``names``: one lookup per distinct id, not per call."""
    distinct, inverse = np.unique(values, return_inverse=True)
    return names.codes([text_of(v) for v in distinct])[inverse]


def _columns(r: Rank, names: dict) -> dict:
    """Rank ``r``'s calls as the table's columns (texts as ``names``' numbers)."""
    e = r.events
    comm = e["comm"]
    distinct, inverse = np.unique(comm, return_inverse=True)
    sizes = np.array([r.comm(int(c)).get("size", 0) for c in distinct])
    return {
        "rank": np.full(len(e), r.rank),
        "seq": e["seq"],
        "enter": r.to_rank_0(e["enter_ns"]),
        "wait": r.to_rank_0(e["wait_ns"]),
        "leave": r.to_rank_0(e["leave_ns"]),
        "size": sizes[inverse],
        "comm": _coded(
            comm, lambda c: r.comm(int(c)).get("key", f"?{r.rank}"), names["comm"]
        ),
        "comm_name": _coded(
            comm,
            lambda c: r.comm(int(c)).get("name", "a communicator"),
            names["comm_name"],
        ),
        "site": _coded(e["site"], lambda s: r.site(int(s)), names["site"]),
        "text": _coded(e[["kind", "op", "type", "count"]], r.call_text, names["text"]),
    }


def calls(ranks: list[Rank]) -> dict:
    """Every rank's calls on rank 0's clock, matched across ranks: a dict of
    columns, one row per call of a rank, sorted by communicator, number, entry;
    ``site``, ``text``, ``comm`` and ``comm_name`` are numbers of the texts in
    ``table["names"]``."""
    names = {k: _Names() for k in ("site", "text", "comm", "comm_name")}
    cols: dict = {}
    for r in ranks:
        if len(r.events):
            for k, v in _columns(r, names).items():
                cols.setdefault(k, []).append(v)
    if not cols:
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
    table["names"] = {k: v.texts for k, v in names.items()}
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
    ranks_in = np.array([r.rank for r in ranks])
    spent = np.bincount(
        table["rank"], weights=table["in_call"], minlength=max(ranks_in) + 1
    )
    shares = sorted(
        (float(spent[r.rank]) / run, r.rank)
        for r in ranks
        if (run := r.meta.get("stopped_ns", 0) - r.meta.get("started_ns", 0)) > 0
    )
    if shares:
        median = shares[len(shares) // 2][0]
        lines.append(
            f"in collectives: {100 * median:.1f} % of the median rank's time "
            f"(least: rank {shares[0][1]}, {100 * shares[0][0]:.1f} %; most: rank "
            f"{shares[-1][1]}, {100 * shares[-1][0]:.1f} %)"
        )
    lines.append("per call site, the most time first:")
    names = table["names"]
    # A site: its place, call and communicator's name, as one number per row.
    key = np.stack([table["site"], table["text"], table["comm_name"]], axis=1)
    sites, which = np.unique(key, axis=0, return_inverse=True)
    which = which.reshape(-1)
    time_at = np.bincount(which, weights=table["in_call"])
    for s in np.argsort(-time_at, kind="stable"):
        rows = np.flatnonzero(which == s)
        site, text, comm = (
            names[k][c]
            for k, c in zip(("site", "text", "comm_name"), sites[s], strict=True)
        )
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
    lines += _bootstrap_text(ranks)
    lines.append(_clocks_text(ranks))
    return "\n".join(lines + notes)


def _bootstrap_text(ranks: list[Rank]) -> list[str]:
    """The bootstrap's MPI calls (``jax.distributed.initialize()``'s, before the
    timeline's start, on rank 0's clock as the start's offset puts them): the
    median rank's span, who reached it last, and its longest call."""
    calls = {r.rank: r.bootstrap for r in ranks}
    calls = {rank: rows for rank, rows in calls.items() if rows}
    if not calls:
        return []
    spans = sorted(max(c[3] for c in rows) - rows[0][2] for rows in calls.values())
    arrivals = sorted((rows[0][2], rank) for rank, rows in calls.items())
    late = arrivals[-1][0] - arrivals[0][0]
    lasting: dict = {}
    for rows in calls.values():
        for name, phase, enter, leave in rows:
            lasting.setdefault(f"{name} ({phase})", []).append(leave - enter)
    longest = max(lasting, key=lambda k: np.median(lasting[k]))
    return [
        f"the bootstrap (jax.distributed.initialize()'s MPI calls, {len(calls)} "
        f"ranks): {_ms(spans[len(spans) // 2])} from the first's entry to the last's "
        f"end on the median rank; the last to arrive: rank {arrivals[-1][1]}, "
        f"{_ms(late)} after the first; the longest call: {longest}, "
        f"{_ms(np.median(lasting[longest]))} median"
    ]


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


def write_trace(ranks: list[Rank], table: dict, path: Path) -> int:
    """The Chrome trace-event file: a row per rank, a slice per call, times in
    µs from the first entry; the ranks in order as long as their calls together
    stay within ``MAX_TRACE_SLICES`` (what Perfetto opens). Returns how many
    ranks it holds."""
    boot = {r.rank: r.bootstrap for r in ranks}
    enters = [rows[0][2] for rows in boot.values() if rows]
    enters += [int(table["enter"].min())] if table else []
    t0 = min(enters, default=0)
    size = max((r.rank for r in ranks), default=-1) + 1
    counts = np.bincount(table["rank"], minlength=size) if table else np.zeros(size)
    counts = counts + np.array([len(boot.get(r, ())) for r in range(size)])
    within = np.cumsum(counts) <= MAX_TRACE_SLICES
    ranks = [r for r in ranks if r.rank < len(within) and within[r.rank]]
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
        for r in ranks:
            for name, phase, enter, leave in boot[r.rank]:
                emit(
                    {
                        "ph": "X",
                        "cat": "bootstrap",
                        "name": f"bootstrap {name} ({phase})",
                        "pid": r.rank,
                        "tid": 0,
                        "ts": (enter - t0) / 1e3,
                        "dur": (leave - enter) / 1e3,
                    }
                )
        held = [r.rank for r in ranks]
        kept = np.flatnonzero(np.isin(table["rank"], held)) if table else ()
        for i in kept:
            rank = int(table["rank"][i])
            start = (int(table["enter"][i]) - t0) / 1e3
            # "allreduce #12 SUM float32[4] at step.py:40 in body"
            kind, _, rest = table["names"]["text"][table["text"][i]].partition(" ")
            site = table["names"]["site"][table["site"][i]]
            name = (
                f"{kind} #{int(table['seq'][i])}{' ' + rest if rest else ''} at {site}"
            )
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
    return len(ranks)


def report(directory, trace: str | None = None) -> str:
    """Read ``directory``'s timeline, write its trace (default
    ``DIR/trace.json``) and return the summary's text."""
    ranks, notes = read(directory)
    table = calls(ranks)
    path = Path(trace) if trace else Path(directory) / "trace.json"
    held = write_trace(ranks, table, path)
    which = "" if held == len(ranks) else f", its first {held} ranks of {len(ranks)}"
    return (
        summary(ranks, table, notes)
        + f"\ntrace: {path}{which} (https://ui.perfetto.dev)"
    )
