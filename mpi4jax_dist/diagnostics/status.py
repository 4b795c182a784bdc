"""``python -m mpi4jax_dist status``: ask a running job, healthy, slow or hung,
where its ranks stand (docs/status.rst).

Run on a node of the job: it finds the job's sockets in this user's status folder,
in its host's folder there (:mod:`mpi4jax_dist.faults.status`), asks the lowest
rank there for the whole job (that rank's ``_stacks`` thread asks every other
rank over MPI, on the watchdog's communicator, and gathers their lines), and
prints each rank's calls so far, the call or Python line it stands at, and the
ranks that lag. Where the job has no watchdog's communicator (one below
``MPI_THREAD_MULTIPLE``), it asks this node's ranks one by one. It starts no MPI
of its own."""

from __future__ import annotations

import errno
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field

from .. import _config
from ..faults.stacks import ranks_text
from ..faults.status import SUFFIX, host_dir, private_dir

FORMAT = "mpi4jax_dist status 1"
# How long the asked rank may take: the other ranks' threads look for requests
# every 3 s (faults/watchdog.py's C_POLL_S) and it waits one look and 2 s more.
ASK_TIMEOUT_S = 30.0
# A rank asked for its own line alone answers in milliseconds (a dump of its
# stacks into its own pipe).
LOCAL_TIMEOUT_S = 5.0
# The most a reply may hold: a line a rank of at most 1.5 KiB (stacks_status.c).
MAX_REPLY_BYTES = 1 << 30
# A rank lags where its share of time blocked in collectives is below this part
# of the median rank's: the others wait in their calls for it.
LAG_SHARE = 0.5


class StatusError(Exception):
    """No job to ask, or one that did not answer: one line for the user."""


@dataclass
class Rank:
    """One rank's line: its calls entered, the seconds it spent blocked in them
    since its first, the call it is in ("" for none) and its main thread's
    Python line ("" where not known)."""

    rank: int
    host: str
    pid: int
    calls: int
    blocked_s: float
    since_first_s: float
    wall: float
    call: str
    python: str

    @property
    def share(self) -> float | None:
        """The part of its time since its first call spent blocked in calls."""
        if self.since_first_s <= 0:
            return None
        return min(1.0, self.blocked_s / self.since_first_s)


@dataclass
class Status:
    job: str
    size: int
    asked: int
    took_s: float
    # The asked rank's calls once the others had answered: where they moved
    # meanwhile, the counts were read at different points of the work.
    asked_calls_after: int
    ranks: dict = field(default_factory=dict)  # rank -> Rank

    @property
    def moved(self) -> int:
        """How many calls the asked rank entered while the others were asked."""
        asked = self.ranks.get(self.asked)
        return self.asked_calls_after - asked.calls if asked else 0

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.size) if r not in self.ranks]


def find_jobs(directory: str) -> dict:
    """The jobs whose ranks listen in ``directory``: ``{key: {rank: path}}``. A
    socket no process listens on any more (a rank that was killed) is removed."""
    jobs: dict = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return jobs
    for name in names:
        key, _, rest = name.partition(".")
        rank = rest[: -len(SUFFIX)] if rest.endswith(SUFFIX) else ""
        if not rank.isdigit():
            continue
        path = os.path.join(directory, name)
        if _alive(path):
            jobs.setdefault(key, {})[int(rank)] = path
    return jobs


