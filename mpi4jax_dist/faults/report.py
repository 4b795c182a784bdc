"""The text of a timeout's report: the one line of a collective timeout (who had not
entered the call), and the hang timeout's, the ranks grouped by where they stand;
and each rank's part of it (its place, its calls, where its stacks went)."""

from __future__ import annotations

import functools
import logging

from .. import _config
from . import progress, record, stacks
from .record import calls_in_flight
from .stacks import ranks_text
from .standstill import SETUP_S

logger = logging.getLogger("mpi4jax_dist")

# How long rank 0 waits for every rank's stacks and count, once it asked.
REPLY_S = 10.0


def standing(watched: progress.Progress, exited: bool = False) -> dict:
    """Where this rank's main thread stands, for rank 0's report: its frames,
    innermost first, and their source lines as they read now, and the calls the
    record says it is in; or that it has reached its exit."""
    if exited:
        return {"place": [], "source": [], "call": "", "exited": True}
    place = watched.place()
    return {
        "place": [tuple(f) for f in place],
        "source": stacks.quote(place),
        "call": calls_in_flight(),
        # A first call still making its communicator's duplicates reads alike on
        # every communicator of one group: such a rank stands apart.
        "apart": any(c.setting_up and c.waiting for c in record.calls()),
    }


@functools.cache
def say_one_long_step(hang_timeout_s: float) -> None:
    """Rank 0, once: every rank stuck at one place is one long step, not a hang."""
    logger.info(
        "mpi4jax_dist: every rank has stood at one place for %g s or more: one "
        "long step, not taken for a hang (%s).",
        hang_timeout_s,
        _config.HANG_TIMEOUT,
    )


def held_reply(text: str) -> dict:
    """A reply of a rank's ``_stacks`` thread (where its stacks went, a newline,
    the calls its record says it is in, a newline, the dump) as a watchdog's: its
    main thread's stack for its place (and where that stands, as text), the
    calls, no count."""
    went, _, rest = text.partition("\n")
    calls, _, dump_text = rest.partition("\n")
    _, _, threads = stacks.parse_stacks(dump_text)
    place = threads.get("main", [])
    sources = threads["source"]
    return {
        "count": None,
        "held": True,
        "where": went,
        "call": calls,
        "place": [tuple(f) for f in place],
        "source": [sources.get((f.file, f.line), "") for f in place],
        "stands": stacks.where(place, sources),  # as the reports say it
    }


def hang_report(
    replies: dict,
    size: int,
    stuck_s: float,
    where: set,
    silent_why: str = "stopped, or its MPI stuck",
    waited_s: float = 0.0,
) -> str:
    """The hang timeout's report: one line per place the ranks stand at, the odd
    ones out first, then the ranks that did not answer (``silent_why``: why a rank
    may not, after ``REPLY_S`` and ``waited_s`` more) and where the stacks are."""
    groups: dict = {}
    sources: dict = {}
    exited = sorted(r for r, reply in replies.items() if reply.get("exited"))
    for rank, reply in sorted(replies.items()):
        if reply.get("exited"):
            continue
        frames = tuple(stacks.Frame(*f) for f in reply["place"])
        call = reply.get("call", "")
        if reply.get("apart"):  # the groups' lines tell such ranks apart by rank
            call += "\0" + str(rank)
        groups.setdefault((frames, call), []).append(rank)
        for frame, text in zip(frames, reply["source"], strict=True):
            if text:
                sources.setdefault((frame.file, frame.line), text)
    # The verdict found them at different places; the stacks come after it.
    apart = len(groups) > 1 or bool(exited) or len(replies) < size
    lines = [
        (
            f"mpi4jax_dist: no rank of {size} made progress for {stuck_s:.3g} s "
            f"({_config.HANG_TIMEOUT}), and they do not all stand at one place: the "
            f"job is hung. Where the ranks stand, the odd ones out first:"
            if apart
            else f"mpi4jax_dist: no rank of {size} made progress for {stuck_s:.3g} s "
            f"({_config.HANG_TIMEOUT}) and they stood at different places when that "
            f"was found; asked for their stacks, they stand at one place: the job is "
            f"hung there. Where the ranks stand:"
        )
    ]
    silent = [r for r in range(size) if r not in replies]
    if silent:
        lines.append(
            f"  no answer from {ranks_text(silent)} in {REPLY_S + waited_s:g} s "
            f"({silent_why}): where it stands is unknown"
        )
    if exited:
        lines.append(
            f"  {ranks_text(exited)} reached {'its' if len(exited) == 1 else 'their'} "
            f"exit (the end of the program, or sys.exit): in no collective, waiting "
            f"at exit for the others"
        )
    held = sorted(r for r, reply in replies.items() if reply.get("held"))
    if held:
        lines.append(
            f"  {ranks_text(held)} answered from C only (a thread holds the GIL): "
            f"placed below by the stacks written then"
        )
    lines += [
        "  " + line
        for line in stacks.group_lines(groups, sources, odd_first=True, by_call=True)
    ]
    whose = "The stacks of the ranks that answered" if silent else "Every rank's stacks"
    if went := stacks_went(where):
        lines.append(f"{whose}: {went}.")
    return "\n".join(lines) + "\nMPI_Abort ends the job."


