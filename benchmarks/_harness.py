"""One harness for every benchmark here: what they register, time, print and save.

Every benchmark in this folder is built from the same parts, as mpi4py's ``bench.py``
and the OSU micro-benchmarks are: a :class:`Registry` of what is compared; one
timing loop, :func:`time_rounds` (round-robin over the cases, a barrier before each,
the slowest rank counts) with :func:`fit_trips`, :func:`summary` and
:class:`Compiles`; a :class:`Table`; provenance, :func:`meta`; ``--json`` (and
``--plot``) written by :func:`save`; jobs a parent starts and reads,
:func:`run_job`; and what a job that measures memory reads (:func:`rss_bytes` ...).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# --- Registry -------------------------------------------------------------------------


class Registry:
    """Named records of one kind, in registration order (``@IMPLS.register("mpi4py")``
    on a class adds it)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._records: dict[str, object] = {}

    def register(self, name: str, record=None):
        """Add ``record`` under ``name``; without a record, return a decorator."""
        if record is None:
            return lambda r: self.register(name, r)
        if name in self._records:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._records[name] = record
        return record

    def names(self) -> list[str]:
        return list(self._records)

    def __getitem__(self, name: str):
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(
                f"no {self.kind} {name!r}; choose from {', '.join(self._records)}"
            ) from None

    def choose(self, text: str, option: str) -> list[str]:
        """Return the names in comma-separated ``text``; ``ValueError`` naming
        ``option`` for an unknown one."""
        chosen = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in chosen if t not in self._records]
        if unknown or not chosen:
            raise ValueError(
                f"{option} {text!r}: unknown {', '.join(map(repr, unknown))}; "
                f"choose from {', '.join(self._records)}"
            )
        return chosen

    def option(self, parser, flag: str, default=None, help: str = "") -> None:
        """Add ``flag`` to ``parser``: comma-separated names of this registry
        (``default``, else all of them), a list after parsing (:meth:`choose`)."""

        def names(text: str) -> list[str]:
            try:
                return self.choose(text, flag)
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None

        parser.add_argument(
            flag,
            type=names,
            default=",".join(default or self.names()),
            help=f"comma-separated, from {', '.join(self.names())}{help}",
        )


# --- Timing ---------------------------------------------------------------------------


def block(output):
    """Return ``output`` once it is computed (JAX arrays are asynchronous)."""
    jax = sys.modules.get("jax")
    return output if jax is None else jax.block_until_ready(output)


def time_rounds(
    cases: Sequence[Callable[[], object]],
    comm,
    samples: int,
    warmup: int = 1,
    outputs: list | None = None,
) -> list[list[float]]:
    """Time every case (a callable, its output waited for) ``samples`` times,
    round-robin after ``warmup`` untimed runs, a barrier of ``comm`` before each;
    return per case, per round, the slowest rank's seconds (``outputs`` gets each
    case's last output). Every rank calls it."""
    from mpi4py import MPI

    last = [None] * len(cases)
    for index, case in enumerate(cases):
        for _ in range(warmup):
            last[index] = block(case())
    local = np.zeros((len(cases), samples))
    for round_ in range(samples):
        for index, case in enumerate(cases):
            comm.Barrier()
            start = time.perf_counter()
            last[index] = block(case())
            local[index, round_] = time.perf_counter() - start
    if outputs is not None:
        outputs[:] = last
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    return slowest.tolist()


@dataclass(frozen=True)
class LoopFit:
    """What :func:`fit_trips` finds: ``per_trip``, per sample its time less the
    fixed part over its trips; ``fixed`` (seconds), where the samples resolve it,
    else None; ``fixed_at_most``, where they do not, the most it can be."""

    per_trip: list[float]
    fixed: float | None
    fixed_at_most: float | None = None


