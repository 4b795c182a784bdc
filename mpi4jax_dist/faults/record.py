"""What runs, as a timeout's report names it: the extension modules the compiled
ops loaded, the communicators they were given, and other records of the calls this
process is in (XLA's collectives over MPI). Reading them waits on no other rank."""

from __future__ import annotations

import threading
import zlib
from typing import NamedTuple

_lock = threading.Lock()
# The extension modules loaded (_ffi's CPU and CUDA ones), as configured.
_modules: list = []
# The communicators the compiled ops know (mpi4jax_dist.ops.common.Comm), in
# order of registration.
_comms: list = []
# Other records of the calls this process is in: (in_flight, C reader) pairs
# (JAX's collectives over MPI, mpi4jax_dist.xla_mpi.record()).
_records: list = []


def add_module(module) -> bool:
    """Note an extension module the compiled ops loaded; False if already noted."""
    with _lock:
        if module in _modules:
            return False
        _modules.append(module)
        return True


def modules() -> list:
    """The extension modules ``_ffi`` has loaded, in order."""
    with _lock:
        return list(_modules)


def _core():
    """A loaded extension module to read the record through, or None: every
    module reads the same one, the core's (``_core``, one a process)."""
    with _lock:
        return _modules[0] if _modules else None


def note_comm(comm) -> None:
    """Remember a communicator the compiled ops were given (an ``ops.common.Comm``),
    so that a timeout's report can name it and find its count on every rank."""
    with _lock:
        _comms.append(comm)


def _noted_comms() -> list:
    with _lock:
        return list(_comms)


def add_record(in_flight) -> None:
    """Quote another record's ``in_flight()`` text in :func:`calls_in_flight`."""
    with _lock:
        _records.append(in_flight)


def calls_in_flight() -> str:
    """The collectives this process is in (entered, not yet returned), as the
    records say: the package's (``allreduce #5 SUM float32[4] on communicator
    'MPI_COMM_WORLD' (2 ranks) at step.py:12 in body``, :meth:`Call.text`) and
    XLA's over MPI (``XLA's MPI_Allreduce #3 SUM float32[4] on 2 ranks``), several
    joined by ``; ``; "" when none. Calls on different communicators read apart,
    unnamed ones included (by their key), so that ranks in them stand apart."""
    with _lock:
        others = list(_records)
    texts = [c.text() for c in calls()] + [in_flight() for in_flight in others]
    return "; ".join(filter(None, texts))


def place_text() -> str:
    """What the hang timeout's verdicts compare of the calls this rank is in:
    :func:`calls_in_flight` and each call's communicator key and number."""
    keys = ",".join(f"{c.comm_key:x}#{c.seq}" for c in calls())
    if any(c.setting_up for c in calls()):
        # A first call's key names the group alone, alike for every communicator
        # of it: ranks in such calls stand apart (none waits ten minutes for a
        # set-up every member has entered).
        from mpi4py import MPI

        keys += f"\nrank {MPI.COMM_WORLD.Get_rank()}"
    return f"{calls_in_flight()}\n{keys}"


class Call(NamedTuple):
    """A collective this process is in, as every rank can compare it: its
    communicator's key (alike on every member: odd once the first call there has
    made its private duplicates, before that even, its group's alone) and size, its
    number there, what it reduces and where it was made; ``waiting``: in its wait
    (False for a non-blocking start whose wait is not yet entered). ``comm`` names
    the communicator for a report."""

    comm_key: int
    comm: str
    size: int
    seq: int
    kind: str
    op: str
    dtype: str
    count: int
    site: str
    waiting: bool

    @property
    def setting_up(self) -> bool:
        """Whether this is a first call on its communicator still making its
        private duplicates (its key then names the group alone)."""
        return not self.comm_key & 1

    def same_as(self) -> tuple:
        """What must be alike on every member for MPI to complete the call."""
        return (self.comm_key, self.seq, self.kind, self.op, self.dtype, self.count)

    def text(self) -> str:
        """``allreduce #5 SUM float32[4] on communicator 'X' (2 ranks) at ...``;
        an unnamed communicator as ``a communicator (2 ranks, key 5e1a03)``,
        alike on its members."""
        text = f"{self.kind} #{self.seq} {self.op} {self.dtype}[{self.count}]"
        comm = self.comm
        if comm.startswith("a communicator (") and not self.setting_up:
            comm = f"{comm[:-1]}, key {self.comm_key & 0xFFFFFF:06x})"
        text += f" on {comm}" if comm else ""
        text += f" at {self.site}" if self.site else ""
        if self.setting_up:
            # Until then communicators of one group read alike, on every rank.
            text += " (the first there: making its duplicates)"
        return text if self.waiting else text + " (started, not waited for)"


