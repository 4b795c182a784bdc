"""Peak memory of one allreduce, per implementation and size, each in its own job.

    python benchmarks/memory.py [--procs 2] [--sizes 1MiB,16MiB,64MiB]
        [--impls mpi4py,mpi4jax,...] [--order default|reversed|shuffled]
        [--dtype float32] [--timeout 120] [--warm] [--malloc-default]
        [--json PATH] [--plot PNG]

Run it without ``mpiexec``: for every (implementation, size) case it starts a fresh
``mpiexec -n P`` job (``_harness.run_job``), so that no figure depends on what ran
before it in the same process (allocator reuse made the old in-process figures
change with the order: mpi4py at 1 MiB was 5.0 messages in one order and 1.0 in the
other). ``--order`` runs the cases in another order to show that the figures do not
move. In the job, every rank:

1. builds the implementation from benchmarks/allreduce.py's ``IMPLS`` (JAX ones
   compile ahead of time) and loads its checked input (``allreduce.pattern``);
2. lets the set-up settle (``gc.collect()``, JAX's pending work done, RSS still
   for 20 ms), resets the peak RSS (VmHWM); baseline = current RSS;
3. runs one allreduce, ``call()``: the input held, a result produced;
4. peak = VmHWM; reports ``(peak - baseline) / message bytes``, the time of that
   call, the XLA compilations during it (none: the executables were compiled in
   step 1) and whether the result is exactly ``S(i)``.

A row shows the largest rise over the ranks (``rise``), the slowest rank's call
time, and ``ok``, ``WRONG n``, ``crashed`` or ``timed out`` (such a case is a row,
not the end of the run). Expect, at large sizes on 2 ranks with MPICH: mpi4py
(out of place) about 1.5 messages (its result buffer, and MPI's scratch for the
reduction, half a message for 2 ranks), mpi4py_inplace about 0.5 (the scratch
only), mpi4jax about 1.5 (XLA's result buffer and MPI's scratch).

The jobs run with ``MALLOC_MMAP_THRESHOLD_=131072`` (``--malloc-default`` leaves
glibc's own). By default glibc raises its mmap threshold to the size of each large
block freed (up to 32 MiB on 64 bits); blocks below it then come from the heap and
may stay resident when freed, to be reused by the next allocation of that size, so
a call that follows a freed block of its own size looks as if it needed nothing.
A fixed threshold gives every block from 128 KiB up its own mapping, returned to
the OS when freed, so the rise is what the call itself touched. Measured here (2
ranks, MPICH 5, float32, rise in messages for mpi4py / mpi4py_inplace / mpi4jax):

- first call, as measured by default: the same either way (1 MiB 1.88/0.70/1.41
  fixed vs 1.69/0.89/1.50 glibc's, within the run-to-run spread of 0.2 at 1 MiB;
  16 MiB 1.51/0.52/1.50 vs 1.52/0.52/1.51; 64 MiB 1.50/0.50/1.50 vs
  1.50/0.51/1.50): this set-up's freed blocks are temporaries larger than the
  message, which glibc trims from the top of the heap anyway;
- after one warm-up call (``--warm``), whose freed MPI scratch and result are
  exactly the call's sizes: at 16 MiB glibc's default gives mpi4py_inplace 0.00
  and mpi4jax 1.00 (the scratch reused), the fixed threshold 0.50 and 1.49, as
  the first call; at 64 MiB, above glibc's 32 MiB cap, both give 0.50 and 1.50.

The threshold therefore costs nothing and keeps the figure from depending on what
the set-up happened to free. At 1 MiB a constant of about 0.25 MiB (MPI's and
Python's first-call allocations, page granularity) adds about 0.25 messages, and
the figures there move by about 0.2 from run to run.

On a GPU (not run here: this machine has none) a JAX implementation is measured by
its device's ``memory_stats()``: ``bytes_in_use`` before the call is the baseline
and ``peak_bytes_in_use`` after it the peak. The peak cannot be reset, but in a
fresh process it holds only this case; when the peak before the call is already
as high, set-up dominated and the row's ``rise_upper_bound`` says the rise is only
an upper bound. mpi4py implementations are measured by RSS everywhere. The jobs get
``JAX_PLATFORMS=cpu`` unless it is set (``_harness.run_job``): on a GPU machine run
with ``JAX_PLATFORMS=cuda``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
import allreduce  # noqa: E402

IMPLS = allreduce.IMPLS
ORDERS = ("default", "reversed", "shuffled")
DEFAULT_SIZES = "1MiB,16MiB,64MiB"
# glibc: blocks from 128 KiB up get their own mapping, returned when freed (the
# default is also 128 KiB, but it then rises with every large block freed).
MMAP_THRESHOLD = "131072"

TABLE = _harness.Table(
    [
        _harness.Column("bytes", "bytes", "per rank", 10),
        _harness.Column("impl", "impl", "", 16, left=True),
        _harness.Column("rise_x", "rise", "x msg", 6, ".2f"),
        _harness.Column("rise_bytes", "rise", "MiB", 8, ".2f", 1 / 2**20),
        _harness.Column("t_call_s", "t_call", "us", 10, ".1f", 1e6),
        _harness.Column("measure", "measure", "", 7),
        _harness.Column("compiles", "compiles", "", 8),
        _harness.Column("status", "check", "", 10, left=True),
    ]
)


# ---------------------------------------------------------------------------------
# One case, inside its own MPI job


def settle(uses_jax: bool, most: float = 2.0) -> None:
    """Wait until the set-up's memory is freed: garbage collected, JAX's pending
    work done, and RSS unchanged over 20 ms (at most ``most`` seconds).

    Memory freed after the baseline but during the call offsets what the call
    allocates: jaxlib released the host array of a load at the next dispatch,
    which made psum's rise at 64 MiB read 2 MiB on some ranks instead of 66
    (``load`` now releases it; this waits for anything else still moving).
    """
    gc.collect()
    if uses_jax:
        import jax

        jax.effects_barrier()
    deadline = time.monotonic() + most
    last = _harness.rss_bytes()[0]
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = _harness.rss_bytes()[0]
        if now == last:
            return
        last = now


def run_case(name: str, nbytes: int, dtype: str, warm: bool = False) -> None:
    """Measure one allreduce of ``name`` at ``nbytes`` per rank; rank 0 reports.

    With ``warm``, one call and a fresh load come first (the steady state).
    """
    from mpi4py import MPI

    from mpi4jax_dist import _mpi

    comm = MPI.COMM_WORLD
    record = IMPLS[name]
    device = None
    if record.uses_jax:
        import jax

        import mpi4jax_dist  # noqa: F401  (registers the MPI cluster env)

        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        jax.distributed.initialize()
        if jax.default_backend() != "cpu":
            device = jax.local_devices()[0]
    rank, procs = comm.Get_rank(), comm.Get_size()
    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    impl = record(n, dtype, comm)
    impl.load(allreduce.pattern(n, rank, procs, dtype))
    if warm:
        impl.call()
        impl.load(allreduce.pattern(n, rank, procs, dtype))
    settle(record.uses_jax)
    comm.Barrier()
    peak_before = None
    if device is not None:
        stats = device.memory_stats() or {}
        base, peak_before = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
        reset = True
    else:
        # The peak restarts from the current RSS: the baseline is read after.
        reset = _harness.reset_peak_rss()
        base = _harness.rss_bytes()[0]
    # Counting compilations needs JAX, which the mpi4py jobs do not import.
    compiled = _harness.Compiles() if record.uses_jax else None
    with compiled or contextlib.nullcontext():
        start = time.perf_counter()
        impl.call()
        elapsed = time.perf_counter() - start
    compiles = compiled.count if compiled else 0
    if device is not None:
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    else:
        peak = _harness.rss_bytes()[1]
    rise = None if peak is None or base is None else peak - base
    wrong = allreduce.count_wrong(impl.result(), allreduce.expected(n, procs, dtype))
    mine = {
        "rise": rise,
        "t": elapsed,
        "wrong": wrong,
        "compiles": compiles,
        "reset": reset,
        "upper_bound": None not in (peak_before, peak) and peak_before >= peak,
    }
    everyone = comm.gather(mine)
    if rank == 0:
        rises = [r["rise"] for r in everyone]
        _harness.report(
            rise_bytes=None if None in rises else max(rises),
            rise_per_rank=rises,
            t_call_s=max(r["t"] for r in everyone),
            wrong=sum(r["wrong"] for r in everyone),
            compiles=max(r["compiles"] for r in everyone),
            peak_reset=all(r["reset"] for r in everyone),
            rise_upper_bound=any(r["upper_bound"] for r in everyone),
            measure="rss" if device is None else "device",
            mpi_library=_mpi.mpi_library(),
        )


# ---------------------------------------------------------------------------------
# The parent: one job per case


def order_cases(cases: list, order: str, seed: int) -> list:
    """Return ``cases`` in ``order``: as given, reversed, or shuffled by ``seed``."""
    cases = list(cases)
    if order == "reversed":
        cases.reverse()
    elif order == "shuffled":
        random.Random(seed).shuffle(cases)
    return cases


def job_env(malloc_default: bool) -> dict:
    """Return the jobs' environment: ours, with glibc's mmap threshold fixed
    (unless ``malloc_default``) and JAX on the CPU unless the caller chose."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if not malloc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    return env


