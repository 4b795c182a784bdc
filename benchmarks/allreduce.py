"""mpi4jax.allreduce against shard_map/psum and XLA's own, with raw mpi4py as the floor.

    mpiexec -n 2 python benchmarks/allreduce.py [--sizes 4,4096,...|pow2]
        [--dtype float32] [--impls mpi4py,mpi4jax,psum,...] [--modes loop,call]
        [--iters K] [--loop-iters K] [--samples N] [--json PATH] [--plot PNG]

One initialized job (``import mpi4jax_dist`` and a plain
``jax.distributed.initialize()``) times, per message size (bytes per rank), the
implementations of ``_allreduce_impls.IMPLS``: ``loop`` (K and 2K allreduces in one
dispatch, split by :func:`_harness.fit_trips` into the collective and ``fixed``) and
``call`` (K jitted calls, one dispatch each, over K), each result checked exactly
outside the timing (a wrong element fails the run: exit 1, a ``WRONG:`` line).
docs/benchmarks.rst, *The allreduce*, gives the method, how to read the table and
the runs; what this script no longer asks (settled): docs/benchmarks-settled.rst.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
from _allreduce_impls import (  # noqa: E402
    DEFAULT_IMPLS,
    DTYPES,
    IMPLS,
    count_wrong,
    expected,
    pattern,
    pattern_bound,
)

MODES = ("loop", "call")
DEFAULT_SIZES = [4 * 8**i for i in range(9)]  # 4 B .. 64 MiB
POW2_SIZES = [4 * 2**i for i in range(25)]  # --sizes pow2: every power of two, as OSU


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: ``pow2`` (every power of two from 4 B to 64 MiB, as OSU's
    benchmarks step), or sizes as ``_harness.parse_sizes`` reads them."""
    if text.strip().lower() == "pow2":
        return list(POW2_SIZES)
    return _harness.parse_sizes(text)


def _percent(spread: float) -> str:
    return f"{100 * spread:.0f}%"


def _wide(wide: bool) -> str:
    return "wide" if wide else ""


def _fixed(row: dict) -> str:
    """The fixed part in us; ``<X`` where the samples bound it without resolving
    it; ``-`` where there is none (mpi4py's loop, call mode)."""
    if row["fixed_s"] is not None:
        return f"{row['fixed_s'] * 1e6:.1f}"
    if row.get("fixed_at_most_s"):
        return f"<{row['fixed_at_most_s'] * 1e6:.0f}"
    if row.get("fixed_at_most_s") == 0:
        return "~0"
    return "-"


# --- The sweep ------------------------------------------------------------------------


def check(impls: dict, n: int, comm, wrong: dict, checked: dict) -> None:
    """Add to ``wrong[(name, mode)]`` the wrong elements (summed over ranks) of
    ``call`` and ``loop(1)`` (both ``S``) and ``loop(2)`` (``P S``) from the
    pattern, and to ``checked[(name, mode)]`` the elements compared; untimed.
    Leaves every implementation loaded with zeros."""
    rank, procs = comm.Get_rank(), comm.Get_size()
    dtype = next(iter(impls.values())).dtype
    mine = pattern(n, rank, procs, dtype)
    once, twice = expected(n, procs, dtype), expected(n, procs, dtype, 2)
    zeros = np.zeros(n, dtype)
    local = []
    for impl in impls.values():
        # (wrong, compared): the elements of each result as it came back
        impl.load(mine)
        impl.call()
        call = (count_wrong(impl.result(), once), np.size(impl.result()))
        impl.load(mine)
        impl.loop(1)
        loop = [count_wrong(impl.result(), once), np.size(impl.result())]
        impl.load(mine)
        impl.loop(2)
        loop[0] += count_wrong(impl.result(), twice)
        loop[1] += np.size(impl.result())
        impl.load(zeros)
        local += [call[0], loop[0], call[1], loop[1]]
    total = comm.allreduce(np.asarray(local, np.int64))
    for index, name in enumerate(impls):
        wrong[(name, "call")] += int(total[4 * index])
        wrong[(name, "loop")] += int(total[4 * index + 1])
        checked[(name, "call")] += int(total[4 * index + 2])
        checked[(name, "loop")] += int(total[4 * index + 3])


