"""Peak memory of one allreduce, per implementation and size, each in its own job.

    python benchmarks/memory.py [--procs 2] [--sizes 1MiB,16MiB,64MiB]
        [--impls mpi4py,mpi4jax,...] [--order default|reversed]
        [--dtype float32|float64|int32|int8] [--gpu] [--timeout S] [--json PATH]

Sizes are bytes per rank of one ``--dtype`` (with ``int8`` a size is the element
count: ``--sizes 2147483664 --dtype int8`` is 2^31 + 16). Run it without
``mpiexec``: every (implementation, size) is a fresh ``mpiexec -n P`` job, so that
no figure depends on what ran before it (``--order reversed`` shows it does not),
and a crash ends that case only (``crashed (status, signal)`` or ``timed out
(s)``). In the job every rank builds the implementation, loads its checked input
(``_allreduce_impls.pattern``), lets the set-up settle, resets the peak RSS (VmHWM),
reads the baseline and makes one allreduce, ``call()``. A row: the rise of the peak
over the baseline in messages (largest rank), the call's time, the compilations
during it (none), whether the result is exactly ``S(i)``, XLA's temp plans
(``xla_temp``), and for ``mpi4jax_dist`` whether its handler reduced in place
(``mpi4jax_dist.op_counts``). The cases: ``_allreduce_impls.IMPLS``, and
``allreduce(x + z)`` inside the ``jit`` (``z`` a zero passed at run time):
``mpi4jax_dist_tmp`` and ``mpi4jax_tmp``. docs/benchmarks.rst, *Memory*, says what
to expect and why the jobs run with ``MALLOC_MMAP_THRESHOLD_=131072``.

``--gpu`` (``tools/gpu_check.sh``): the same by the device's ``memory_stats()``
(``peak_bytes_in_use`` cannot be reset: ``bound <=`` marks a rise that is only an
upper bound), with ``JAX_PLATFORMS=cuda`` and ``XLA_PYTHON_CLIENT_PREALLOCATE=false``,
staged or CUDA-aware as ``MPI4JAX_DIST_CUDA_AWARE_MPI`` says. No GPU: one sentence,
exit 0; the exit status judges the package's rows only (mpi4jax crashes above 2^31).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _allreduce_impls  # noqa: E402
import _harness  # noqa: E402

ORDERS = ("default", "reversed")
DEFAULT_SIZES = "1MiB,16MiB,64MiB"
GPU_IMPLS = ["mpi4jax_dist", "mpi4jax_dist_tmp", "mpi4jax", "psum"]
# What JAX sees in a fresh process, as the --gpu jobs will: its GPUs, or why none.
PROBE = """
import importlib.util, json
try:
    import jax
    found = [f"{d.device_kind} ({d})" for d in jax.devices() if d.platform == "gpu"]
except Exception as e:  # no CUDA plugin, no driver, no device
    plugins = [p for p in ("jax_cuda13_plugin", "jax_cuda12_plugin")
               if importlib.util.find_spec(p)]
    found = f"{type(e).__name__}: {e!r}; CUDA plugin: {', '.join(plugins) or 'none'}"
print("RESULT " + json.dumps(found))
"""

# --- The cases: _allreduce_impls's implementations, and two on an intermediate --------


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


COLUMNS = [
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
# --gpu: the mode that ran, whether the rise is only a bound, and what was staged.
GPU_COLUMNS = [
    _harness.Column("mode", "mode", "", 6, left=True),
    _harness.Column("rise_upper_bound", "bound", "", 5, lambda b: "<=" if b else ""),
    _harness.Column("pinned_bytes", "pinned", "host MiB", 8, ".1f", 1 / 2**20),
    _harness.Column("pieces", "pieces", "staged", 6),
]


# --- One case, inside its own MPI job -------------------------------------------------


def load_pattern(impl, rank: int, procs: int, device) -> None:
    """Load this rank's checked input (``_allreduce_impls.pattern``), made by XLA
    (NumPy's takes 16 GiB and 80 s at 2^31 elements); on a ``device`` it stays."""
    if device is not None:
        impl.x = impl.y = None
        impl.x = impl.y = impl.to_device(
            _allreduce_impls.device_pattern(impl.n, rank, procs, impl.dtype)
        )
        impl.x.block_until_ready()
        return
    made = _allreduce_impls.device_pattern(impl.n, rank, procs, impl.dtype)
    made.block_until_ready()
    impl.load(np.asarray(made))  # on the CPU a view of XLA's buffer, not a copy
    del made


def grow_communicator_pool(comm, count: int = 4) -> None:
    """Make and free ``count`` duplicates of ``comm`` before the baseline: MPI
    allocates communicators in blocks (MPICH: 1.8 MiB), which the call's own
    duplicates must not start inside the measured window."""
    made = [comm.Dup() for _ in range(count)]
    for duplicate in made:
        duplicate.Free()


def run_case(name: str, nbytes: int, dtype: str, gpu: bool) -> None:
    """Measure one allreduce of ``name`` at ``nbytes`` per rank; rank 0 reports.
    JAX makes the input and checks the result, for the mpi4py cases too."""
    import jax
    from mpi4py import MPI

    import mpi4jax_dist  # (registers the MPI cluster env)
    from mpi4jax_dist import _mpi

    comm = MPI.COMM_WORLD
    record = IMPLS[name]
    device = None
    if record.uses_jax:
        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        if gpu and record.transport == "mpi":
            # Plain per-process JAX, so that ranks may share a GPU: this rank's
            # among those it sees.
            local = comm.Split_type(MPI.COMM_TYPE_SHARED)
            devices = jax.local_devices()
            device = devices[local.Get_rank() % len(devices)]
            local.Free()
            jax.config.update("jax_default_device", device)
        else:
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
    counted = getattr(record, "extension", False)
    load_pattern(impl, rank, procs, device)
    grow_communicator_pool(comm)
    _harness.settle()
    comm.Barrier()
    if counted:
        mpi4jax_dist.op_counts(reset=True)
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
    handler = mpi4jax_dist.op_counts() if counted else None
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
        in_place = mode = pinned = pieces = None
        if counted:
            # One buffer in and out on every rank, in every handler call.
            in_place = all(
                h["handler_calls"] > 0 and h["same_buffer_calls"] == h["handler_calls"]
                for h in handlers
            )
            if device is not None:  # the CUDA module's counts
                aware, staged = (
                    handlers[0].get(k) for k in ("cuda_aware_calls", "staged_calls")
                )
                mode = "aware" if aware else "staged" if staged else None
                pinned = max(h.get("pinned_peak_bytes", 0) for h in handlers)
                pieces = max(h.get("staged_chunks", 0) for h in handlers)
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
            mode=mode,
            pinned_bytes=pinned,
            pieces=pieces,
            handler_stats=handlers[0],
            mpi_library=_mpi.mpi_library(),
        )