def fit_trips(times: dict[int, Sequence[float]], dispatched: bool = True) -> LoopFit:
    """Split timed loops into the time per trip and the fixed part, robustly.

    ``times[k]`` are samples of one loop run with ``k`` trips, each ``fixed + k *
    trip + noise``; the fixed part is the median intercept of the lines through
    every pair of samples of two trip counts (as Theil–Sen fits), resolved where
    their lower quartile is above 0 and their median below the fastest sample, else
    bounded (docs/benchmarks.rst, *The allreduce*, gives the rule).

    Args:
        times: samples (seconds) per trip count; two trip counts or more.
        dispatched: False for a loop without a fixed part (a Python loop of MPI
            calls): its fixed part is taken as none, not fitted.
    """
    counts = sorted(times)
    if len(counts) < 2 or counts[0] < 1:
        raise ValueError(f"trip counts {counts}: need two or more, each at least 1")
    fixed = at_most = None
    subtract = 0.0
    if dispatched:
        intercepts = [
            a - ka * (b - a) / (kb - ka)
            for i, ka in enumerate(counts)
            for kb in counts[i + 1 :]
            for a in times[ka]
            for b in times[kb]
        ]
        if len(intercepts) > 1:
            low, middle, high = statistics.quantiles(
                intercepts, n=4, method="inclusive"
            )
        else:  # one sample per trip count: an estimate, never a resolved one
            low, middle, high = -math.inf, intercepts[0], intercepts[0]
        fastest = min(min(times[k]) for k in counts)
        plausible = middle < fastest  # else the samples contradict the line
        if plausible:
            subtract = max(middle, 0.0)
        if low > 0 and plausible:
            fixed = middle
        else:
            at_most = min(max(high, 0.0), fastest)
    per_trip = [(t - subtract) / k for k in counts for t in times[k]]
    return LoopFit(per_trip, fixed, at_most)


# A row whose quartiles lie further apart than this, relative to its median, is
# marked wide: its median is not to be read closer than about a factor of 1.5.
WIDE = 0.25


class Compiles:
    """Count XLA compilations while in a ``with`` block (JAX's own monitoring
    event), so that a figure can show that no compilation ran inside it."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.names: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def _listen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.names.append(str(kwargs.get("fun_name", "?")))

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        from mpi4jax_dist import _compat

        _compat.unregister_event_duration_listener(self._listen)
        return False


def summary(samples: Iterable[float], prefix: str = "t") -> dict:
    """Return min, quartiles, mean, standard deviation and max of ``samples`` as
    ``{prefix}_min_s``, ``{prefix}_q1_s``, ... (seconds), ``{prefix}_spread`` (half
    the quartiles' distance over the median) and ``{prefix}_wide`` (above
    :data:`WIDE`)."""
    values = list(samples)
    median = statistics.median(values)
    if len(values) > 1:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = median
    spread = (q3 - q1) / (2 * median) if median > 0 else None
    return {
        f"{prefix}_min_s": min(values),
        f"{prefix}_q1_s": q1,
        f"{prefix}_median_s": median,
        f"{prefix}_q3_s": q3,
        f"{prefix}_mean_s": statistics.fmean(values),
        f"{prefix}_stddev_s": statistics.stdev(values) if len(values) > 1 else 0.0,
        f"{prefix}_max_s": max(values),
        f"{prefix}_spread": spread,
        f"{prefix}_wide": spread is None or spread > WIDE,
    }


def steps_for(nbytes: int, most: int) -> int:
    """Return how many collectives one timed unit holds: ``most`` for small
    messages, fewer for large ones (about 16 MiB moved per unit), at least 3."""
    return max(3, min(most, math.ceil(2**24 / max(nbytes, 1))))


# --- Sizes and units ------------------------------------------------------------------


# Longest suffix first: "kib" before "b".
_UNITS = {
    "gib": 1024**3,
    "mib": 1024**2,
    "kib": 1024,
    "gb": 1000**3,
    "mb": 1000**2,
    "kb": 1000,
    "b": 1,
}


def parse_sizes(text: str) -> list[int]:
    """Return sizes in bytes from ``4,4096,16KiB,1MiB,2GiB``; ``ValueError`` names
    a bad item."""
    sizes = []
    for raw in text.split(","):
        item, factor = raw.strip().lower(), 1
        for unit, scale in _UNITS.items():
            if item.endswith(unit):
                item, factor = item[: -len(unit)].strip(), scale
                break
        if not item.isdigit():
            raise ValueError(
                f"--sizes: {raw.strip()!r} is not a size such as 4096 or 1MiB"
            )
        sizes.append(int(item) * factor)
    return sizes


def ints(text: str) -> list[int]:
    """An argparse type: the integers of ``64,256,1024``."""
    return [int(t) for t in text.split(",") if t.strip()]


def floats(text: str) -> list[float]:
    """An argparse type: the numbers of ``0,20,50.5``."""
    return [float(t) for t in text.split(",") if t.strip()]


def human_bytes(n: int) -> str:
    """Return ``n`` bytes as ``4 B``, ``16 KiB``, ``64 MiB``, ``2 GiB``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.4g} {unit}"


