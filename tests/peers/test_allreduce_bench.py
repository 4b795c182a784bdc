"""A tiny sweep of benchmarks/allreduce.py under mpiexec -n 2 (and 4): every
implementation and mode runs, reports the fields, and gets every element right;
the JAX implementations run what was compiled ahead of time."""

import json
import os

import numpy as np
import pytest
import util

pytestmark = pytest.mark.mpi(min_size=2)


def load_benchmark():
    return util.load_benchmark("allreduce")


def test_fit_finds_a_known_cost_under_injected_jitter(world):
    """The loop rows' method on real loops whose cost is known: each sleeps a
    fixed 30 ms, then 2 ms per trip, timed as the benchmark times its loops (K and
    2K trips in each round, slowest rank per round). A busy machine is injected: 3
    of the 10 K-trip samples and 2 of the 2K-trip ones sleep 40 ms more. The fit
    still finds 2 ms a trip and the 30 ms, and no time comes out negative; the
    difference of each round's two samples, the method before, goes negative in
    the slowed rounds, and dividing the K-trip time by K, the method before that,
    gives 2 + 30/K."""
    import time

    from mpi4py import MPI

    harness = load_benchmark()._harness
    fixed_s, trip_s, k, late_s = 0.030, 0.002, 5, 0.040
    slowed = {k: {1, 4, 7}, 2 * k: {2, 8}}  # rounds whose sample is slowed
    rounds = {k: 0, 2 * k: 0}

    def loop(trips):
        def run():
            late = late_s if rounds[trips] in slowed[trips] else 0.0
            rounds[trips] += 1
            time.sleep(fixed_s + trips * trip_s + late)

        return run

    short, long = harness.time_rounds([loop(k), loop(2 * k)], MPI.COMM_WORLD, 10, 0)
    fit = harness.fit_trips({k: short, 2 * k: long})
    row = harness.summary(fit.per_trip)
    assert row["t_median_s"] == pytest.approx(trip_s, rel=0.25), fit
    assert fit.fixed == pytest.approx(fixed_s, rel=0.15), fit
    assert row["t_min_s"] >= 0 and row["t_min_s"] <= row["t_median_s"] <= row["t_max_s"]
    differences = [(b - a) / k for a, b in zip(short, long, strict=True)]
    assert min(differences) < 0, differences  # what the rows printed before
    divided = sorted(t / k for t in short)[5]
    assert divided > trip_s + 0.8 * fixed_s / k
    # mpi4py's loop has no dispatch: no fixed part is fitted
    assert harness.fit_trips({k: short, 2 * k: long}, dispatched=False).fixed is None
    with pytest.raises(ValueError, match="need two or more"):
        harness.fit_trips({k: short})


# busbw = algbw * 2 (P - 1) / P is algbw itself at P = 2; every implementation's
# sum over more than a pair
@util.more_ranks
def test_tiny_sweep(world, tmp_path_factory):
    from mpi4py import MPI

    bench = load_benchmark()
    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path_factory.mktemp("bench") / "ar.json"))
    png = path[: -len(".json")] + ".png"
    # 4100 bytes: a count that is not a power of two.
    results = bench.main(
        ["--sizes", "4,4100", "--samples", "2", "--iters", "3", "--loop-iters", "3"]
        + ["--json", path, "--plot", png]
    )
    keys = {(r["impl"], r["mode"], r["bytes"]) for r in results}
    assert keys == {
        (i, m, b) for i in bench.DEFAULT_IMPLS for m in bench.MODES for b in (4, 4100)
    }
    for row in results:
        assert row["wrong"] == 0, row
        assert row["compiles"] == 0, row
        assert 0 <= row["t_min_s"] <= row["t_median_s"] <= row["t_max_s"], row
        assert row["mode"] == "loop" or row["t_min_s"] > 0
        assert row["t_spread"] is None or row["t_spread"] >= 0, row
        assert isinstance(row["t_wide"], bool), row
        assert row["steps"] == 3 and row["samples"] == 2
        assert row["busbw_GBps"] == pytest.approx(
            row["algbw_GBps"] * 2 * (comm.Get_size() - 1) / comm.Get_size()
        )
        fixed = (row["fixed_s"], row["fixed_at_most_s"])
        if row["mode"] == "loop" and row["impl"] not in ("mpi4py", "mpi4py_inplace"):
            # resolved, or bounded (3 trips, 2 samples)
            assert [f is None for f in fixed].count(True) == 1, row
            assert all(f >= 0 for f in fixed if f is not None), row
        else:  # no dispatch in mpi4py's loop; none counted in call mode
            assert fixed == (None, None), row
        # the samples as timed: the row's figures come from them alone
        raw = {int(k): v for k, v in row["raw_s"].items()}
        if row["mode"] == "loop":
            fit = bench._harness.fit_trips(raw, dispatched=fixed != (None, None))
            per_call = fit.per_trip
        else:
            per_call = [t / row["steps"] for t in raw[row["steps"]]]
        assert bench._harness.summary(per_call)["t_median_s"] == row["t_median_s"]
        assert row["ratio"] > 0
        # In-place rows over the in-place MPI row, the others over mpi4py's.
        over = "mpi4py_inplace" if row["in_place"] else "mpi4py"
        assert row["ratio_over"] == over, row
        if row["impl"] == over:
            assert row["ratio"] == 1.0
        # Counted as compared, on every rank, before and after the timing:
        # call's result once, loop(1)'s and loop(2)'s.
        per_check = row["count"] * (2 if row["mode"] == "loop" else 1)
        assert row["checked"] == 2 * per_check * comm.Get_size(), row
        assert row["in_place"] == (row["impl"] in ("mpi4py_inplace", "mpi4jax_dist"))
    closing = bench.closing_lines(results)
    checked = sum(r["checked"] for r in results)
    assert closing[0] == f"# wrong values: 0 of {checked:,} checked OK", closing
    assert len(closing) == 1 + len(bench.DEFAULT_IMPLS) * len(bench.MODES)
    ok = True
    if comm.Get_rank() == 0:
        with open(path) as f:
            data = json.load(f)
        ok = (
            data["meta"]["world_size"] == comm.Get_size()
            and data["meta"]["cpu_collectives"] == "gloo"
            and data["meta"]["impls"] == bench.DEFAULT_IMPLS
            and "pattern" in data["meta"]
            and len(data["results"]) == len(results)
            and os.path.exists(png)
        )
    util.all_ranks(ok, "the JSON file lacks meta or results")