def _alive(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as err:
            if err.errno == errno.ECONNREFUSED:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            return False
    return True


def ask(path: str, request: str, timeout_s: float = ASK_TIMEOUT_S) -> str:
    """Send ``request`` ("job" or "local") to the rank listening at ``path``;
    return its reply, read to its end (at most ``MAX_REPLY_BYTES``), within
    ``timeout_s`` (TimeoutError past it)."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout_s)
        client.connect(path)
        client.sendall(f"{request}\n".encode())
        while size < MAX_REPLY_BYTES:
            client.settimeout(max(0.1, deadline - time.monotonic()))
            chunk = client.recv(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks).decode(errors="replace")


def parse(text: str) -> Status:
    """A reply as :class:`Status`; StatusError where it is not one whole."""
    lines = text.split("\n")
    head = lines[0].split("\t")
    if len(head) != 4 or head[0] != FORMAT:
        raise StatusError(f"the rank's reply is not {FORMAT!r}: {lines[0][:80]!r}")
    end = [line for line in lines if line.startswith("end\t")]
    if not end:
        raise StatusError("the rank's reply was cut short (no end line)")
    try:
        _, _, took_ns, calls_after = end[0].split("\t")
        status = Status(
            job=head[1],
            size=int(head[2]),
            asked=int(head[3]),
            took_s=int(took_ns) / 1e9,
            asked_calls_after=int(calls_after),
        )
    except ValueError:
        raise StatusError(
            f"the rank's reply has no numbers where they belong: {lines[0][:80]!r}, "
            f"{end[0][:80]!r}"
        ) from None
    for line in lines[1:]:
        fields = line.split("\t")
        if len(fields) != 9:
            continue
        rank, host, pid, calls, blocked, since, wall, call, python = fields
        try:
            numbers = [int(v) for v in (rank, pid, calls, blocked, since, wall)]
        except ValueError:
            continue  # not a rank's line: left out, as a missing rank
        rank, pid, calls, blocked, since, wall = numbers
        status.ranks[rank] = Rank(
            rank, host, pid, calls, blocked / 1e9, since / 1e9, wall / 1e9, call, python
        )
    return status


def status(
    directory: str | None = None, job: str | None = None, local: bool = False
) -> Status:
    """Ask the job that runs on this node (``job``: its key, where several do)."""
    directory = directory or _config.status_dir()
    if directory is None:
        raise StatusError(f"{_config.STATUS_DIR}=off: no rank listens for status")
    directory = host_dir(directory)  # this host's ranks: the only ones reachable
    if os.path.exists(directory) and (why := private_dir(directory)) is not None:
        raise StatusError(
            f"{why}: no job's sockets are looked for there (set "
            f"{_config.STATUS_DIR} to a folder of yours, alike for the job)"
        )
    jobs = find_jobs(directory)
    if job is not None and job not in jobs:
        raise StatusError(
            f"--job {job}: no such job answers on this node (the jobs here: "
            f"{', '.join(sorted(jobs)) or 'none'})"
        )
    if job is not None:
        jobs = {job: jobs[job]}
    if not jobs:
        raise StatusError(
            f"no job of this user's answers on this node (no live socket in "
            f"{directory}); each rank of a job makes one once "
            f"jax.distributed.initialize() has run, in {_config.STATUS_DIR} (run "
            "this where the job runs, with the same setting)"
        )
    if len(jobs) > 1:
        listed = "; ".join(
            f"--job {key} ({ranks_text(sorted(ranks))} here)"
            for key, ranks in sorted(jobs.items())
        )
        raise StatusError(f"{len(jobs)} jobs run on this node: name one: {listed}")
    (ranks,) = jobs.values()
    first = min(ranks)
    wait_s = ASK_TIMEOUT_S  # the wait and the words that name it, read once
    try:
        result = parse(ask(ranks[first], "local" if local else "job", wait_s))
    except TimeoutError:
        raise StatusError(
            f"rank {first} did not answer within {wait_s:g} s (its process "
            "stopped, or its stack writer's thread held up)"
        ) from None
    if len(result.ranks) == 1 and result.size > 1:
        # No watchdog's communicator to ask over (or --local): this node's ranks,
        # each asked.
        for rank, path in sorted(ranks.items()):
            if rank != first:
                try:
                    result.ranks.update(
                        parse(ask(path, "local", LOCAL_TIMEOUT_S)).ranks
                    )
                except (OSError, StatusError):
                    pass
    return result


def lagging(result: Status) -> tuple[list[int], list[int]]:
    """The ranks that lag: those with the fewest calls where the counts differ
    and the job stood still while they were read (the asked rank entered no call
    meanwhile), and those blocked in collectives for less than ``LAG_SHARE`` of
    the median rank's share of time (the others wait for them)."""
    calls = [r.calls for r in result.ranks.values()]
    fewest = []
    if calls and min(calls) < max(calls) and result.moved == 0:
        fewest = sorted(r.rank for r in result.ranks.values() if r.calls == min(calls))
    shares = {r.rank: r.share for r in result.ranks.values() if r.share is not None}
    waited_for = []
    if len(shares) > 1:
        median = statistics.median(shares.values())
        waited_for = sorted(r for r, s in shares.items() if s < LAG_SHARE * median)
    return fewest, waited_for


def text(result: Status, limit: int = 8) -> str:
    """What ``python -m mpi4jax_dist status`` prints."""
    asked = result.ranks.get(result.asked)
    lines = [
        f"job of coordinator {result.job}: {result.size} ranks; rank {result.asked}"
        f"{' on ' + asked.host if asked else ''} asked, {len(result.ranks)} answered"
        f" in {result.took_s:.2f} s"
    ]
    if result.missing:
        lines.append(
            f"no answer from {ranks_text(result.missing, limit)} (stopped, ended, or "
            "no thread to answer: not asked over MPI where the job runs below "
            "MPI_THREAD_MULTIPLE)"
        )
    if not result.ranks:
        return "\n".join(lines)
    walls = [r.wall for r in result.ranks.values()]
    calls = sorted(r.calls for r in result.ranks.values())
    lines.append(
        f"calls entered: {calls[0]} to {calls[-1]} (median "
        f"{statistics.median(calls):g}), read within {max(walls) - min(walls):.2f} s"
        " of each other"
        + (
            f", while rank {result.asked} entered {result.moved} more: the job "
            "moves, and counts read apart do not compare"
            if result.moved
            else ""
        )
    )
    fewest, waited_for = lagging(result)
    if fewest:
        lines.append(
            f"fewest calls: {ranks_text(fewest, limit)} ({calls[0]}, the others up to "
            f"{calls[-1]})"
        )
    shares = [r.share for r in result.ranks.values() if r.share is not None]
    if waited_for:
        least = min(shares)
        lines.append(
            f"waited for: {ranks_text(waited_for, limit)} (blocked in collectives "
            f"{100 * least:.1f} % of the time since the first call; median "
            f"{100 * statistics.median(shares):.1f} %): the others wait for them"
        )
    elif shares:
        lines.append(
            f"blocked in collectives: median {100 * statistics.median(shares):.1f} %"
            " of the time since the first call; no rank stands out"
        )
    lines.append("where the ranks stand:")
    groups: dict = {}
    for r in result.ranks.values():
        where = f"in {r.call}" if r.call else "in no call"
        python = r.python or "not known (no stacks on a signal here)"
        groups.setdefault((where, python), []).append(r.rank)
    for (where, python), ranks in sorted(groups.items(), key=lambda g: len(g[1])):
        lines.append(f"  {ranks_text(ranks, limit)}: {where}")
        lines.append(f"    Python at {python}")
    return "\n".join(lines)


def as_json(result: Status) -> dict:
    fewest, waited_for = lagging(result)
    return {
        "job": result.job,
        "size": result.size,
        "asked": result.asked,
        "took_s": result.took_s,
        "moved": result.moved,
        "missing": result.missing,
        "fewest_calls": fewest,
        "waited_for": waited_for,
        "ranks": [asdict(r) for _, r in sorted(result.ranks.items())],
    }
