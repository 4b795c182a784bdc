"""Python stacks as faulthandler writes them and ``_ffi/stacks.c`` files them (a
header, the dump, each frame's source line as it read then): parsed into frames,
and groups of ranks summarized by where their main thread stands (the collective
and hang timeouts' reports, ``--hangs``).

A summary quotes the source lines it is given, and reads no file a stack names:
a frame's file is whatever its code's ``co_filename`` says (a FIFO, ``/dev/zero``)
and a stacks file anyone could have written. This process's own frames are quoted
by :func:`quote`, which reads a file as ``_ffi/stacks_sources.c`` does: a regular
file only, bounded."""

from __future__ import annotations

import os
import re
import stat
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_HEADER = re.compile(r"^# mpi4jax_dist stacks: rank (\d+) of (\d+)")
_MAIN = re.compile(r"^# main thread (0x[0-9a-fA-F]+)")
# When the dump came (the signal, or the request) and when it was written.
_TIMES = re.compile(r"^# host .* signal (\S+) written (\S+) reason ")
# A source line as it read when the dump was written (``_ffi/stacks.c``), or why
# the writer did not read the file (not a regular file, too large).
_SOURCE = re.compile(r"^# line (.*):(\d+): (.*)$")
_UNREAD = re.compile(r"^# no line (.*):(\d+): (.*)$")
# How far into a file quote() looks for a line (as _ffi/stacks_sources.c does).
MAX_SOURCE_BYTES = 16 << 20
# Paths of code that is not the user's: what a stack's summary looks past, and
# what a rank's status line does (_ffi/stacks_status.c compiles this very text
# as a POSIX extended regular expression: it reads alike in both).
LIBRARY_PATTERN = (
    r"(site-packages|dist-packages|/lib/python[0-9]|[\\/](jax|jaxlib|mpi4jax|"
    r"mpi4jax_dist|mpi4py|numpy)[\\/]|^<frozen )"
)
_LIBRARY = re.compile(LIBRARY_PATTERN)


class Frame(NamedTuple):
    file: str
    line: int
    function: str


def parse_stacks(text: str) -> tuple[int | None, int | None, dict]:
    """Return (rank, size, {thread id: [frames, innermost first]}) of one file, the
    main thread's stack under the key ``"main"``, under ``"source"`` the source
    lines the file holds ({(file, line): text}), under ``"unread"`` why the writer
    read no line of a place ({(file, line): why}), and under ``"times"`` when the
    dump came and when it was written (datetimes), where the header says."""
    rank = size = main = None
    threads: dict = {"source": {}, "unread": {}}
    current = None
    # Lines end at "\n" alone: a source line quoted in the file may hold a form
    # feed or U+2028, which splitlines() would take for the start of a new line.
    for line in text.split("\n"):
        if m := _SOURCE.match(line):
            threads["source"][m.group(1), int(m.group(2))] = m.group(3)
        elif m := _UNREAD.match(line):
            threads["unread"][m.group(1), int(m.group(2))] = m.group(3)
        elif m := _TIMES.match(line):
            try:
                threads["times"] = tuple(
                    datetime.strptime(t, "%Y-%m-%dT%H:%M:%S.%f%z") for t in m.groups()
                )
            except ValueError:
                pass
        elif m := _HEADER.match(line):
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


def where(frames: list[Frame], sources: dict | None = None) -> str:
    """``at cg.py:123 in solve: `r = allreduce(r)`, inside jax (pxla.py:413)``: the
    innermost frame of the user's code (its source line as ``sources`` holds it;
    no file is read) and, where library code runs inside it, the innermost library
    frame."""
    if not frames:
        return "with no Python frames"
    user = user_frame(frames)
    text = ""
    if user is not None:
        text = f"at {Path(user.file).name}:{user.line} in {user.function}"
        if source := (sources or {}).get((user.file, user.line)):
            text += f": `{source}`"
    inner = frames[0]
    if inner is not user:
        package = _package(inner.file)
        text += (", inside " if text else "inside ") + (
            f"{package} ({Path(inner.file).name}:{inner.line} in {inner.function})"
        )
    return text