def calls() -> list[Call]:
    """The package's collectives this process is in (entered, not yet returned),
    oldest first, from the record the loaded extensions share."""
    module = _core()
    return [] if module is None else [Call(*entry) for entry in module.calls()]


def events() -> int:
    """The calls entered, waited for and ended so far in this process: what the
    watchdog counts as the collectives making progress."""
    module = _core()
    return 0 if module is None else module.record_events()[0]


def reported_elsewhere(exc: BaseException) -> bool:
    """Whether ``exc`` is the error of a call the ranks disagreed on whose report
    another rank prints for the job (the communicator's rank 0): every rank
    raises the same report, and one copy in the log is enough."""
    text = str(exc)
    for module in modules():
        last = module.disagreement()
        if last is not None and last[1] in text:
            return not last[0]
    return False


# --- communicators as every rank can name them -------------------------------------


def local_alarm(world_size: int) -> dict | None:
    """This process's first timed-out call (from any loaded extension), as the
    message for rank 0, or None."""
    for module in modules():
        alarm = module.alarm()
        if alarm is None:
            continue
        who, comm_id, call, waited_s = alarm
        comm = _comm_of(comm_id)
        group = group_of(comm, world_size) if comm is not None else None
        return {
            "kind": "alarm",
            "who": who,
            "call": call,
            "waited_s": waited_s,
            "group": group,
            "comm": _describe(comm),
        }
    return None


def _comm_of(comm_id: int):
    """The noted communicator of the core's id ``comm_id``, or None."""
    for comm in _noted_comms():
        if comm.key == comm_id:
            return comm
    return None


def _crc(ranks: list[int]) -> int:
    return zlib.crc32(b"".join(r.to_bytes(4, "little") for r in ranks))


def group_of(comm, world_size: int) -> tuple:
    """A communicator as every rank can name it: (CRC of its group's world ranks,
    its size, its place among the noted communicators of that group, and the
    ranks themselves where they are not the whole world)."""
    ranks = _world_ranks(comm.comm)
    same = [c for c in _noted_comms() if c.comm.Get_size() == len(ranks)]
    place = 0
    for other in same:
        if other is comm:
            break
        if _world_ranks(other.comm) == ranks:
            place += 1
    return (_crc(ranks), len(ranks), place, ranks if len(ranks) < world_size else None)


def _world_ranks(comm) -> list[int]:
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in group.Translate_ranks(None, world)]
    finally:
        group.Free()
        world.Free()


def count_of(group) -> int | None:
    """This rank's count of calls entered on the communicator ``group`` names (0
    where it has none, or never called on it; None when the alarm named none)."""
    if group is None:
        return None
    crc, size, place = group[:3]
    matches = []
    for comm in _noted_comms():
        try:
            ranks = _world_ranks(comm.comm)
        except Exception:  # freed since
            continue
        if len(ranks) == size and _crc(ranks) == crc:
            matches.append(comm)
    if place >= len(matches):
        return 0
    module = _core()
    counts = [] if module is None else module.call_counts()
    comm_id = matches[place].key
    return counts[comm_id - 1] if 0 < comm_id <= len(counts) else 0


def _describe(comm) -> str:
    if comm is None:
        return "a communicator"
    name = comm.comm.Get_name()
    size = comm.comm.Get_size()
    return (
        f"communicator {name!r} ({size} ranks)"
        if name
        else (f"a communicator of {size} ranks")
    )