# --- The parent: one job per case -----------------------------------------------------


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
    argv = [os.path.abspath(__file__), "--case", f"{name}:{nbytes}"]
    argv += ["--dtype", args.dtype] + ["--gpu"] * args.gpu
    job = _harness.run_job(args.procs, argv, timeout=timeout, env=env)
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
    parser.add_argument(
        "--gpu", action="store_true", help="on a GPU, by its memory_stats()"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # IMPL:BYTES, in a job
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.gpu and args.impls == IMPLS.names():  # --impls not given
        args.impls = list(GPU_IMPLS)
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


def job_env(gpu: bool) -> dict:
    """The jobs' environment (``_harness.memory_job_env``); with ``gpu``, JAX on
    CUDA without preallocation (ranks may share a GPU, and ``memory_stats`` then
    counts what the program holds), mpi4jax staged or CUDA-aware as the package."""
    env = _harness.memory_job_env()
    if gpu:
        env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS") or "cuda"
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        aware = env.get("MPI4JAX_DIST_CUDA_AWARE_MPI", "0")
        env.setdefault("MPI4JAX_USE_CUDA_MPI", aware)
    return env


def main(argv=None) -> list[dict]:
    """Run every case in its own job; return the rows. ``SystemExit`` 1 after all
    where one was wrong, crashed or timed out (``--gpu``: one of the package's)."""
    args = parse_args(argv)
    if args.case:
        name, _, nbytes = args.case.partition(":")
        run_case(name, int(nbytes), args.dtype, args.gpu)
        return []
    _harness.not_under_mpiexec("memory.py")
    cases = [(name, nbytes) for nbytes in args.sizes for name in args.impls]
    if args.order == "reversed":  # the figures must not move
        cases.reverse()
    env = job_env(args.gpu)
    table = _harness.Table(COLUMNS + GPU_COLUMNS * args.gpu)
    gpus, notes = [], []
    if args.gpu:
        probe = _harness.run_job(0, ["-c", PROBE], timeout=120, env=env)
        gpus = probe.results[0] if probe.results else "the probe failed"
        if not gpus or isinstance(gpus, str):
            why = f"JAX_PLATFORMS={env['JAX_PLATFORMS']}: {gpus or 'no GPU'}"
            print(f"memory.py --gpu: JAX sees no GPU here ({why}); nothing to run")
            raise SystemExit(0)
        notes.append(
            f"# on {', '.join(gpus)}: rise = peak_bytes_in_use above bytes_in_use "
            "before the call (bound <=: the peak was that high before it); pinned = "
            "host memory the call pinned; pieces = staged copies"
        )
    threshold = env["MALLOC_MMAP_THRESHOLD_"]
    meta = _harness.meta(
        procs=args.procs,
        dtype=args.dtype,
        order=args.order,
        malloc_mmap_threshold=threshold,
        mpiexec=_harness.find_mpiexec(),
        gpus=gpus,
    )
    _harness.say(
        None,
        f"# peak memory of one allreduce (call), {args.procs} ranks, "
        f"{args.dtype}, one fresh mpiexec job per case, order {args.order}, "
        f"MALLOC_MMAP_THRESHOLD_={threshold}",
        "# rise = peak RSS (VmHWM) above the RSS before the call, largest rank; "
        "t_call = slowest rank",
        *notes,
        table.header(),
    )
    results = []
    for name, nbytes in cases:
        row = measure(name, nbytes, args, env)
        results.append(row)
        _harness.say(None, table.row(row))
    # The parent is not in an MPI job: the MPI library is the jobs' word.
    meta["mpi_library"] = next(
        (r["mpi_library"] for r in results if r.get("mpi_library")), None
    )
    _harness.save(args, meta, results)
    bad = [r for r in results if r["status"] != "ok"]
    if args.gpu:  # others' failures are reported, not judged
        bad = [r for r in bad if r["impl"].startswith("mpi4jax_dist")]
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
