"""Peak memory of one allreduce, per implementation and size, each in its own job.

    python benchmarks/memory.py [--procs 2] [--sizes 1MiB,16MiB,64MiB]
        [--impls mpi4py,mpi4jax,...] [--order default|reversed|shuffled]
        [--dtype float32|float64|int32|int8] [--timeout S] [--json PATH] [--plot PNG]

    # issue 11's cases: 256 MiB and 1 GiB of float32, then 2^31 + 16 int8
    python benchmarks/memory.py --sizes 256MiB,1GiB
    python benchmarks/memory.py --sizes 2147483664 --dtype int8

Sizes are bytes per rank, one ``--dtype`` for all of them, and a size must be a
whole number of elements: with ``int8`` a size is the element count.

Run it without ``mpiexec``: for every (implementation, size) case it starts a fresh
``mpiexec -n P`` job (``_harness.run_job``), so that no figure depends on what ran
before it in the same process (allocator reuse made the old in-process figures
change with the order: mpi4py at 1 MiB was 5.0 messages in one order and 1.0 in the
other), and so that a crash ends that case only. ``--order`` runs the cases in
another order to show that the figures do not move. In the job, every rank:

1. builds the implementation (JAX ones compile ahead of time) and loads its
   checked input, ``_allreduce_impls.pattern`` as XLA makes it
   (``_allreduce_impls.device_pattern``: NumPy needs 16 GiB of temporaries for 2^31
   elements; every job imports JAX for this, the mpi4py ones too);
2. lets the set-up settle (``gc.collect()``, JAX's pending work done, RSS still
   for 20 ms), resets the peak RSS (VmHWM); baseline = current RSS;
3. runs one allreduce, ``call()``: the input held (or, for ``mpi4py_inplace`` and
   the donated ``mpi4jax_dist``, reduced in place), a result produced;
4. peak = VmHWM; reports ``(peak - baseline) / message bytes``, the time of that
   call, the XLA compilations during it (none: the executables were compiled in
   step 1) and whether the result is exactly ``S(i)`` (checked a block at a time
   by XLA, ``_allreduce_impls.count_wrong_blocks``).

The cases are the ``IMPLS`` of benchmarks/_allreduce_impls.py (``mpi4py``,
``mpi4py_inplace``, ``mpi4jax``, ``mpi4jax_dist`` donated, ``psum``, ``gspmd``) and
two on an intermediate inside the ``jit``, ``allreduce(x + z)`` with ``z`` a zero
passed at run time (XLA can fold neither it nor the sum away), the input not donated:
``mpi4jax_dist_tmp`` (XLA writes ``x + z`` into the result's buffer, which the op
reduces in place) and ``mpi4jax_tmp`` (``x + z`` is a temporary beside mpi4jax's
result).

A row shows the largest rise over the ranks (``rise``); for JAX cases
``xla_temp``, the temp bytes XLA plans for the call (``memory_analysis()``) in
messages; for ``mpi4jax_dist`` cases ``in_place``, ``yes`` when its handler got one
buffer in and out in every call on every rank (the extension's own counts, also in
the JSON as ``handler_stats``: MPI calls, large-count calls, largest count); the
slowest rank's call time; and ``ok``, ``WRONG n``, ``crashed (status, signal)`` or
``timed out (s)``: such a case is a row, not the end of the run (mpi4jax 0.9.1
casts the count to ``int`` and segfaults above 2^31 elements). Each job has a
time limit, ``--timeout``, by default 120 s plus 60 s per GiB of message. Expect,
at large sizes on 2 ranks with MPICH: mpi4py (out of place) about 1.5 messages (its
result buffer, and MPI's scratch for the reduction, half a message for 2 ranks),
mpi4py_inplace about 0.5 (the scratch only), mpi4jax about 1.5 (XLA's result
buffer and MPI's scratch), mpi4jax_dist about half a chunk
(``MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES``, 64 MiB) of scratch and no buffer,
mpi4jax_dist_tmp one message more (the result, which holds ``x + z``), and
mpi4jax_tmp about 2.5 (``x + z``, the result and MPI's scratch).

The jobs run with ``MALLOC_MMAP_THRESHOLD_=131072``. By default glibc raises its
mmap threshold to the size of each large block freed, and a call that follows a
freed block of its own size may reuse it and look as if it needed nothing; a fixed
threshold gives every block from 128 KiB up its own mapping, returned to the OS
when freed, so the rise is what the call itself touched. That is settled (it costs
nothing; docs/benchmarks.rst, *Memory*, gives the runs with glibc's default and
after a warm-up call, whose options, ``--malloc-default`` and ``--warm``, left
this script). At 1 MiB a constant of about 0.25 MiB (MPI's and Python's
first-call allocations, page granularity) adds about 0.25 messages, and the
figures there move by about 0.2 from run to run.

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
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _allreduce_impls  # noqa: E402
import _harness  # noqa: E402

ORDERS = ("default", "reversed", "shuffled")
DEFAULT_SIZES = "1MiB,16MiB,64MiB"

# ---------------------------------------------------------------------------------
# The cases: _allreduce_impls's implementations, and two on an intermediate


IMPLS = _harness.Registry("memory case")
for _name in _allreduce_impls.IMPLS.names():
    IMPLS.register(_name, _allreduce_impls.IMPLS[_name])


class OnIntermediate:
    """Mixin: reduce ``x + z`` inside the one ``jit``, ``z`` a zero passed at run
    time, so that XLA can neither fold the sum away nor reduce the input itself:
    the operand is an intermediate, and the input is not donated."""

    def extra_args(self):
        return (self.jax.device_put(np.zeros((), self.dtype)),)

    def operand(self, x, zero):
        return x + zero


@IMPLS.register("mpi4jax_dist_tmp")
class Mpi4jaxDistTmp(OnIntermediate, _allreduce_impls.Mpi4jax):
    """``mpi4jax_dist.allreduce(x + z)`` in ``jax.jit``, not donated: XLA writes
    ``x + z`` into the result's buffer and the handler reduces it in place."""

    extension = True

    def reduce(self, v):
        from mpi4py import MPI

        import mpi4jax_dist

        return mpi4jax_dist.allreduce(v, MPI.SUM, comm=self.comm)