def measure(name, nbytes, args, env) -> dict:
    """Run one case in its own job; return its row (a failure is a row too)."""
    itemsize = np.dtype(args.dtype).itemsize
    nbytes = max(1, nbytes // itemsize) * itemsize
    job = _harness.run_job(
        args.procs,
        [
            os.path.abspath(__file__),
            "--case",
            f"{name}:{nbytes}",
            "--dtype",
            args.dtype,
            *(["--warm"] if args.warm else []),
        ],
        timeout=args.timeout,
        env=env,
    )
    row = {"bytes": nbytes, "impl": name, "dtype": args.dtype, "procs": args.procs}
    if job.returncode is None:
        row["status"] = f"timed out ({args.timeout:g} s)"
    elif not job.ok or not job.results:
        row["status"] = f"crashed ({job.returncode})"
    if "status" in row:
        row["tail"] = job.tail
        return row
    found = job.results[-1]
    row.update(found)
    row["rise_x"] = (
        None if found["rise_bytes"] is None else found["rise_bytes"] / nbytes
    )
    row["status"] = "ok" if found["wrong"] == 0 else f"WRONG {found['wrong']}"
    return row


def plot(results: list[dict], path: str, title: str) -> None:
    """One panel per size: a bar per implementation, its rise in messages."""
    _harness.plot_bars(
        results,
        path,
        key="rise_x",
        label=f"{title}: peak RSS rise / message",
        scale=1.0,
        group=lambda r: _harness.human_bytes(r["bytes"]),
        bar=lambda r: r["impl"],
        logy=False,
    )


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="ranks per job")
    parser.add_argument(
        "--sizes",
        type=_harness.parse_sizes,
        default=_harness.parse_sizes(DEFAULT_SIZES),
        help=f"bytes per rank, comma-separated (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS.names()),
        help=f"comma-separated, from {', '.join(IMPLS.names())}",
    )
    parser.add_argument("--order", choices=ORDERS, default="default")
    parser.add_argument("--seed", type=int, default=0, help="for --order shuffled")
    parser.add_argument("--dtype", choices=allreduce.DTYPES, default="float32")
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds per job before it is killed"
    )
    parser.add_argument(
        "--malloc-default",
        action="store_true",
        help="leave glibc's moving mmap threshold (to see what fixing it changes)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="one call (and a fresh load) before the measured one: the steady "
        "state, where the previous result is dropped as the next one is made",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # IMPL:BYTES, in a job
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.impls = IMPLS.choose(args.impls, "--impls")
        allreduce.pattern_bound(args.procs, args.dtype)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv=None) -> list[dict]:
    """Run every case in its own job; return the rows.

    Raises:
        SystemExit: 1 after all cases when one was wrong, crashed or timed out.
    """
    args = parse_args(argv)
    if args.case:
        name, _, nbytes = args.case.partition(":")
        run_case(name, int(nbytes), args.dtype, args.warm)
        return []
    from mpi4jax_dist import _launch

    if _launch.detect(os.environ) is not None:
        sys.exit(
            "memory.py starts its own mpiexec jobs: run it as `python "
            "benchmarks/memory.py`, not under mpiexec"
        )
    cases = order_cases(
        [(name, nbytes) for nbytes in args.sizes for name in args.impls],
        args.order,
        args.seed,
    )
    env = job_env(args.malloc_default)
    threshold = env.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
    meta = _harness.meta(
        procs=args.procs,
        dtype=args.dtype,
        order=args.order,
        seed=args.seed,
        warm=args.warm,
        malloc_mmap_threshold=threshold,
        mpiexec=_harness.find_mpiexec(),
    )
    _harness.say(
        None,
        f"# peak memory of one allreduce (call"
        f"{', after one warm-up call' if args.warm else ''}), {args.procs} ranks, "
        f"{args.dtype}, one fresh mpiexec job per case, order {args.order}, "
        f"MALLOC_MMAP_THRESHOLD_={threshold}",
        "# rise = peak RSS (VmHWM) above the RSS before the call, largest rank; "
        "t_call = slowest rank",
        TABLE.header(),
    )
    results = []
    for name, nbytes in cases:
        row = measure(name, nbytes, args, env)
        results.append(row)
        _harness.say(None, TABLE.row(row))
    # The parent is not in an MPI job: the MPI library is the jobs' word.
    meta["mpi_library"] = next(
        (r["mpi_library"] for r in results if r.get("mpi_library")), None
    )
    _harness.save(
        args,
        meta,
        results,
        plot=lambda rows, path: plot(rows, path, f"{args.procs} ranks"),
    )
    bad = [r for r in results if r["status"] != "ok"]
    if bad:
        for row in bad:
            _harness.say(
                None,
                f"FAILED: {row['impl']} at {row['bytes']} bytes per rank: "
                f"{row['status']}",
                file=sys.stderr,
            )
            if "tail" in row:
                print(row["tail"][-1500:], file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