# --- Tables ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column: result key, title, unit, width and ``fmt`` (a format spec or a
    callable; ``scale`` multiplies numbers first; ``None`` prints ``-``); ``text``
    makes the cell from the whole row instead."""

    key: str
    title: str
    unit: str = ""
    width: int = 9
    fmt: str | Callable = ""
    scale: float = 1.0
    left: bool = False
    text: Callable[[dict], str] | None = None

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if self.text is not None:
            text = self.text(row)
        elif value is None:
            text = "-"
        elif callable(self.fmt):
            text = self.fmt(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            text = format(value * self.scale if self.scale != 1 else value, self.fmt)
        else:
            text = str(value)
        return text.ljust(self.width) if self.left else text.rjust(self.width)


class Table:
    """Fixed-width rows under a two-line ``#`` header (titles, then units)."""

    def __init__(self, columns: Sequence[Column]):
        self.columns = list(columns)

    def _line(self, texts) -> str:
        return " ".join(
            t.ljust(c.width) if c.left else t.rjust(c.width)
            for c, t in zip(self.columns, texts, strict=True)
        )

    def header(self) -> str:
        return "# " + self._line(
            c.title for c in self.columns
        ) + "\n" "# " + self._line(c.unit for c in self.columns)

    def row(self, row: dict) -> str:
        return "  " + " ".join(c.cell(row) for c in self.columns)


def within(width: int, *lines: str) -> list[str]:
    """``lines`` with each ``#`` comment longer than ``width`` wrapped onto ``#``
    lines (the continuations indented); other lines as they are."""
    out = []
    for line in lines:
        if len(line) <= width or not line.startswith("# "):
            out.append(line)
            continue
        out += textwrap.wrap(
            line[2:],
            width,
            initial_indent="# ",
            subsequent_indent="#   ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return out


_results = None  # where say() prints inside results_on_stdout()


@contextlib.contextmanager
def float64_world():
    """Float64 JAX in ``mpi4jax_dist.initialize()``'s world, JAX on the CPU unless
    the caller chose; yields COMM_WORLD and restores x64 after (a test's ``main``
    call leaves the session as it was)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import mpi4jax_dist  # noqa: I001  (before jaxlib: MPI4JAX_DIST_CPU_COLLECTIVES)

    import jax
    from mpi4py import MPI

    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        mpi4jax_dist.initialize()
        yield MPI.COMM_WORLD
    finally:
        jax.config.update("jax_enable_x64", x64)


def say(comm, *lines: str, file=None) -> None:
    """Print ``lines`` on rank 0 only (flushed); every rank may call it."""
    if comm is None or comm.Get_rank() == 0:
        for line in lines:
            print(line, file=file or _results or sys.stdout, flush=True)


@contextlib.contextmanager
def results_on_stdout():
    """Keep standard output for what :func:`say` prints, and send what else is
    written to file descriptor 1 to standard error: jaxlib's Gloo prints ``[Gloo]
    Rank 0 is connected to 1 peer ranks`` there from C++, into the middle of a
    table (``python -m mpi4jax_dist --check`` does the same)."""
    global _results
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _results = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield
    finally:
        _results.close()
        _results = None
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# --- Provenance and output ------------------------------------------------------------


def commit() -> str | None:
    """Return the git commit of this checkout (with ``-dirty``), or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sha.stdout.strip() or None


#: The variables that set NumPy's and XLA's threads (``meta`` records them).
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "XLA_FLAGS",
)


def threads_line() -> str:
    """``# OMP_NUM_THREADS=1, ...``: the thread variables, for a header."""
    return "# " + ", ".join(
        f"{name}={os.environ.get(name, '(unset)')}" for name in THREAD_VARIABLES
    )