def standstill_report(
    calls: dict, replies: dict, size: int, still_s: float, where: set
) -> str:
    """The report of a standstill (:mod:`~mpi4jax_dist.faults.standstill`): what
    each rank waits in (``calls``: rank -> {"calls": [record.Call], "exited"}),
    the odd ones out first, how many members of each call's communicator are in
    it, where each rank's main thread stands (``replies``, as for
    :func:`hang_report`) and where the stacks went."""
    groups: dict = {}
    waited: dict = {}  # (communicator, number) -> {call: [ranks]}
    for rank in range(size):
        reply = calls.get(rank, {})
        if reply.get("exited"):
            what = "reached the exit (the end of the program, or sys.exit)"
        else:
            mine = [c for c in reply.get("calls", ()) if c.waiting]
            what = "in " + "; ".join(c.text() for c in mine)
            for call in mine:
                at = waited.setdefault((call.comm_key, call.seq), {})
                at.setdefault(call, []).append(rank)
            started = [c.text() for c in reply.get("calls", ()) if not c.waiting]
            if started:
                what += " (and holding " + "; ".join(started) + ")"
        groups.setdefault(what, []).append(rank)
    lines = [
        f"mpi4jax_dist: every rank of {size} waits in a collective that cannot "
        f"complete, or has reached its exit, with no progress for {still_s:g} s "
        f"or more: the ranks' calls do not match, so MPI never completes them "
        f"({_config.CHECKS}). Where each rank waits, the odd ones out first:"
    ]
    for what, ranks in sorted(groups.items(), key=lambda g: (len(g[1]), min(g[1]))):
        lines.append(f"  {ranks_text(ranks)}: {what}")
    for at in waited.values():
        lines.append("  " + _why_not(at))
    standing = {r: reply for r, reply in replies.items() if not reply.get("exited")}
    if standing:
        lines.append("Where their main threads stand:")
        groups, sources = _stack_groups(standing)
        lines += [
            "  " + line for line in stacks.group_lines(groups, sources, odd_first=True)
        ]
    if went := stacks_went(where):
        lines.append(f"Every rank's stacks: {went}.")
    return "\n".join(lines) + "\nMPI_Abort ends the job."


def _why_not(at: dict) -> str:
    """Why MPI never completes the calls some ranks wait in under one number on
    one communicator (``at``: {call: [ranks]})."""
    call = next(iter(at))
    where_ = f"{call.comm or 'a communicator'}, call #{call.seq}"
    if call.setting_up:
        return (
            f"{where_}: a first call, its communicator's private duplicates not "
            f"made in {SETUP_S:g} s, which take milliseconds once every member has "
            f"entered: the ranks in it are on different communicators of one group, "
            f"or the others are elsewhere (above)"
        )
    if len(at) > 1:
        return (
            f"{where_}: its ranks wait in {len(at)} different calls (above), which "
            f"MPI cannot match"
        )
    n = len(at[call])
    return (
        f"{where_}: {n} of its {call.size} ranks wait{'s' if n == 1 else ''} in it; "
        f"the others are not in it (above)"
    )


def _stack_groups(replies: dict) -> tuple[dict, dict]:
    """Ranks by their main thread's stack ({frames: [ranks]}) and the source
    lines the replies quote ({(file, line): text})."""
    groups: dict = {}
    sources: dict = {}
    for rank, reply in sorted(replies.items()):
        frames = tuple(stacks.Frame(*f) for f in reply["place"])
        groups.setdefault(frames, []).append(rank)
        for frame, text in zip(frames, reply["source"], strict=True):
            if text:
                sources.setdefault((frame.file, frame.line), text)
    return groups, sources


def stacks_went(where: set) -> str | None:
    """Where the ranks wrote their stacks, for a report: ``on stderr, as [rank N]
    lines`` or ``in DIR (python -m mpi4jax_dist --hangs DIR)``."""
    places = sorted(w for w in where if w)
    if places == ["stderr"]:
        return "on stderr, as [rank N] lines"
    shown = [p for p in places if p != "stderr"]
    if not shown:
        return None
    return f"in {', '.join(shown)} (python -m mpi4jax_dist --hangs {shown[0]})"


def report_line(alarm: dict, replies: dict, size: int, where: set) -> str:
    """The one line of a timeout: the call, its communicator, the ranks that had not
    entered it, those that answered from C only, and those that did not answer."""
    group = alarm.get("group")
    members = range(size) if group is None or group[3] is None else group[3]
    call = alarm["call"]
    counts = {r: reply["count"] for r, reply in replies.items()}
    missing = [r for r in members if counts.get(r) is not None and counts[r] < call]
    exited = [r for r in missing if replies[r].get("exited")]
    held = sorted(r for r, reply in replies.items() if reply.get("held"))
    silent = [r for r in range(size) if r not in replies]
    line = (
        f"mpi4jax_dist: rank {alarm['rank']} of {size} waited "
        f"{alarm['waited_s']:.3g} s in {alarm['who']}, call {call} on "
        f"{alarm['comm']} ({_config.COLLECTIVE_TIMEOUT}); "
    )
    if missing:
        last = sorted({counts[r] for r in missing})
        line += (
            f"not entered by {ranks_text(missing)} (their last call there: "
            f"{', '.join(str(c) for c in last[:5])})"
        )
        if exited:
            whose = "its" if len(exited) == 1 else "their"
            line += f", of which {ranks_text(exited)} reached {whose} exit"
    elif held or silent:
        line += "entered by every rank that could say"
    else:
        line += "every rank had entered it"
    if held:
        line += (
            f"; {ranks_text(held)} answered from C only (a thread holds the GIL), "
            f"so whether each entered is unknown: rank {held[0]} stands "
            f"{replies[held[0]]['stands']}"
        )
    if silent:
        line += (
            f"; no answer from {ranks_text(silent)} in {REPLY_S:g} s (stopped, or "
            f"its MPI stuck)"
        )
    if went := stacks_went(where):
        line += f"; every rank's stacks: {went}"
    return line + ". MPI_Abort ends the job."