@pytest.mark.parametrize(
    "name", ["mpi4py", "mpi4py_inplace", "mpi4jax", "mpi4jax_dist", "psum", "gspmd"]
)
def test_interface_and_no_compilation_after_construction(world, name):
    """Each record: built, loaded, ``call`` and ``loop(k)`` give the exact results,
    and (JAX) nothing compiles after the constructor."""
    from mpi4py import MPI

    bench = load_benchmark()
    comm = MPI.COMM_WORLD
    rank, procs = comm.Get_rank(), comm.Get_size()
    n = 10
    impl = bench.IMPLS[name](n, "float32", comm)
    mine = bench.pattern(n, rank, procs, "float32")
    sum_ = bench.expected(n, procs, "float32")
    wrong = []
    with bench._harness.Compiles() as compiled:
        for run, want in (
            (impl.call, sum_),
            (lambda: impl.loop(1), sum_),
            (lambda: impl.loop(3), procs**2 * sum_),
        ):
            impl.load(mine)
            run()
            got = impl.result()  # valid until the next load, call or loop
            wrong.append(bench.count_wrong(got, want))
    util.all_ranks(
        wrong == [0, 0, 0] and compiled.count == 0,
        f"wrong {wrong}, compiled {compiled.names}",
    )
    assert isinstance(got, np.ndarray) and got.shape == (n,)


def test_mpi4jax_dist_is_donated_and_in_place(world):
    """The new op's record: each call and loop reduces the loaded buffer itself
    (the result is the input's buffer, the handler saw one buffer per call) and
    XLA plans no temporary message for a call."""
    from mpi4py import MPI

    from mpi4jax_dist import _ffi

    bench = load_benchmark()
    comm = MPI.COMM_WORLD
    rank, procs = comm.Get_rank(), comm.Get_size()
    n = 1 << 16
    impl = bench.IMPLS["mpi4jax_dist"](n, "float32", comm)
    ext = _ffi.load()
    mine = bench.pattern(n, rank, procs, "float32")
    problems = []
    for name, run, calls, reductions in (
        ("call", impl.call, 1, 1),
        ("loop(3)", lambda: impl.loop(3), 3, 3),
    ):
        impl.load(mine)
        loaded = impl.x.unsafe_buffer_pointer()
        ext.reset_stats()
        run()
        stats = ext.stats()
        if impl.y.unsafe_buffer_pointer() != loaded:
            problems.append(f"{name}: the result is not the donated buffer")
        if stats["same_buffer_calls"] != calls or stats["handler_calls"] != calls:
            problems.append(f"{name}: {stats}")
        want = bench.expected(n, procs, "float32", reductions)
        if bench.count_wrong(impl.result(), want):
            problems.append(f"{name}: wrong")
        if impl.x is not impl.y:
            problems.append(f"{name}: the result is not the next input")
    temp = impl.executables["one"].memory_analysis().temp_size_in_bytes
    if temp != 0:
        problems.append(f"XLA plans {temp} temp bytes for a call")
    util.all_ranks(not problems, problems)


def test_defaults_and_sizes(world):
    bench = load_benchmark()
    assert bench.DEFAULT_SIZES[0] == 4 and bench.DEFAULT_SIZES[-1] == 64 << 20
    # The main job compares every implementation (the JAX-native ones were
    # left out when the default list was made before they were registered).
    assert bench.DEFAULT_IMPLS == [
        "mpi4py",
        "mpi4py_inplace",
        "mpi4jax",
        "mpi4jax_dist",
        "psum",
        "gspmd",
    ]
    assert bench.parse_args(["--sizes", "pow2"]).sizes == [4 << i for i in range(25)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "mpi4py,nccl"])
    args = bench.parse_args([])
    assert (args.iters, args.loop_iters) == (50, 500)
    for flag in ("--iters", "--loop-iters"):
        with pytest.raises(SystemExit):
            bench.parse_args([flag, "0"])


def test_closing_lines_say_wrong_values(world):
    """The summary under the table says WRONG where an element was wrong, and
    averages each series' bus bandwidth over its sizes."""
    bench = load_benchmark()
    rows = [
        {"impl": "a", "mode": "loop", "wrong": 0, "checked": 8, "busbw_GBps": 1.0},
        {"impl": "a", "mode": "loop", "wrong": 3, "checked": 8, "busbw_GBps": 3.0},
    ]
    assert bench.closing_lines(rows) == [
        "# wrong values: 3 of 16 checked WRONG",
        "# avg bus bandwidth, a (loop), 2 sizes: 2.000 GB/s",
    ]
