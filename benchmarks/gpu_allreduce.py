"""On a GPU machine: the CUDA allreduce's device memory, a fresh job per case.

    python benchmarks/gpu_allreduce.py [--procs 2] [--sizes 256MiB,1GiB]
        [--no-large] [--impls ours,ours_aware,...] [--timeout 600]
        [--json PATH] [--plot PNG]

``tools/gpu_check.sh`` installs what it needs on a bare GPU machine, builds, runs
the GPU tests (``tests/gpu/test_inplace_allreduce_gpu.py``: results against mpi4py,
donation in place, the device-memory rise, the pinned staging buffer, 2**31 + 16
int8) and then this, in one command. Run it without ``mpiexec``: like
benchmarks/memory.py it starts its own ``mpiexec -n P`` jobs
(``_harness.run_job``), with ``JAX_PLATFORMS=cuda`` and
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (ranks may share one GPU). It

1. asks a fresh process whether JAX sees a GPU; without one it prints one sentence
   and exits 0 (nothing to run: the CPU figures come from benchmarks/memory.py);
2. measures one allreduce per (implementation, size), each in its own job, so
   that the device's ``peak_bytes_in_use`` (which cannot be reset) holds only that
   case: device memory before the call (``bytes_in_use``, the input on the
   device), during it (``peak_bytes_in_use`` after it) and after it
   (``bytes_in_use``, the result held); the rise in messages, the host memory the
   call pinned and the pieces it staged (ours), the time, the compilations during
   the call (none) and whether the result is right. A crash (mpi4jax above
   2**31, NCCL refusing two ranks on one GPU) is that row's status, not the end
   of the run.

Sizes: ``--sizes`` in bytes per rank of float32 (default 256 MiB and 1 GiB), and
2**31 + 16 int8 elements per rank unless ``--no-large``; a case that needs more
device memory than the GPU has is skipped with the reason. Implementations:

- ``ours``: ``mpi4jax_dist.allreduce``, donated, staged through host memory
  (``MPI4JAX_DIST_CUDA_AWARE_MPI=0``): expect a rise of 0 messages, after =
  before, and one pinned staging buffer (``MPI4JAX_DIST_STAGING_BYTES``, 64 MiB)
  of host memory;
- ``ours_aware``: the same with CUDA-aware MPI (only where the MPI's
  ``MPIX_Query_cuda_support`` says yes): 0 messages, no pinned memory;
- ``ours_jit``: on an intermediate inside ``jit`` (input held, not donated): one
  message, the result's buffer, which the intermediate becomes;
- ``mpi4jax`` / ``mpi4jax_aware``: ``mpi4jax.allreduce`` in ``jit``, donated (it
  cannot use it), staged (``MPI4JAX_USE_CUDA_MPI=0``: two host copies of the
  message) or CUDA-aware: one message, its out-of-place result;
- ``psum``: ``shard_map`` + ``lax.psum`` over a global array (NCCL), donated.

The input is built on the device by XLA (no host copy); the check runs on the
device too: ``S = P b + P (P - 1) / 2`` for ``e_r = b + r``, ``b`` in [0, 12].

Exit status: 0 when everything ran and was right (or there is no GPU), 1 when a
row of ``ours*`` was wrong, crashed or timed out (rows of the others are reported,
not judged: mpi4jax crashing above 2**31 is the point).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

DEFAULT_SIZES = "256MiB,1GiB"
LARGE = 2**31 + 16
# Elements are made as (rows, 16) blocks: counts above 2**31 without int64 indices.
COLUMNS = 16

AWARE = "MPI4JAX_DIST_CUDA_AWARE_MPI"
MPI4JAX_AWARE = "MPI4JAX_USE_CUDA_MPI"


class Impl:
    """One implementation: its environment, whether it needs a CUDA-aware MPI,
    and how many messages of device memory it needs at most (input included)."""

    def __init__(self, mode, env, messages, aware=False, ours=False):
        self.mode, self.env, self.messages = mode, env, messages
        self.aware, self.ours = aware, ours


IMPLS = _harness.Registry("GPU allreduce implementation")
IMPLS.register("ours", Impl("staged", {AWARE: "0"}, 1, ours=True))
IMPLS.register("ours_aware", Impl("cuda-aware", {AWARE: "1"}, 1, True, True))
IMPLS.register("ours_jit", Impl("staged", {AWARE: "0"}, 2, ours=True))
IMPLS.register("mpi4jax", Impl("staged", {MPI4JAX_AWARE: "0"}, 2))
IMPLS.register("mpi4jax_aware", Impl("cuda-aware", {MPI4JAX_AWARE: "1"}, 2, True))
IMPLS.register("psum", Impl("nccl", {}, 2))

TABLE = _harness.Table(
    [
        _harness.Column("bytes", "bytes", "per rank", 11),
        _harness.Column("dtype", "dtype", "", 7, left=True),
        _harness.Column("impl", "impl", "", 13, left=True),
        _harness.Column("mode", "mode", "", 10, left=True),
        _harness.Column("before_bytes", "before", "dev MiB", 9, ".1f", 1 / 2**20),
        _harness.Column("peak_bytes", "peak", "dev MiB", 9, ".1f", 1 / 2**20),
        _harness.Column("after_bytes", "after", "dev MiB", 9, ".1f", 1 / 2**20),
        _harness.Column("rise_x", "rise", "x msg", 6, ".2f"),
        _harness.Column("rise_bytes", "rise", "MiB", 9, ".1f", 1 / 2**20),
        _harness.Column("upper", "bound", "", 5),
        _harness.Column("pinned_bytes", "pinned", "host MiB", 8, ".1f", 1 / 2**20),
        _harness.Column("pieces", "pieces", "staged", 6),
        _harness.Column("t_call_s", "t_call", "ms", 9, ".1f", 1e3),
        _harness.Column("compiles", "compiles", "", 8),
        _harness.Column("status", "check", "", 12, left=True),
    ]
)


# ---------------------------------------------------------------------------------
# One case, inside its own MPI job


def run_case(name: str, n: int, dtype: str) -> None:
    """Measure one allreduce of ``n`` elements of ``dtype`` per rank by ``name``;
    rank 0 reports."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import SingleDeviceSharding
    from mpi4py import MPI

    import mpi4jax_dist

    comm = MPI.COMM_WORLD
    rank, procs = comm.Get_rank(), comm.Get_size()
    if name == "psum":
        jax.distributed.initialize()  # through mpi4jax_dist's cluster: one GPU each
        device = jax.local_devices()[0]
    else:
        # Plain per-process JAX: this rank's GPU among those it sees.
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        devices = jax.local_devices()
        device = devices[local.Get_rank() % len(devices)]
        local.Free()
    sharding = SingleDeviceSharding(device)
    rows = n // COLUMNS

    def pattern(r):
        i = lax.broadcasted_iota(jnp.int32, (rows, COLUMNS), 0)
        j = lax.broadcasted_iota(jnp.int32, (rows, COLUMNS), 1)
        return (((i % 7) * COLUMNS + j) % 13 + r).astype(dtype).reshape(n)

    make = jax.jit(lambda: pattern(rank), out_shardings=sharding)
    total = procs * (procs - 1) // 2  # of r over the ranks

    @jax.jit
    def right(y):
        return jnp.all(y == pattern(0) * procs + total)

    spec = jax.ShapeDtypeStruct((n,), dtype, sharding=sharding)
    to_global = to_local = None
    if name in ("ours", "ours_aware"):
        reduce = jax.jit(mpi4jax_dist.allreduce, donate_argnums=0)
    elif name == "ours_jit":
        reduce = jax.jit(lambda a: mpi4jax_dist.allreduce(a + 0))
    elif name.startswith("mpi4jax"):
        import mpi4jax

        def reduce_mpi4jax(a):
            return mpi4jax.allreduce(a, op=MPI.SUM)

        reduce = jax.jit(reduce_mpi4jax, donate_argnums=0)
    else:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from mpi4jax_dist import _compat

        mesh = mpi4jax_dist.global_mesh()
        axis = mesh.axis_names[0]
        reduce = jax.jit(
            _compat.shard_map(
                lambda v: lax.psum(v, axis),
                mesh=mesh,
                in_specs=P(axis),
                out_specs=P(axis),
            ),
            donate_argnums=0,
        )
        spec = jax.ShapeDtypeStruct(
            (procs * n,), dtype, sharding=NamedSharding(mesh, P(axis))
        )

        def to_global(a):
            return mpi4jax_dist.to_global(a, mesh)

        def to_local(a):
            return a.addressable_shards[0].data

    reduce.lower(spec).compile()
    ext = None
    if name.startswith("ours"):
        from mpi4jax_dist import _ffi

        ext = _ffi.load_cuda()

    x = make()
    if to_global is not None:
        x = to_global(x)
    x.block_until_ready()
    gc.collect()
    jax.effects_barrier()
    comm.Barrier()
    stats = device.memory_stats() or {}
    base, peak_before = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    if ext is not None:
        ext.reset_stats()
    with _harness.Compiles() as compiled:
        start = time.perf_counter()
        y = reduce(x)
        y.block_until_ready()
        elapsed = time.perf_counter() - start
    after_stats = device.memory_stats() or {}
    peak, after = after_stats.get("peak_bytes_in_use"), after_stats.get("bytes_in_use")
    pinned = ext.stats()["pinned_peak_bytes"] if ext is not None else None
    pieces = ext.stats()["staged_chunks"] if ext is not None else None
    del x
    ok = bool(right(y if to_local is None else to_local(y)))
    mine = {
        "before": base,
        "peak": peak,
        "after": after,
        "pieces": pieces,
        "rise": None if None in (base, peak) else peak - base,
        "upper": None not in (peak_before, peak) and peak_before >= peak,
        "t": elapsed,
        "ok": ok,
        "pinned": pinned,
        "compiles": compiled.count,
        "device": f"{device.device_kind} ({device})",
    }
    everyone = comm.gather(mine)
    if rank == 0:
        rises = [r["rise"] for r in everyone]
        pins = [r["pinned"] for r in everyone]

        def largest(key):
            values = [r[key] for r in everyone]
            return None if None in values else max(values)

        _harness.report(
            before_bytes=largest("before"),
            peak_bytes=largest("peak"),
            after_bytes=largest("after"),
            pieces=largest("pieces"),
            rise_bytes=None if None in rises else max(rises),
            rise_per_rank=rises,
            upper=any(r["upper"] for r in everyone),
            pinned_bytes=None if None in pins else max(pins),
            t_call_s=max(r["t"] for r in everyone),
            wrong=sum(not r["ok"] for r in everyone),
            compiles=max(r["compiles"] for r in everyone),
            devices=sorted({r["device"] for r in everyone}),
        )