def measure(
    names, nbytes: int, dtype, modes, samples: int, most: int, comm, loop_most=None
) -> list[dict]:
    """Build every implementation at one size, check, time, check; return rows.

    ``most`` is ``call``'s K, ``loop_most`` ``loop``'s (default ``most``), each
    fewer for large messages (:func:`_harness.steps_for`)."""
    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    nbytes = n * itemsize
    steps = _harness.steps_for(nbytes, most)
    loop_steps = _harness.steps_for(nbytes, loop_most or most)
    impls = {name: IMPLS[name](n, dtype, comm) for name in names}
    wrong = {(name, mode): 0 for name in names for mode in MODES}
    checked = dict(wrong)
    check(impls, n, comm, wrong, checked)
    # Round-robin within each transport, one transport after the other: MPI
    # collectives run within a few ms after XLA's gloo ones are slowed (256 B:
    # 13 us instead of 3), which made mpi4py and mpi4jax rows 2-15x too slow
    # when interleaved with psum and gspmd.
    # loop: K and 2K collectives in one dispatch each, in the same round; the
    # difference over K is the collective alone, what is left the fixed part.
    groups = {}
    for name, impl in impls.items():
        group = groups.setdefault(impl.transport, ([], []))
        around = impl.around  # a variant's setting on around its own blocks
        for mode in modes:
            if mode == "loop":
                for trips in (loop_steps, 2 * loop_steps):
                    group[0].append((name, mode, trips))
                    group[1].append(around(lambda impl=impl, k=trips: impl.loop(k)))
            else:
                group[0].append((name, mode, steps))
                group[1].append(
                    around(lambda impl=impl: [impl.call() for _ in range(steps)])
                )
    keys, times = [], []
    # The checks have run every executable: nothing is left to compile.
    with _harness.Compiles() as compiled:
        for group_keys, cases in groups.values():
            keys += group_keys
            times += _harness.time_rounds(cases, comm, samples)
    check(impls, n, comm, wrong, checked)
    del impls
    gc.collect()
    procs = comm.Get_size()
    timed = dict(zip(keys, times, strict=True))
    rows = []
    for name, mode, trips in keys:
        if trips != (loop_steps if mode == "loop" else steps):
            continue  # the 2K-trip loop, taken with the K-trip one
        # what was timed: seconds per sample, by trip count (K and 2K, or K)
        counts = (trips, 2 * trips) if mode == "loop" else (trips,)
        raw = {k: timed[(name, mode, k)] for k in counts}
        if mode == "loop":
            fit = _harness.fit_trips(raw, dispatched=IMPLS[name].uses_jax)
        else:
            fit = _harness.LoopFit([t / trips for t in raw[trips]], None)
        row = {
            "bytes": nbytes,
            "impl": name,
            "mode": mode,
            "transport": IMPLS[name].transport,
            "in_place": IMPLS[name].in_place,
            "count": n,
            "dtype": np.dtype(dtype).name,
            "steps": trips,
            "samples": samples,
            **_harness.summary(fit.per_trip),
            # loop: what one dispatch of the loop adds, whatever its trip count,
            # where the samples resolve it, else the most it can be
            "fixed_s": fit.fixed,
            "fixed_at_most_s": fit.fixed_at_most,
            # to fit again from what ran
            "raw_s": {str(k): v for k, v in raw.items()},
        }
        row["algbw_GBps"] = nbytes / row["t_median_s"] / 1e9
        row["busbw_GBps"] = row["algbw_GBps"] * 2 * (procs - 1) / procs
        row["wrong"] = wrong[(name, mode)]
        row["checked"] = checked[(name, mode)]
        row["compiles"] = compiled.count  # during the timing, all cases together
        rows.append(row)
    for row in rows:
        base = ratio_base(rows, row)
        row["ratio_over"] = base and base["impl"]
        row["ratio"] = base and row["t_median_s"] / base["t_median_s"]
    return rows


def ratio_base(rows: list[dict], row: dict) -> dict | None:
    """The MPI row a row's ``ratio`` is over, in its mode and size: an in-place
    row's over ``mpi4py_inplace`` (``mpi4py``'s where that was not run), the
    others' over ``mpi4py``; None where neither ran."""
    order = ("mpi4py_inplace", "mpi4py") if row["in_place"] else ("mpi4py",)
    for name in order:
        for base in rows:
            if base["impl"] == name and base["mode"] == row["mode"]:
                return base
    return None


WIDTH = 120  # the printed lines', at most