def meta(comm=None, **extra) -> dict:
    """Return provenance: machine, versions, commit, UTC time, thread variables
    and ``extra``; with ``comm`` (JAX initialized) also the MPI library, the world,
    JAX's backend, devices and CPU collectives."""
    from mpi4jax_dist import _mpi
    from mpi4jax_dist.diagnostics import check as diagnostics
    from mpi4jax_dist.faults import hangs

    info = {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "host": platform.node(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "versions": diagnostics.versions(),
        "threads": {name: os.environ.get(name) for name in THREAD_VARIABLES},
    }
    info["pages"] = pages()
    if comm is not None:
        import jax
        from mpi4py import MPI

        import mpi4jax_dist
        from mpi4jax_dist import _compat

        info.update(
            mpi_library=_mpi.mpi_library(),
            thread_level=_mpi.thread_level_name(MPI.Query_thread()),
            world_size=comm.Get_size(),
            num_nodes=mpi4jax_dist.topology().num_nodes,
            backend=jax.default_backend(),
            devices=[str(d) for d in jax.devices()],
            cpu_collectives=_compat.cpu_collectives(),
            on_hang=hangs.report(),
        )
    info.update(extra)
    return info


def hang_line(info: dict) -> str:
    """One header line: what ends this job should it hang, and how to change it."""
    hang = info["on_hang"]
    if hang["watchdog"] == "none":
        return "# on a hang: nothing ends the job (no watchdog in this job)"
    timeout = hang["hang_timeout_s"]
    line = "# on a hang: the job ends, named, " + (
        f"after {timeout:g} s without progress (MPI4JAX_DIST_HANG_TIMEOUT; 0: off)"
        if timeout
        else "no hang timeout (MPI4JAX_DIST_HANG_TIMEOUT=0)"
    )
    if hang["standstill"]:
        line += (
            "; within seconds where the ranks wait in calls that cannot match "
            "(MPI4JAX_DIST_CHECKS)"
        )
    return line


def pages() -> dict:
    """What pages large buffers get: the kernel's transparent huge page mode, and
    whether glibc's malloc asks for huge pages (``glibc.malloc.hugetlb`` in
    ``GLIBC_TUNABLES``): docs/benchmarks.rst, *The in-place allreduce and huge
    pages*."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        mode = None
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    malloc_huge = any(
        t.strip() in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2")
        for t in tunables.split(":")
    )
    return {"thp": mode, "malloc_hugetlb": malloc_huge}


def pages_line(info: dict) -> str:
    """One header line: whether XLA's buffers are on huge pages, as NumPy's."""
    p = info["pages"]
    if p["malloc_hugetlb"] or p["thp"] == "always":
        how = "GLIBC_TUNABLES" if p["malloc_hugetlb"] else "the kernel's THP mode"
        return f"# pages: XLA's buffers on huge pages ({how}), as NumPy's"
    return (
        f"# pages: XLA's buffers on 4 KiB pages, NumPy's on huge pages (THP mode "
        f"{p['thp']}): large sizes favour mpi4py by up to 1.25x; "
        "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 before mpiexec evens them"
    )


def import_mpi4jax_explained() -> str | None:
    """Import mpi4jax, where installed, with its warning about a JAX newer than it
    names caught; return one header line instead (None where it did not warn).
    Other warnings are passed on as they came."""
    import warnings

    import jax

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mpi4jax
    except ImportError:
        return None
    line = None
    for w in caught:
        if "latest supported JAX version" in str(w.message):
            line = (
                f"# mpi4jax {mpi4jax.__version__} names an older JAX than this "
                f"{jax.__version__}, on which this package's CI runs mpi4jax's calls "
                "and checks them; its warning is not repeated here "
                "(MPI4JAX_NO_WARN_JAX_VERSION=1 silences it)"
            )
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return line


def add_output_arguments(parser: argparse.ArgumentParser, plot: bool = False) -> None:
    """Add ``--json PATH`` and, for a script that draws, ``--plot PNG``, which
    :func:`save` honours."""
    parser.add_argument("--json", metavar="PATH", help="write meta and results here")
    if plot:
        parser.add_argument("--plot", metavar="PNG", help="draw the results here")


def parse_or_work(parser: argparse.ArgumentParser, argv, worker):
    """Add ``--json``/``--plot`` and the hidden ``--worker ARG`` that this script's
    own jobs are started with, and parse ``argv``. With ``--worker``, run
    ``worker(ARG)`` and return None (the caller returns); else the arguments."""
    add_output_arguments(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return None
    return args


def save(
    args, meta_: dict, results: list[dict], plot=None, comm=None, extra=None
) -> None:
    """Write ``--json`` and draw ``--plot`` (with ``plot(results, path)``) on rank 0;
    ``extra`` adds keys of its own to the JSON beside ``meta`` and ``results``."""
    if comm is not None and comm.Get_rank() != 0:
        return
    for path in (getattr(args, "json", None), getattr(args, "plot", None)):
        if path:  # --json results/x.json works in a fresh clone
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump({"meta": meta_, "results": results, **(extra or {})}, f, indent=1)
    if getattr(args, "plot", None) and plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        plot(results, args.plot)


# --- Jobs started by a parent process -------------------------------------------------

RESULT = "RESULT "


def report(**fields) -> None:
    """Print one ``RESULT {json}`` line (a job's answer to :func:`run_job`)."""
    sys.stdout.write(RESULT + json.dumps(fields) + "\n")
    sys.stdout.flush()


def find_mpiexec() -> str:
    """Return the mpiexec beside this Python (a venv's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec")
    if found is None:
        sys.exit("no mpiexec beside this Python nor on PATH (run tools/setup.sh)")
    return found


@dataclass
class JobResult:
    """What a job started by :func:`run_job` gave: its exit status (None when it
    was killed at its time limit), its ``RESULT`` lines, its output, and how long it
    ran."""

    returncode: int | None
    results: list[dict]
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def tail(self) -> str:
        """The end of the output, for a row that reports a failure."""
        return (self.stdout + self.stderr)[-3000:]


def run_job(
    procs: int,
    argv: Sequence[str],
    *,
    timeout: float,
    env: dict | None = None,
    mpiexec: str | None = None,
) -> JobResult:
    """Run ``mpiexec -n procs python *argv`` (``python *argv`` alone where
    ``procs`` is 0) with a time limit; never raises for the job's own failure (a
    crash or a timeout is reported in the result)."""
    cmd = [sys.executable, *argv]
    if procs:
        cmd = [mpiexec or find_mpiexec(), "-n", str(procs), *cmd]
    environment = dict(os.environ if env is None else env)
    environment.setdefault("JAX_PLATFORMS", "cpu")
    # Its own process group, so that a timeout ends mpiexec, its proxies and the
    # ranks together (killing mpiexec alone leaves the proxies as orphans).
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
        seconds = time.perf_counter() - start
    except subprocess.TimeoutExpired:
        seconds = time.perf_counter() - start
        _end_group(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a rank left its own group: give up
            out, err = "", ""
        code = None
        err = _text(err) + f"\n(killed after {timeout:g} s)"
    results = [
        json.loads(line[len(RESULT) :])
        for line in out.splitlines()
        if line.startswith(RESULT)
    ]
    return JobResult(code, results, _text(out), _text(err), seconds)


def not_under_mpiexec(script: str) -> None:
    """Exit with a sentence where ``script``, which starts its own jobs, was
    started under ``mpiexec``."""
    from mpi4jax_dist.launch import detect

    if detect.detect(os.environ) is not None:
        sys.exit(
            f"{script} starts its own mpiexec jobs: run it as `python "
            f"benchmarks/{script}`, not under mpiexec"
        )


def case_result(job: JobResult, row: dict, timeout: float) -> dict | None:
    """A one-case job's answer, its last ``RESULT``; or None, with ``row``'s
    ``status`` (timed out, or crashed with the signal) and the output's ``tail``."""
    if job.returncode is None:
        row["status"] = f"timed out ({timeout:g} s)"
    elif not job.ok or not job.results:
        row["status"] = crash_status(job.returncode, job.tail)
    else:
        return job.results[-1]
    row["tail"] = job.tail
    return None


def crash_status(returncode: int, output: str = "") -> str:
    """Return ``crashed (1)``, or with the signal that ended a rank:
    ``crashed (11, SIGSEGV)``. The signal is Python's ``-N``, else the last
    ``signal N`` of the job's output (MPICH's mpiexec exits with N and prints
    "(signal N)", Open MPI's "exited on signal N"), else mpiexec's 128 + N."""
    import re
    import signal

    found = re.findall(r"signal:? (\d+)", output, flags=re.IGNORECASE)
    if returncode < 0:
        number = -returncode
    elif found:
        number = int(found[-1])
    else:
        number = returncode - 128
    try:
        return f"crashed ({returncode}, {signal.Signals(number).name})"
    except ValueError:
        return f"crashed ({returncode})"


def _end_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End mpiexec ``proc`` and its process group: SIGTERM to mpiexec (it passes
    the signal on and reaps its proxies and ranks), then after ``grace`` seconds
    SIGKILL to whatever of the group is left."""
    import signal

    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# --- Memory ---------------------------------------------------------------------------

# glibc: blocks from 128 KiB up get their own mapping, returned when freed (the
# default is also 128 KiB, but it then rises with every large block freed).
MMAP_THRESHOLD = "131072"


def rss_bytes() -> tuple[int, int]:
    """Return ``(current, peak)`` resident set size of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) on Linux; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def settle(most: float = 2.0) -> None:
    """Wait until the set-up's memory is freed (garbage collected, JAX's work done,
    RSS unchanged over 20 ms; at most ``most`` seconds): memory freed during the
    call would offset what it allocates (psum's rise at 64 MiB once read 2 MiB)."""
    import jax

    gc.collect()
    jax.effects_barrier()
    deadline = time.monotonic() + most
    last = rss_bytes()[0]
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = rss_bytes()[0]
        if now == last:
            return
        last = now


def memory_job_env() -> dict:
    """Return the environment of jobs that measure memory: ours, with glibc's mmap
    threshold fixed (benchmarks/memory.py says why). :func:`run_job` puts JAX on
    the CPU unless the caller chose."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
