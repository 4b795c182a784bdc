"""``python -m mpi4jax_dist --hangs DIR``: the ranks' stack files
(``MPI4JAX_DIST_HANG_DIR/rank-N.txt``, written by :mod:`mpi4jax_dist.faults.hangs`)
grouped by where each rank's main thread stands."""

from __future__ import annotations

import linecache
import os
from collections import defaultdict
from pathlib import Path

from .. import _config
from ..faults import stacks as stack_text
from ..faults.stacks import ranks_text


def summarize(directory: str | os.PathLike, stacks: int = 3) -> str:
    """Group the ranks of ``directory``'s ``rank-N.txt`` files by their main
    thread's stack: one line per group, the largest first, then up to ``stacks``
    groups' stacks in full (the smallest first: the odd ones out)."""
    folder = Path(directory)
    files = sorted(folder.glob("rank-*.txt"))
    if not files:
        where = f"{folder} (no such folder)" if not folder.is_dir() else folder
        raise FileNotFoundError(
            f"no rank-N.txt in {where}: set {_config.HANG_DIR}={folder} for the "
            f"job, then send its ranks SIGUSR1."
        )
    linecache.checkcache()  # a file read before may have changed since
    groups: dict = defaultdict(list)
    sizes = set()
    unreadable = []
    sources: dict = {}
    times = []
    for path in files:
        rank, size, threads = stack_text.parse_stacks(path.read_text(errors="replace"))
        if rank is None:
            unreadable.append(path.name)
            continue
        sizes.add(size)
        groups[tuple(threads.get("main", []))].append(rank)
        for place, source in threads["source"].items():
            sources.setdefault(place, source)
        if "times" in threads:
            times.append(threads["times"])
    seen = sorted(r for ranks in groups.values() for r in ranks)
    size = max(sizes) if sizes else len(seen)
    lines = [f"mpi4jax_dist: stacks of {len(seen)} of {size} ranks in {folder}"]
    if times:
        came = sorted(t[0] for t in times)
        late = max((t[1] - t[0]).total_seconds() for t in times)
        lines.append(
            f"dumped from {came[0].isoformat(timespec='milliseconds')} to "
            f"{came[-1].isoformat(timespec='milliseconds')} (the ranks' clocks), "
            f"each written within {late:.3g} s"
        )
    lines += stack_text.group_lines(groups, sources, odd_first=False)
    absent = sorted(set(range(size)) - set(seen))
    if absent:
        lines.append(f"no stacks from {ranks_text(absent)}")
    if unreadable:
        lines.append(f"not a stacks file: {', '.join(unreadable)}")
    smallest = sorted(groups.items(), key=lambda item: (len(item[1]), min(item[1])))
    for frames, ranks in smallest[:stacks]:
        lines.append("")
        lines.append(f"{ranks_text(ranks)}, main thread (most recent call first):")
        lines += [f"  {f.file}:{f.line} in {f.function}" for f in frames]
    return "\n".join(lines)
