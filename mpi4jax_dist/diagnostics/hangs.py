"""``python -m mpi4jax_dist --hangs DIR``: the ranks' stack files
(``MPI4JAX_DIST_HANG_DIR/rank-N.txt``, written by :mod:`mpi4jax_dist.faults.hangs`)
grouped by where each rank's main thread stands."""

from __future__ import annotations

import linecache
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .. import _config
from ..faults.hangs import ranks_text

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_HEADER = re.compile(r"^# mpi4jax_dist stacks: rank (\d+) of (\d+)")
_MAIN = re.compile(r"^# main thread (0x[0-9a-fA-F]+)")
# Paths of code that is not the user's: what a stack's summary looks past.
_LIBRARY = re.compile(
    r"(site-packages|dist-packages|/lib/python\d|[\\/](jax|jaxlib|mpi4jax|"
    r"mpi4jax_dist|mpi4py|numpy)[\\/]|^<frozen )"
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


def parse_stacks(text: str) -> tuple[int | None, int | None, dict]:
    """Return (rank, size, {thread id: [frames, innermost first]}) of one file, and
    the main thread's stack under the key ``"main"``."""
    rank = size = main = None
    threads: dict = {}
    current = None
    for line in text.splitlines():
        if m := _HEADER.match(line):
            rank, size = int(m.group(1)), int(m.group(2))
        elif m := _MAIN.match(line):
            main = int(m.group(1), 16)
        elif m := _THREAD.match(line):
            current = threads.setdefault(int(m.group(1), 16), [])
        elif (m := _FRAME.match(line)) and current is not None:
            current.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    if main in threads:
        threads["main"] = threads[main]
    return rank, size, threads


def where(frames: list[Frame]) -> str:
    """``at cg.py:123 in solve: `r = allreduce(r)`, inside jax (pxla.py:413)``: the
    innermost frame of the user's code (its source line where this machine has the
    file) and, where library code runs inside it, the innermost library frame."""
    if not frames:
        return "with no Python frames"
    user = next((f for f in frames if not _LIBRARY.search(f.file)), None)
    text = ""
    if user is not None:
        text = f"at {Path(user.file).name}:{user.line} in {user.function}"
        source = linecache.getline(user.file, user.line).strip()
        if source:
            text += f": `{source}`"
    inner = frames[0]
    if inner is not user:
        package = _package(inner.file)
        text += (", inside " if text else "inside ") + (
            f"{package} ({Path(inner.file).name}:{inner.line} in {inner.function})"
        )
    return text


def _package(path: str) -> str:
    """The package a library file belongs to (``jax``), or its folder's name."""
    parts = Path(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts) - 1:
            return parts[parts.index(marker) + 1]
    match = _LIBRARY.search(path)
    if match and match.group(2):
        return match.group(2)
    return Path(path).parent.name or path


def summarize(directory: str | os.PathLike, stacks: int = 3) -> str:
    """Group the ranks of ``directory``'s ``rank-N.txt`` files by their main
    thread's stack: one line per group, the largest first, then up to ``stacks``
    groups' stacks in full (the smallest first: the odd ones out)."""
    folder = Path(directory)
    files = sorted(folder.glob("rank-*.txt"))
    if not files:
        raise FileNotFoundError(
            f"no rank-N.txt in {folder}: set {_config.HANG_DIR}={folder} for the "
            f"job, then send its ranks SIGUSR1 (or let "
            f"{_config.COLLECTIVE_TIMEOUT} expire)."
        )
    groups: dict = defaultdict(list)
    sizes = set()
    unreadable = []
    for path in files:
        rank, size, threads = parse_stacks(path.read_text(errors="replace"))
        if rank is None:
            unreadable.append(path.name)
            continue
        sizes.add(size)
        groups[tuple(threads.get("main", []))].append(rank)
    seen = sorted(r for ranks in groups.values() for r in ranks)
    size = max(sizes) if sizes else len(seen)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), min(item[1])))
    lines = [f"mpi4jax_dist: stacks of {len(seen)} of {size} ranks in {folder}"]
    for frames, ranks in ordered:
        count = f"{len(ranks)} rank{'s' if len(ranks) > 1 else ''}"
        lines.append(f"{count} {where(list(frames))}: {ranks_text(ranks)}")
    absent = sorted(set(range(size)) - set(seen))
    if absent:
        lines.append(f"no stacks from {ranks_text(absent)}")
    if unreadable:
        lines.append(f"not a stacks file: {', '.join(unreadable)}")
    for frames, ranks in sorted(ordered, key=lambda item: len(item[1]))[:stacks]:
        lines.append("")
        lines.append(f"{ranks_text(ranks)}, main thread (most recent call first):")
        lines += [f"  {f.file}:{f.line} in {f.function}" for f in frames]
    return "\n".join(lines)
