"""The fault settings every rank of a job must agree on: rank 0's rule.

The collective timeout, the hang timeout and the checks (whose watchdog finds
ranks that wait in calls that cannot match) decide whether a rank makes the
watchdog's communicators, collective ``Dup`` s, and the timeline whether it
measures its clock against rank 0's: every rank must decide alike, so every rank
takes rank 0's values. They travel packed in the bootstrap's one
broadcast (mpi4jax_dist/launch/wire.py), which carries them without reading them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .. import _config

# Each timeout as float64 seconds, 0 for off, the checks and the timeline as a
# byte each, in this machine's byte order (every rank of a job runs on the same
# kind of machine).
_PACKED = struct.Struct("=2d??")


@dataclass(frozen=True)
class JobSettings:
    """The settings a job's ranks agree on.

    Attributes:
        collective_timeout_s: ``MPI4JAX_DIST_COLLECTIVE_TIMEOUT`` (None: off).
        hang_timeout_s: ``MPI4JAX_DIST_HANG_TIMEOUT`` (None: off).
        checks: ``MPI4JAX_DIST_CHECKS``: with them, the watchdog also ends a job
            whose ranks all wait in calls that cannot match (standstill.py).
        timeline: whether ``MPI4JAX_DIST_TIMELINE`` is set (each rank writes to
            its own value of it: mpi4jax_dist/timing/timeline.py).
    """

    collective_timeout_s: float | None = None
    hang_timeout_s: float | None = None
    checks: bool = True
    timeline: bool = False

    def pack(self) -> bytes:
        """Return the settings as bytes for :meth:`unpack` on another rank."""
        return _PACKED.pack(
            self.collective_timeout_s or 0.0,
            self.hang_timeout_s or 0.0,
            self.checks,
            self.timeline,
        )

    @classmethod
    def unpack(cls, data: bytes) -> JobSettings:
        """Return the settings :meth:`pack` gave (on rank 0)."""
        collective, hang, checks, timeline = _PACKED.unpack(data[: _PACKED.size])
        return cls(collective or None, hang or None, checks, timeline)

    @property
    def watchdog(self) -> bool:
        """Whether these settings ask for the watchdog thread."""
        return bool(self.collective_timeout_s or self.hang_timeout_s or self.checks)


def this_process() -> tuple[JobSettings, str | None]:
    """Return this process's settings and the first error among them, or None.

    A bad value is left off (None) and its error returned: rank 0's ends the job on
    every rank; another rank's value is never used.
    """
    values, error = {}, None
    for name, read in (
        ("collective_timeout_s", _config.collective_timeout),
        ("hang_timeout_s", _config.hang_timeout),
        ("checks", _config.checks),
    ):
        try:
            values[name] = read()
        except ValueError as err:
            error = error or str(err)
    values["timeline"] = _config.timeline_dir() is not None
    return JobSettings(**values), error