def user_frame(frames) -> Frame | None:
    """The innermost frame of the user's code (the one :func:`where` quotes)."""
    return next((f for f in frames if not _LIBRARY.search(f.file)), None)


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


def told_apart(summaries: dict) -> dict:
    """Groups whose summaries are alike (the same innermost frames, other callers
    further out) get the innermost frame where their stack differs from the others':
    ``..., via cg.py:40 in load``."""
    alike = defaultdict(list)
    for frames, text in summaries.items():
        alike[text].append(frames)
    told = dict(summaries)
    for stacks in alike.values():
        if len(stacks) < 2:
            continue
        for frames in stacks:
            others = [f for f in stacks if f is not frames]
            for depth, frame in enumerate(frames):
                if any(len(o) <= depth or o[depth] != frame for o in others):
                    name = Path(frame.file).name
                    told[frames] += f", via {name}:{frame.line} in {frame.function}"
                    break
    return told


def quote(frames) -> list[str]:
    """Each frame's source line, as its file reads now ("" where there is none, or
    where :func:`source_line` does not read the file)."""
    return [source_line(f.file, f.line) for f in frames]


def source_line(path: str, line: int) -> str:
    """Line ``line`` (from 1) of ``path``, stripped; "" where there is none.

    Read as ``_ffi/stacks_sources.c`` reads it, for a frame's file is whatever its
    code's ``co_filename`` says: only where ``path`` is a regular file (a link to
    one too), opened without blocking, and never past its size as ``fstat`` gives
    it (0 for /proc's files) nor past ``MAX_SOURCE_BYTES``; no cache (linecache's
    would hold every file a rank ever quoted)."""
    try:
        if line < 1 or not stat.S_ISREG(os.stat(path).st_mode):
            return ""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return ""
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        left = min(info.st_size, MAX_SOURCE_BYTES)
        for _ in range(line):
            text = file.readline(left)  # readline(0) reads nothing
            if not text:
                return ""
            left -= len(text)
    # At most 1023 bytes of it, as the writer keeps.
    return text[:1023].decode(errors="replace").strip()


def group_lines(
    groups: dict, sources: dict, odd_first: bool, by_call: bool = False
) -> list[str]:
    """One line per group of ranks standing at one stack ({frames: ranks}):
    ``3 ranks at cg.py:123 in solve: ...: ranks 0-2``, the smallest groups first
    (``odd_first``) or the largest. With ``by_call`` the keys are ``(frames,
    call)``, the call being the collectives the record says the ranks are in
    (``allreduce #5 SUM float32[4] at step.py:12 in body``, or ""), said first;
    among groups of one size those in no recorded call come first (in a 2-rank
    job, the rank that stalled before the one waiting for it)."""

    def frames_of(key):
        return key[0] if by_call else key

    summaries = told_apart(
        {frames_of(k): where(list(frames_of(k)), sources) for k in groups}
    )
    sign = 1 if odd_first else -1
    ordered = sorted(
        groups.items(),
        key=lambda item: (
            sign * len(item[1]),
            bool(by_call and item[0][1]),  # in a recorded call: after
            min(item[1]),
        ),
    )
    lines = []
    for key, ranks in ordered:
        # A call kept apart per rank (report.hang_report) carries "\0rank".
        text = key[1].split("\0")[0] if by_call else ""
        call = f"in {text}, " if text else ""
        lines.append(
            f"{len(ranks)} rank{'s' if len(ranks) > 1 else ''} {call}"
            f"{summaries[frames_of(key)]}: {ranks_text(ranks)}"
        )
    return lines


def ranks_text(ranks, limit: int = 8) -> str:
    """``rank 3``, ``ranks 0-2, 7`` (runs of consecutive ranks; at most ``limit``
    runs, then how many more ranks)."""
    ranks = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    rest = sum(b - a + 1 for a, b in runs[limit:])
    if rest:
        text += f" and {rest} more"
    return ("rank " if len(ranks) == 1 else "ranks ") + text