# ---------------------------------------------------------------------------------
# The parent


PROBE = """
import importlib.util, json, os
info = {"gpus": []}
try:
    import jax
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    info["gpus"] = [f"{d.device_kind} ({d})" for d in gpus]
    if gpus:
        info["bytes_limit"] = (gpus[0].memory_stats() or {}).get("bytes_limit")
        from mpi4py import MPI
        from mpi4jax_dist import _ffi
        try:
            module = _ffi.load_cuda()
            info["cuda_module"] = module.__name__
            info["mpi_cuda_support"] = module.mpi_cuda_support()
        except ImportError as e:
            info["cuda_module_error"] = str(e)
except Exception as e:  # no CUDA plugin, no driver, no device
    plugins = [p for p in ("jax_cuda13_plugin", "jax_cuda12_plugin")
               if importlib.util.find_spec(p)]
    info["why"] = (
        f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')}: "
        f"{type(e).__name__}{': ' + str(e) if str(e) else ''}; "
        f"CUDA plugin: {', '.join(plugins) or 'none installed'}"
    )
print("RESULT " + json.dumps(info))
"""


def job_env() -> dict:
    """The jobs' environment: JAX on CUDA, no preallocation (ranks may share a
    GPU, and memory_stats then counts what the program holds)."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS") or "cuda"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def probe(env: dict, timeout: float) -> dict:
    """Ask a fresh process what JAX and the CUDA module see."""
    job = _harness.run_job(0, ["-c", PROBE], timeout=timeout, env=env)
    if job.returncode is None:
        return {"gpus": [], "why": f"the probe took over {timeout:g} s"}
    if job.results:
        return job.results[0]
    return {"gpus": [], "why": (job.stderr.strip().splitlines() or ["no answer"])[-1]}


def cases(args) -> list[tuple[str, int, str]]:
    """(impl, elements per rank, dtype) in order of size, then implementation."""
    sizes = [(nbytes // 4 // COLUMNS * COLUMNS, "float32") for nbytes in args.sizes]
    if args.large:
        sizes.append((LARGE, "int8"))
    return [(name, n, dtype) for n, dtype in sizes for name in args.impls]


def measure(name, n, dtype, args, env, gpu) -> dict:
    """Run one case in its own job (or say why not); return its row."""
    impl = IMPLS[name]
    nbytes = n * np.dtype(dtype).itemsize
    row = {"bytes": nbytes, "dtype": dtype, "impl": name, "mode": impl.mode}
    if impl.aware and not gpu.get("mpi_cuda_support"):
        row["status"] = "skipped"
        row["why"] = "the MPI does not say it reads device memory"
        return row
    limit = gpu.get("bytes_limit")
    per_gpu = math.ceil(args.procs / max(1, len(gpu["gpus"])))
    need = per_gpu * (impl.messages * nbytes + (256 << 20))
    if limit and need > limit:
        row["status"] = "skipped"
        row["why"] = f"needs {need / 2**30:.1f} GiB of the GPU's {limit / 2**30:.1f}"
        return row
    job_environment = dict(env, **impl.env)
    job = _harness.run_job(
        args.procs,
        [os.path.abspath(__file__), "--case", f"{name}:{n}:{dtype}"],
        timeout=args.timeout,
        env=job_environment,
    )
    found = _harness.case_result(job, row, args.timeout)
    if found is None:
        return row
    row.update(found)
    rise = found["rise_bytes"]
    row["rise_x"] = None if rise is None else rise / nbytes
    row["upper"] = "<=" if found["upper"] else ""
    row["status"] = "ok" if found["wrong"] == 0 else f"WRONG {found['wrong']}"
    return row


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="ranks per job")
    parser.add_argument(
        "--sizes",
        type=_harness.parse_sizes,
        default=_harness.parse_sizes(DEFAULT_SIZES),
        help=f"float32 bytes per rank (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--no-large",
        dest="large",
        action="store_false",
        help=f"leave out {LARGE} int8 elements per rank",
    )
    IMPLS.option(parser, "--impls")
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per job before it is killed"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # IMPL:N:DTYPE, in a job
    _harness.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Probe, then run every case in its own job; return the rows.

    Raises:
        SystemExit: 0 without a GPU (after one sentence); 1 after everything when
            a row of ours was wrong, crashed or timed out.
    """
    args = parse_args(argv)
    if args.case:
        name, n, dtype = args.case.split(":")
        run_case(name, int(n), dtype)
        return []
    _harness.not_under_mpiexec("gpu_allreduce.py")
    env = job_env()
    gpu = probe(env, args.timeout)
    if not gpu["gpus"]:
        print(
            f"gpu_allreduce.py: JAX sees no GPU here "
            f"({gpu.get('why', 'JAX_PLATFORMS=' + env['JAX_PLATFORMS'])}), so "
            f"there is nothing to run; benchmarks/memory.py measures the CPU."
        )
        raise SystemExit(0)
    _harness.say(
        None,
        f"# {len(gpu['gpus'])} GPU(s): {', '.join(gpu['gpus'])}; "
        f"{gpu.get('cuda_module') or gpu.get('cuda_module_error')}; MPI says it "
        f"reads device memory: {gpu.get('mpi_cuda_support')}",
    )
    meta = _harness.meta(
        procs=args.procs,
        gpus=gpu["gpus"],
        mpi_cuda_support=gpu.get("mpi_cuda_support"),
        mpiexec=_harness.find_mpiexec(),
    )
    _harness.say(
        None,
        f"# device memory of one allreduce, {args.procs} ranks, one fresh mpiexec "
        f"job per case",
        "# device memory of the largest rank: before = bytes_in_use before the "
        "call (input held), peak = peak_bytes_in_use after it, after = "
        "bytes_in_use after it (result held); rise = peak - before; bound <= : the "
        "peak was already that high before the call; pinned = host memory the call "
        "pinned (ours: one staging buffer); pieces = staged copies to the host and "
        "back",
        TABLE.header(),
    )
    results = []
    for name, n, dtype in cases(args):
        row = measure(name, n, dtype, args, env, gpu)
        results.append(row)
        _harness.say(None, TABLE.row(row))
    _harness.save(
        args,
        meta,
        results,
        _harness.rise_plot(
            "peak device memory rise / message",
            lambda r: f"{_harness.human_bytes(r['bytes'])} {r['dtype']}",
        ),
    )
    for row in results:
        if row["status"] not in ("ok",):
            reason = row.get("why") or (row.get("tail") or "")[-600:]
            _harness.say(
                None,
                f"# {row['impl']} at {row['bytes']} bytes: {row['status']}: {reason}",
                file=sys.stderr,
            )
    ours_bad = [
        r
        for r in results
        if IMPLS[r["impl"]].ours and r["status"] not in ("ok", "skipped")
    ]
    if ours_bad:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