@IMPLS.register("mpi4jax_tmp")
class Mpi4jaxTmp(OnIntermediate, _allreduce_impls.Mpi4jax):
    """``mpi4jax.allreduce(x + z)`` in ``jax.jit``: ``x + z`` is a temporary
    beside the result (the comparison for ``mpi4jax_dist_tmp``)."""


TABLE = _harness.Table(
    [
        _harness.Column("bytes", "bytes", "per rank", 10),
        _harness.Column("impl", "impl", "", 16, left=True),
        _harness.Column("rise_x", "rise", "x msg", 6, ".2f"),
        _harness.Column("rise_bytes", "rise", "MiB", 8, ".1f", 1 / 2**20),
        _harness.Column("xla_temp_x", "xla_temp", "x msg", 8, ".2f"),
        _harness.Column("in_place", "in_place", "", 8, left=True),
        _harness.Column("t_call_s", "t_call", "ms", 9, ".2f", 1e3),
        _harness.Column("measure", "measure", "", 7),
        _harness.Column("compiles", "compiles", "", 8),
        _harness.Column("status", "check", "", 10, left=True),
    ]
)


# ---------------------------------------------------------------------------------
# One case, inside its own MPI job


def load_pattern(impl, rank: int, procs: int) -> None:
    """Load this rank's checked input (``_allreduce_impls.pattern``), made by XLA: a
    2^31-element pattern in NumPy takes 16 GiB temporaries and 80 s a rank."""
    made = _allreduce_impls.device_pattern(impl.n, rank, procs, impl.dtype)
    made.block_until_ready()
    impl.load(np.asarray(made))  # on the CPU a view of XLA's buffer, not a copy
    del made


