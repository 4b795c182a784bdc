"""``python -m mpi4jax_dist --hangs DIR``: the ranks' stack files
(``MPI4JAX_DIST_HANG_DIR/rank-N.txt``, written by :mod:`mpi4jax_dist.faults.hangs`)
grouped by where each rank's main thread stands.

Bounded by what it reads, not by what a file says: each file is read up to
``MAX_FILE_BYTES`` and a header's rank count is only believed as far as the ranks
that answered; a file that is not a regular ``rank-N.txt`` of one rank (a folder,
a link, a file cut short, a rank that two files claim) gets one line saying so.
It reads nothing else: a frame's source line is quoted as the stacks file holds
it (the writer's ``# line PATH:N: TEXT``), never read from the file the frame
names, which may be a FIFO, a device or anything a forged file names; a place
the summary shows without its line gets one line saying why."""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import defaultdict
from pathlib import Path

from .. import _config
from ..faults import stacks as stack_text
from ..faults.stacks import ranks_text

# A dump of every thread is a few KiB (faulthandler writes at most 100 frames of
# at most 100 threads): far above that is not a dump of ours.
MAX_FILE_BYTES = 4 << 20
_NAME = re.compile(r"rank-(\d+)\.txt")


def summarize(directory: str | os.PathLike, stacks: int = 3) -> str:
    """Group the ranks of ``directory``'s ``rank-N.txt`` files by their main
    thread's stack: one line per group, the largest first, then up to ``stacks``
    groups' stacks in full (the smallest first: the odd ones out).

    Raises:
        FileNotFoundError: ``directory`` holds no ``rank-N.txt``, or is no folder.
    """
    folder = Path(directory)
    files = _stack_files(folder)
    groups: dict = defaultdict(list)
    sizes = set()
    left_out = []
    sources: dict = {}
    unread: dict = {}
    times = []
    owner: dict = {}  # rank -> the file that holds it
    for path in files:
        text, problem = _read(path)
        if problem:
            left_out.append(f"{path.name}: {problem}")
            continue
        rank, size, threads = stack_text.parse_stacks(text)
        if rank is None:
            left_out.append(f"{path.name}: not a stacks file (no header)")
            continue
        if "main" not in threads:
            left_out.append(f"{path.name}: cut short (no main thread's stack)")
            continue
        if rank in owner:
            left_out.append(
                f"{path.name}: says rank {rank}, as {owner[rank]} does: left out"
            )
            continue
        owner[rank] = path.name
        sizes.add(size)
        groups[tuple(threads["main"])].append(rank)
        # Only the main thread's places are ever quoted: the lines of the
        # others' places are not kept.
        places = {(f.file, f.line) for f in threads["main"]}
        for place in places & threads["source"].keys():
            sources.setdefault(place, threads["source"][place])
        for place in places & threads["unread"].keys():
            unread.setdefault(place, threads["unread"][place])
        if "times" in threads:
            times.append(threads["times"])
    seen = sorted(owner)
    size = max(sizes) if sizes else len(seen)
    lines = [f"mpi4jax_dist: stacks of {len(seen)} of {size} ranks in {folder}"]
    if len(sizes) > 1:
        said = ", ".join(map(str, sorted(sizes)))
        lines.append(f"the files disagree on the job's size: {said}")
    if times:
        came = sorted(t[0] for t in times)
        late = max((t[1] - t[0]).total_seconds() for t in times)
        lines.append(
            f"dumped from {came[0].isoformat(timespec='milliseconds')} to "
            f"{came[-1].isoformat(timespec='milliseconds')} (the ranks' clocks), "
            f"each written within {late:.3g} s"
        )
    lines += stack_text.group_lines(groups, sources, odd_first=False)
    if absent := absent_text(seen, size):
        lines.append(f"no stacks from {absent}")
    lines += left_out
    lines += _unquoted(groups, sources, unread)
    smallest = sorted(groups.items(), key=lambda item: (len(item[1]), min(item[1])))
    for frames, ranks in smallest[:stacks]:
        lines.append("")
        lines.append(f"{ranks_text(ranks)}, main thread (most recent call first):")
        lines += [f"  {f.file}:{f.line} in {f.function}" for f in frames]
    return "\n".join(lines)


def _unquoted(groups: dict, sources: dict, unread: dict) -> list[str]:
    """One line for each place a group's line names without its source line: why
    the writer read none (its ``# no line`` note), or that the files hold none."""
    notes = {}
    for frames in groups:
        frame = stack_text.user_frame(frames)
        if frame is None or sources.get(place := (frame.file, frame.line)):
            continue  # no user frame, or one where() quotes
        if why := unread.get(place):
            notes[place] = (
                f"{frame.file}:{frame.line}: no source line (the writer's note: {why})"
            )
        else:
            notes[place] = (
                f"{frame.file}:{frame.line}: no source line in the stacks files "
                f"(--hangs reads no file they name)"
            )
    return list(notes.values())


def _stack_files(folder: Path) -> list[Path]:
    """The entries of ``folder`` named ``rank-N.txt``, by rank."""
    try:
        names = [n for n in os.listdir(folder) if _NAME.fullmatch(n)]
    except (FileNotFoundError, NotADirectoryError):
        names = []
    if not names:
        where = folder if folder.is_dir() else f"{folder} (no such folder)"
        raise FileNotFoundError(
            f"no rank-N.txt in {where}: set {_config.HANG_DIR}={folder} for the "
            f"job, then send its ranks SIGUSR1."
        )
    return [folder / n for n in sorted(names, key=lambda n: int(_NAME.match(n)[1]))]


def _read(path: Path) -> tuple[str, str | None]:
    """The text of a regular file of at most ``MAX_FILE_BYTES``, not through a
    link; else ("", why not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            return "", "a symbolic link, not a stacks file: left out"
        return "", f"cannot be read ({err.strerror})"
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            return "", "a folder, not a stacks file"
        return "", "not a regular file: left out"
    with os.fdopen(fd, "rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        return "", f"larger than {MAX_FILE_BYTES >> 20} MiB: not a dump of ours"
    return data.decode(errors="replace"), None


def absent_text(seen: list[int], size: int, limit: int = 8) -> str:
    """The ranks below ``size`` not in ``seen`` (sorted), as :func:`ranks_text`
    says them, in time and memory of ``len(seen)``, whatever ``size`` is."""
    runs = []
    count = 0
    start = 0
    for rank in [*seen, size]:
        if rank > start:
            if len(runs) < limit:
                runs.append((start, rank - 1))
            count += rank - start
        start = max(start, rank + 1)
    if not count:
        return ""
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    shown = sum(b - a + 1 for a, b in runs)
    if count > shown:
        text += f" and {count - shown} more"
    return ("rank " if count == 1 else "ranks ") + text
