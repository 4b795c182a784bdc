"""mpi4jax.allreduce against shard_map/psum and XLA's own, with raw mpi4py as the floor.

    mpiexec -n 2 python benchmarks/allreduce.py [--sizes 4,4096,...] [--dtype float32]
        [--impls mpi4py,mpi4jax,psum,...] [--modes loop,call] [--json PATH] [--plot PNG]

One initialized job (``import mpi4jax_dist`` and a plain
``jax.distributed.initialize()``) measures, for each message size (bytes per rank):

- ``mpi4py``: ``Comm.Allreduce`` on NumPy buffers, out of place (the floor);
  ``mpi4py_inplace``: the same with ``MPI.IN_PLACE``;
- ``mpi4jax``: ``mpi4jax.allreduce`` inside ``jax.jit`` on per-rank arrays;
- ``psum``: ``shard_map`` + ``lax.psum`` on the global array;
- ``gspmd``: a ``jax.jit`` sum over the sharded axis, the collective left to XLA.

Two modes: ``loop``, K collectives back to back inside one jitted call
(``lax.fori_loop``; for mpi4py a Python loop), divided by K: the collective itself;
``call``, one dispatch per collective: what a Python loop of jitted calls pays.

Every step feeds the next: ``x <- allreduce(x) + e_r + c_m``, where ``e_r`` is this
rank's pattern (``(i + r) mod P``) and ``c_m`` makes ``x = m + e_r`` after step
``m``. The data change with every step, nothing can be hoisted, and one comparison
at the end of a sample checks every step exactly (integers in floating point). Each
step therefore also does one elementwise pass (two in NumPy) besides the collective.

Method (OSU ``osu_allreduce`` and nccl-tests ``all_reduce_perf`` style): a barrier
before each sample, warm-up and compilation excluded, per sample the slowest rank
counts, min/median/max over samples; ``algbw = bytes / t`` and
``busbw = algbw * 2 (n - 1) / n``; ``ratio`` is the median over the median of
``mpi4py`` in the same mode. ``mem`` is the peak RSS during the timed samples of
one implementation above the RSS before it allocated anything, in units of the
message (from 1 MiB up; on GPU: peak device memory): its buffers, temporaries and
compiled code. An out-of-place reduction shows as one more message.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

IMPLS = ("mpi4py", "mpi4py_inplace", "mpi4jax", "psum", "gspmd")
MODES = ("loop", "call")
DEFAULT_SIZES = [4 * 4**i for i in range(13)]  # 4 B .. 64 MiB
DTYPES = ("float32", "float64", "int32")
MEM_MIN_BYTES = 1 << 20


def parse_sizes(text: str) -> list[int]:
    """Return sizes from ``4,4096,16KiB,1MiB``-style text (bytes per rank)."""
    units = {
        "kib": 1024,
        "mib": 1024**2,
        "gib": 1024**3,
        "kb": 1000,
        "mb": 1000**2,
        "b": 1,
    }
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        for unit, factor in units.items():
            if item.endswith(unit) and item[: -len(unit)].strip().isdigit():
                sizes.append(int(item[: -len(unit)]) * factor)
                break
        else:
            if not item.isdigit():
                raise ValueError(
                    f"--sizes: {item!r} is not a size such as 4096 or 1MiB"
                )
            sizes.append(int(item))
    return sizes


def iterations(nbytes: int, most: int) -> int:
    """Return K for the loop mode: ``most`` for small messages, fewer for large."""
    return max(3, min(most, math.ceil(2**24 / max(nbytes, 1))))


class Impl:
    """One implementation: a state ``x`` (``= m + e`` after ``m`` steps) and steps."""

    def __init__(self, n: int, dtype, comm, iters: int):
        self.n, self.dtype, self.comm, self.iters = n, np.dtype(dtype), comm, iters
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.e = ((np.arange(n) + self.rank) % self.size).astype(self.dtype)
        self.m = 0

    def shift(self, m):
        """The constant that takes ``allreduce(m + e) + e`` to ``m + 1 + e``."""
        size = self.size
        return 1 - (size - 1) * m - size * (size - 1) // 2

    def loop(self):
        """Do ``self.iters`` steps; return when the result is ready."""
        raise NotImplementedError

    def call(self):
        """Do one step; return when the result is ready."""
        raise NotImplementedError

    def reset(self):
        raise NotImplementedError

    def wrong(self) -> int:
        """Return how many elements differ from the exact ``m + e``."""
        return int(np.count_nonzero(self.local() != self.m + self.e))


class Mpi4py(Impl):
    inplace = False

    def __init__(self, *args):
        super().__init__(*args)
        self.x = self.e.copy()
        self.y = None if self.inplace else np.empty_like(self.x)

    def reset(self):
        np.copyto(self.x, self.e)
        self.m = 0

    def _step(self):
        from mpi4py import MPI

        if self.inplace:
            self.comm.Allreduce(MPI.IN_PLACE, self.x, op=MPI.SUM)
            self.x += self.e
        else:
            self.comm.Allreduce(self.x, self.y, op=MPI.SUM)
            np.add(self.y, self.e, out=self.x)
        self.x += self.dtype.type(self.shift(self.m))
        self.m += 1

    def loop(self):
        for _ in range(self.iters):
            self._step()

    def call(self):
        self._step()

    def local(self):
        return self.x


class Mpi4pyInplace(Mpi4py):
    inplace = True


class JaxImpl(Impl):
    """Shared by the JAX implementations: a jitted step and a jitted K-step loop."""

    def __init__(self, *args):
        super().__init__(*args)
        import jax

        self.jax = jax
        self.build()
        self.reset()

    def reset(self):
        self.x, self.m = self.x0, 0

    def loop(self):
        self.x = self.run_loop(self.x, self.m)
        self.x.block_until_ready()
        self.m += self.iters

    def call(self):
        self.x = self.run_step(self.x, self.m)
        self.x.block_until_ready()
        self.m += 1

    def step(self, x, e, m, reduce):
        jnp = self.jax.numpy
        return reduce(x) + e + jnp.asarray(self.shift(m), dtype=x.dtype)

    def fori(self, x, e, m0, reduce):
        def body(k, x):
            return self.step(x, e, m0 + k, reduce)

        return self.jax.lax.fori_loop(0, self.iters, body, x)


class Mpi4jax(JaxImpl):
    def build(self):
        import jax
        import mpi4jax
        from mpi4py import MPI

        def reduce(v):
            return mpi4jax.allreduce(v, op=MPI.SUM, comm=self.comm)

        e = jax.numpy.asarray(self.e)
        self.x0 = e
        self.run_step = jax.jit(lambda x, m: self.step(x, e, m, reduce))
        self.run_loop = jax.jit(lambda x, m0: self.fori(x, e, m0, reduce))

    def local(self):
        return np.asarray(self.x)


class Psum(JaxImpl):
    def build(self):
        import jax
        from jax.sharding import PartitionSpec as P

        import mpi4jax_dist
        from mpi4jax_dist import _jax_compat

        mesh = mpi4jax_dist.global_mesh()
        axis = mesh.axis_names[0]
        e = mpi4jax_dist.to_global(self.e, mesh)
        self.x0 = e

        def reduce(v):
            return jax.lax.psum(v, axis)

        def sharded(f):
            return jax.jit(
                _jax_compat.shard_map(
                    f, mesh=mesh, in_specs=(P(axis), P(axis), P()), out_specs=P(axis)
                )
            )

        step = sharded(lambda x, e, m: self.step(x, e, m, reduce))
        loop = sharded(lambda x, e, m0: self.fori(x, e, m0, reduce))
        self.run_step = lambda x, m: step(x, e, m)
        self.run_loop = lambda x, m0: loop(x, e, m0)

    def local(self):
        import mpi4jax_dist

        return np.asarray(mpi4jax_dist.to_local(self.x))


class Gspmd(JaxImpl):
    """A (P, n) global array sharded by rows; ``x.sum(axis=0)`` left to XLA."""

    def build(self):
        import jax

        import mpi4jax_dist

        mesh = mpi4jax_dist.global_mesh()
        e = mpi4jax_dist.to_global(self.e[None, :], mesh)
        sharding = e.sharding
        self.x0 = e

        def reduce(v):
            total = v.sum(axis=0, keepdims=True)
            return jax.lax.with_sharding_constraint(
                jax.numpy.broadcast_to(total, v.shape), sharding
            )

        step = jax.jit(
            lambda x, e, m: self.step(x, e, m, reduce), out_shardings=sharding
        )
        loop = jax.jit(
            lambda x, e, m0: self.fori(x, e, m0, reduce), out_shardings=sharding
        )
        # Global arrays are arguments, never closed over (JAX refuses the latter).
        self.run_step = lambda x, m: step(x, e, m)
        self.run_loop = lambda x, m0: loop(x, e, m0)

    def local(self):
        import mpi4jax_dist

        return np.asarray(mpi4jax_dist.to_local(self.x))[0]


CLASSES = {
    "mpi4py": Mpi4py,
    "mpi4py_inplace": Mpi4pyInplace,
    "mpi4jax": Mpi4jax,
    "psum": Psum,
    "gspmd": Gspmd,
}


def _device_peak():
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure(
    name: str, nbytes: int, dtype, modes, samples: int, most_iters: int, comm
) -> list[dict]:
    """Measure one implementation at one size in every mode; return result rows."""
    import gc

    import jax

    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    nbytes = n * itemsize
    iters = iterations(nbytes, most_iters)
    on_cpu = jax.default_backend() == "cpu"
    gc.collect()
    base, _ = _harness.rss_bytes()
    impl = CLASSES[name](n, dtype, comm, iters)
    rows, wrong, peak = [], 0, 0
    for mode in modes:
        run = impl.loop if mode == "loop" else impl.call
        steps = iters if mode == "loop" else 1
        impl.reset()
        run()  # warm-up, compilation
        wrong += impl.wrong()
        # The peak over the timed samples: buffers, temporaries, compiled code;
        # not the compiler's own working memory.
        _harness.reset_peak_rss()
        times = []
        for _ in range(samples):
            if mode == "loop":
                impl.reset()
            comm.Barrier()
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / steps)
            wrong += impl.wrong()
        peak = max(peak, _harness.rss_bytes()[1])
        rows.append(
            {
                "impl": name,
                "mode": mode,
                "bytes": nbytes,
                "count": n,
                "dtype": str(np.dtype(dtype)),
                "iters": steps,
                "samples": samples,
                **_harness.summary(_harness.slowest(times, comm)),
            }
        )
    if not on_cpu:
        peak, base = _device_peak(), 0
    rise = None if peak is None else peak - base
    # Below MEM_MIN_BYTES the RSS noise (pages, allocator) exceeds the message.
    mem = None if rise is None or nbytes < MEM_MIN_BYTES else rise / nbytes
    wrong = comm.allreduce(wrong)
    del impl
    for row in rows:
        row["peak_mem_rise_bytes"] = rise
        row["peak_mem_x"] = mem
        row["wrong"] = wrong
        row["algbw_GBps"] = row["bytes"] / row["t_median_s"] / 1e9
        row["busbw_GBps"] = (
            row["algbw_GBps"] * 2 * (comm.Get_size() - 1) / comm.Get_size()
        )
    return rows


HEADER = (
    f"# {'bytes':>10} {'impl':<15} {'mode':<5} {'t_min':>9} {'t_median':>9} "
    f"{'t_max':>9} {'algbw':>7} {'busbw':>7} {'ratio':>6} {'mem':>6} {'wrong':>5}\n"
    f"# {'per rank':>10} {'':<15} {'':<5} {'us':>9} {'us':>9} {'us':>9} "
    f"{'GB/s':>7} {'GB/s':>7} {'':>6} {'x msg':>6} {'':>5}"
)


def format_row(row: dict) -> str:
    ratio = row.get("ratio")
    mem = row.get("peak_mem_x")
    return (
        f"  {row['bytes']:>10} {row['impl']:<15} {row['mode']:<5} "
        f"{row['t_min_s'] * 1e6:>9.1f} {row['t_median_s'] * 1e6:>9.1f} "
        f"{row['t_max_s'] * 1e6:>9.1f} {row['algbw_GBps']:>7.3f} "
        f"{row['busbw_GBps']:>7.3f} {'-' if ratio is None else f'{ratio:.2f}':>6} "
        f"{'-' if mem is None else f'{mem:.1f}':>6} {row['wrong']:>5}"
    )


def plot(results: list[dict], path: str, title: str) -> None:
    """Latency and bus bandwidth against size, log-log, a line per impl and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = sorted(
        {(r["impl"], r["mode"]) for r in results},
        key=lambda k: (IMPLS.index(k[0]), k[1]),
    )
    for impl, mode in keys:
        rows = sorted(
            (r for r in results if (r["impl"], r["mode"]) == (impl, mode)),
            key=lambda r: r["bytes"],
        )
        sizes = [r["bytes"] for r in rows]
        style = dict(
            linestyle="-" if mode == "loop" else "--",
            marker=".",
            color=f"C{IMPLS.index(impl)}",
            label=f"{impl} ({mode})",
        )
        left.plot(sizes, [r["t_median_s"] * 1e6 for r in rows], **style)
        right.plot(sizes, [r["busbw_GBps"] for r in rows], **style)
    for ax, label in (
        (left, "median time per allreduce [us]"),
        (right, "bus bandwidth [GB/s]"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size per rank [bytes]")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    """Run the sweep; return the result rows (on every rank). Exits 1 on a wrong
    element, naming the implementation and size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        help="bytes per rank, comma-separated (4,4096,1MiB); "
        "default 4 B to 64 MiB by powers of 4",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help=f"comma-separated, from {', '.join(IMPLS)}",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="loop,call")
    parser.add_argument(
        "--iters",
        type=int,
        default=50,
        help="K, collectives per loop sample (fewer for large messages)",
    )
    parser.add_argument("--samples", type=int, default=10, help="samples per measure")
    parser.add_argument("--json", metavar="PATH", help="write meta and results here")
    parser.add_argument("--plot", metavar="PNG", help="latency and busbw plot")
    args = parser.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for name in impls:
        if name not in IMPLS:
            parser.error(f"--impls: unknown {name!r}; choose from {', '.join(IMPLS)}")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown {mode!r}; choose from loop, call")

    import jax

    import mpi4jax_dist  # noqa: F401  (registers the MPI cluster env)

    if not jax.distributed.is_initialized():
        jax.distributed.initialize()
    if args.dtype in ("float64",):
        jax.config.update("jax_enable_x64", True)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    meta = _harness.meta(
        comm,
        dtype=args.dtype,
        impls=impls,
        modes=modes,
        iters=args.iters,
        samples=args.samples,
    )
    if rank0:
        print(
            f"# allreduce, {meta['world_size']} ranks on {meta['num_nodes']} "
            f"node(s), {meta['mpi_library']}, jax {meta['versions']['jax']} "
            f"({meta['backend']}, CPU collectives {meta['cpu_collectives']}), "
            f"{args.dtype}"
        )
        print(
            "# time per allreduce: loop = K back to back in one call / K; "
            "call = one dispatch each; slowest rank per sample"
        )
        print(HEADER, flush=True)
    results = []
    for index, nbytes in enumerate(args.sizes):
        if rank0:
            print(
                f"# [{index + 1}/{len(args.sizes)}] {_harness.human_bytes(nbytes)}",
                file=sys.stderr,
                flush=True,
            )
        floor = {}
        for name in impls:
            for row in measure(
                name, nbytes, args.dtype, modes, args.samples, args.iters, comm
            ):
                if name == "mpi4py":
                    floor[row["mode"]] = row["t_median_s"]
                base = floor.get(row["mode"])
                row["ratio"] = None if base is None else row["t_median_s"] / base
                results.append(row)
                if rank0:
                    print(format_row(row), flush=True)
    if rank0 and args.json:
        _harness.write_json(args.json, meta, results)
    if rank0 and args.plot:
        plot(
            results,
            args.plot,
            f"allreduce, {meta['world_size']} ranks, "
            f"{args.dtype}, {meta['backend']}",
        )
    bad = sorted({(r["impl"], r["bytes"]) for r in results if r["wrong"]})
    if bad:
        if rank0:
            for name, nbytes in bad:
                print(
                    f"WRONG: {name} gave wrong elements at {nbytes} bytes per rank",
                    file=sys.stderr,
                )
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