# One row per size and implementation, a table per mode, as OSU's and nccl-tests'
# tables read (within 120 columns); the JSON holds every field (elements, K, the
# samples, the mean, the samples as timed).
TABLE = _harness.Table(
    [
        _harness.Column("bytes", "bytes", "per rank", 10),
        _harness.Column("impl", "impl", "", 22, left=True),
        _harness.Column("t_min_s", "t_min", "us", 9, ".1f", 1e6),
        _harness.Column("t_median_s", "t_median", "us", 9, ".1f", 1e6),
        _harness.Column("t_max_s", "t_max", "us", 9, ".1f", 1e6),
        _harness.Column("t_spread", "spread", "+-", 6, _percent),
        _harness.Column("algbw_GBps", "algbw", "GB/s", 7, ".3f"),
        _harness.Column("busbw_GBps", "busbw", "GB/s", 7, ".3f"),
        _harness.Column("ratio", "ratio", "/MPI", 5, ".2f"),
        _harness.Column("fixed_s", "fixed", "us", 7, text=_fixed),
        _harness.Column("wrong", "wrong", "", 5),
        _harness.Column("t_wide", "", "", 4, _wide, left=True),
    ]
)

# What the tables' header says of their columns, under the titles' line.
LEGEND = (
    "# t_*: per allreduce over the samples; ratio: t_median over mpi4py_inplace's "
    "for in-place rows (mpi4py_inplace, mpi4jax_dist), over mpi4py's for the "
    "others, same mode and size",
    "# algbw = bytes / t_median, busbw = algbw * 2(P-1)/P; fixed: what one "
    "dispatch adds to the loop (<X: at most X; ~0: too small to see; -: none)",
    "# wrong: elements that differ from the expected sum",
)


def mode_title(mode: str, args) -> list[str]:
    """The lines over a mode's table: what its times are."""
    if mode == "loop":
        return [
            f"# loop: x <- allreduce(x) K and 2K times in one dispatch (K = "
            f"{args.loop_iters}, fewer for large messages),",
            "#   less 'fixed' (the dispatch), over K: the collective alone",
        ]
    return [
        f"# call: K jitted calls of one allreduce (K = {args.iters}, fewer for "
        "large messages), one dispatch each, over K:",
        "#   the collective with its dispatch",
    ]


def closing_lines(results: list[dict]) -> list[str]:
    """The summary under the table (as nccl-tests closes with its average bus
    bandwidth and its out-of-bounds count): wrong values of those checked, and
    per implementation and mode the mean bus bandwidth over the sizes."""
    wrong = sum(r["wrong"] for r in results)
    checked = sum(r["checked"] for r in results)
    verdict = "OK" if wrong == 0 else "WRONG"
    lines = [f"# wrong values: {wrong} of {checked:,} checked {verdict}"]
    series = dict.fromkeys((r["impl"], r["mode"]) for r in results)
    for impl, mode in series:
        rows = [r for r in results if (r["impl"], r["mode"]) == (impl, mode)]
        mean = sum(r["busbw_GBps"] for r in rows) / len(rows)
        lines.append(
            f"# avg bus bandwidth, {impl} ({mode}), {len(rows)} sizes: "
            f"{mean:.3f} GB/s"
        )
    return lines