def grow_communicator_pool(comm, count: int = 4) -> None:
    """Make and free ``count`` duplicates of ``comm`` (collective). MPI allocates
    its communicator objects in blocks (MPICH: a block of them, about 1.8 MiB,
    once its preallocated ones are used up), and the package's first call makes
    duplicates of its communicator: whether that call's window holds the block
    then depends on how many communicators exist already (the watchdog's two, on
    by default, tipped a 4 MiB call from 0.46 to 0.91 messages, 1.8 MiB at every
    size). Made and freed before the baseline, the call reuses them."""
    made = [comm.Dup() for _ in range(count)]
    for duplicate in made:
        duplicate.Free()


def run_case(name: str, nbytes: int, dtype: str) -> None:
    """Measure one allreduce of ``name`` at ``nbytes`` per rank; rank 0 reports.

    Every job imports JAX, which makes the input and checks the result also for
    the mpi4py cases (before the baseline, and after the call).
    """
    import jax
    from mpi4py import MPI

    from mpi4jax_dist import _mpi

    comm = MPI.COMM_WORLD
    record = IMPLS[name]
    device = None
    if record.uses_jax:
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
    xla_temp = None
    if record.uses_jax:
        analysis = impl.executables["one"].memory_analysis()
        xla_temp = None if analysis is None else analysis.temp_size_in_bytes
    extension = None
    if getattr(record, "extension", False):
        from mpi4jax_dist import _ffi

        extension = _ffi.load()
    load_pattern(impl, rank, procs)
    grow_communicator_pool(comm)
    _harness.settle()
    comm.Barrier()
    if extension is not None:
        extension.reset_stats()
    peak_before = None
    if device is not None:
        stats = device.memory_stats() or {}
        base, peak_before = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
        reset = True
    else:
        # The peak restarts from the current RSS: the baseline is read after.
        reset = _harness.reset_peak_rss()
        base = _harness.rss_bytes()[0]
    with _harness.Compiles() as compiled:
        start = time.perf_counter()
        impl.call()
        elapsed = time.perf_counter() - start
    if device is not None:
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    else:
        peak = _harness.rss_bytes()[1]
    handler = None if extension is None else extension.stats()
    rise = None if peak is None or base is None else peak - base
    wrong = _allreduce_impls.count_wrong_blocks(impl.result(), n, procs, dtype)
    mine = {
        "rise": rise,
        "t": elapsed,
        "wrong": wrong,
        "compiles": compiled.count,
        "reset": reset,
        "upper_bound": None not in (peak_before, peak) and peak_before >= peak,
        "handler": handler,
    }
    everyone = comm.gather(mine)
    if rank == 0:
        rises = [r["rise"] for r in everyone]
        handlers = [r["handler"] for r in everyone]
        in_place = None
        if extension is not None:
            # One buffer in and out on every rank, in every handler call.
            in_place = all(
                h["handler_calls"] > 0 and h["same_buffer_calls"] == h["handler_calls"]
                for h in handlers
            )
        _harness.report(
            rise_bytes=None if None in rises else max(rises),
            rise_per_rank=rises,
            t_call_s=max(r["t"] for r in everyone),
            wrong=sum(r["wrong"] for r in everyone),
            compiles=max(r["compiles"] for r in everyone),
            peak_reset=all(r["reset"] for r in everyone),
            rise_upper_bound=any(r["upper_bound"] for r in everyone),
            measure="rss" if device is None else "device",
            xla_temp_bytes=xla_temp,
            in_place=in_place,
            handler_stats=handlers[0],
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


def timeout_for(nbytes: int, timeout: float | None) -> float:
    """Return a job's time limit: ``timeout``, or by default 120 s plus 60 s per
    GiB of message (a 2 GiB case makes and checks 2^31 elements per rank)."""
    if timeout is not None:
        return timeout
    return 120 + 60 * nbytes / 2**30


def measure(name, nbytes, args, env) -> dict:
    """Run one case in its own job; return its row (a failure is a row too)."""
    itemsize = np.dtype(args.dtype).itemsize
    nbytes = max(1, nbytes // itemsize) * itemsize
    timeout = timeout_for(nbytes, args.timeout)
    job = _harness.run_job(
        args.procs,
        [
            os.path.abspath(__file__),
            "--case",
            f"{name}:{nbytes}",
            "--dtype",
            args.dtype,
        ],
        timeout=timeout,
        env=env,
    )
    row = {
        "bytes": nbytes,
        "count": nbytes // itemsize,
        "impl": name,
        "dtype": args.dtype,
        "procs": args.procs,
        "seconds": job.seconds,
    }
    found = _harness.case_result(job, row, timeout)
    if found is None:
        return row
    row.update(found)
    row["rise_x"] = (
        None if found["rise_bytes"] is None else found["rise_bytes"] / nbytes
    )
    temp = found.get("xla_temp_bytes")
    row["xla_temp_x"] = None if temp is None else temp / nbytes
    if found.get("in_place") is not None:
        row["in_place"] = "yes" if found["in_place"] else "no"
    row["status"] = "ok" if found["wrong"] == 0 else f"WRONG {found['wrong']}"
    return row


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="ranks per job")
    parser.add_argument(
        "--sizes",
        type=_harness.parse_sizes,
        default=_harness.parse_sizes(DEFAULT_SIZES),
        help=f"bytes per rank, comma-separated (default {DEFAULT_SIZES})",
    )
    IMPLS.option(parser, "--impls")
    parser.add_argument("--order", choices=ORDERS, default="default")
    parser.add_argument("--seed", type=int, default=0, help="for --order shuffled")
    parser.add_argument(
        "--dtype",
        choices=_allreduce_impls.DTYPES,
        default="float32",
        help="of every size; with int8 a size in bytes is the element count "
        "(--dtype int8 --sizes 2147483664: 2^31 + 16 elements)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per job before it is killed and reported as timed out "
        "(default 120 plus 60 per GiB of message)",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # IMPL:BYTES, in a job
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    try:
        _allreduce_impls.pattern_bound(args.procs, args.dtype)
    except ValueError as err:
        parser.error(str(err))
    itemsize = np.dtype(args.dtype).itemsize
    odd = [size for size in args.sizes if size % itemsize or not size]
    if odd:
        parser.error(
            f"--sizes: {', '.join(map(str, odd))} bytes is not a whole number of "
            f"{args.dtype} elements ({itemsize} bytes each)"
        )
    return args


def main(argv=None) -> list[dict]:
    """Run every case in its own job; return the rows.

    Raises:
        SystemExit: 1 after all cases when one was wrong, crashed or timed out.
    """
    args = parse_args(argv)
    if args.case:
        name, _, nbytes = args.case.partition(":")
        run_case(name, int(nbytes), args.dtype)
        return []
    _harness.not_under_mpiexec("memory.py")
    cases = order_cases(
        [(name, nbytes) for nbytes in args.sizes for name in args.impls],
        args.order,
        args.seed,
    )
    env = _harness.memory_job_env()
    threshold = env["MALLOC_MMAP_THRESHOLD_"]
    meta = _harness.meta(
        procs=args.procs,
        dtype=args.dtype,
        order=args.order,
        seed=args.seed,
        malloc_mmap_threshold=threshold,
        mpiexec=_harness.find_mpiexec(),
    )
    _harness.say(
        None,
        f"# peak memory of one allreduce (call), {args.procs} ranks, "
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
        _harness.rise_plot(
            f"{args.procs} ranks: peak RSS rise / message",
            lambda r: _harness.human_bytes(r["bytes"]),
        ),
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