def plot(results: list[dict], path: str, title: str) -> None:
    """Median time per allreduce against size, a line per implementation and mode
    (a colour per implementation; loop solid with dots and its quartiles shaded,
    call dashed with crosses); bus bandwidth is the table's."""
    import matplotlib.pyplot as plt

    names = IMPLS.names()
    fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
    for impl, mode in dict.fromkeys((r["impl"], r["mode"]) for r in results):
        rows = [r for r in results if (r["impl"], r["mode"]) == (impl, mode)]
        rows.sort(key=lambda r: r["bytes"])
        xs, loop = [r["bytes"] for r in rows], mode == "loop"
        color = f"C{names.index(impl) if impl in names else len(names)}"
        ax.plot(
            xs,
            [r["t_median_s"] * 1e6 for r in rows],
            label=f"{impl} ({mode})",
            color=color,
            linestyle="-" if loop else "--",
            marker="o" if loop else "x",
            markersize=3 if loop else 5,
        )
        if loop:
            low, high = ([r[k] * 1e6 for r in rows] for k in ("t_q1_s", "t_q3_s"))
            ax.fill_between(xs, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="message size per rank [bytes]", ylabel="median time [us]")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        help="bytes per rank, comma-separated (4,4096,1MiB), or pow2 (every power "
        "of two from 4 B to 64 MiB, as OSU's benchmarks); default 4 B to 64 MiB by "
        "powers of 8",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    IMPLS.option(
        parser,
        "--impls",
        DEFAULT_IMPLS,
        " (default: all but the variants mpi4jax_dist_unchecked and _timeline)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="loop,call")
    parser.add_argument(
        "--iters",
        type=int,
        default=50,
        help="K of call mode: dispatches per timed sample (fewer for large "
        "messages, about 16 MiB moved per sample, at least 3)",
    )
    parser.add_argument(
        "--loop-iters",
        type=int,
        default=500,
        help="K of loop mode: each sample runs K and 2K trips (fewer for large "
        "messages, as --iters); K times a small allreduce must exceed the "
        "dispatch's jitter (tens to hundreds of us) for the difference to show it",
    )
    parser.add_argument("--samples", type=int, default=10, help="timed samples")
    _harness.add_output_arguments(parser, plot=True)
    args = parser.parse_args(argv)
    for flag, value in (("--iters", args.iters), ("--loop-iters", args.loop_iters)):
        if value < 1:
            parser.error(f"{flag} {value}: expected 1 or more")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown {mode!r}; choose from loop, call")
    return args


def main(argv=None) -> list[dict]:
    """Run the sweep; return the result rows (on every rank). ``SystemExit`` 1
    after it where an element was wrong (``WRONG:`` lines), 2 for bad arguments."""
    args = parse_args(argv)

    # mpi4jax_dist first: with MPI4JAX_DIST_CPU_COLLECTIVES=mpi it must reach jaxlib
    # before jaxlib loads.
    import mpi4jax_dist  # noqa: F401, I001  (registers the MPI cluster env)

    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    if not jax.distributed.is_initialized():
        jax.distributed.initialize()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mpi4jax_note = _harness.import_mpi4jax_explained()
    try:
        pattern_bound(comm.Get_size(), args.dtype)
    except ValueError as err:
        _harness.say(comm, f"allreduce.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    meta = _harness.meta(
        comm,
        dtype=args.dtype,
        impls=args.impls,
        modes=args.modes,
        iters=args.iters,
        loop_iters=args.loop_iters,
        samples=args.samples,
        pattern="e_r(i) = a(i) + c(i) r + r^2, a and c in [0, "
        f"{pattern_bound(comm.Get_size(), args.dtype)}] from a hash of i",
    )
    _harness.say(
        comm,
        *_harness.within(
            WIDTH,
            f"# allreduce, {meta['world_size']} ranks on {meta['num_nodes']} node(s), "
            f"{meta['mpi_library']} (thread level {meta['thread_level']}), "
            f"jax {meta['versions']['jax']} ({meta['backend']}, "
            f"CPU collectives {meta['cpu_collectives']}), {args.dtype}",
            _harness.pages_line(meta),
            _harness.hang_line(meta),
            *filter(None, [mpi4jax_note]),
            f"# time per allreduce, the slowest rank's, {args.samples} samples, each "
            "result checked outside the timing",
            f"# spread: half the quartiles' distance over the median; 'wide' above "
            f"{100 * _harness.WIDE:.0f}% (a busy machine): read such a median to a "
            "factor of 1.5",
            *LEGEND,
            "",
            *mode_title(args.modes[0], args),
        ),
        TABLE.header(),
    )
    results, later = [], []
    for index, nbytes in enumerate(args.sizes):
        _harness.say(
            comm,
            f"# [{index + 1}/{len(args.sizes)}] {_harness.human_bytes(nbytes)}",
            file=sys.stderr,
        )
        rows = measure(
            args.impls,
            nbytes,
            args.dtype,
            args.modes,
            args.samples,
            args.iters,
            comm,
            loop_most=args.loop_iters,
        )
        results += rows
        # The first mode's rows as they come; the others' in tables of their own.
        _harness.say(comm, *(TABLE.row(r) for r in rows if r["mode"] == args.modes[0]))
        later += [r for r in rows if r["mode"] != args.modes[0]]
    for mode in args.modes[1:]:
        _harness.say(
            comm,
            "",
            *mode_title(mode, args),
            TABLE.header(),
            *(TABLE.row(r) for r in later if r["mode"] == mode),
        )
    _harness.say(comm, "", *closing_lines(results))
    _harness.save(
        args,
        meta,
        results,
        plot=lambda rows, path: plot(
            rows,
            path,
            f"allreduce, {meta['world_size']} ranks, {args.dtype}, {meta['backend']}",
        ),
        comm=comm,
    )
    bad = [r for r in results if r["wrong"]]
    if bad:
        _harness.say(
            comm,
            *(
                f"WRONG: {r['impl']} {r['mode']} at {r['bytes']} bytes per rank: "
                f"{r['wrong']} elements"
                for r in bad
            ),
            file=sys.stderr,
        )
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    with _harness.results_on_stdout():  # the table alone on stdout, no [Gloo] lines
        main()
