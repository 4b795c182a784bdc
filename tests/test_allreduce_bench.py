"""A tiny sweep of benchmarks/allreduce.py under mpiexec -n 2 (and 4): every
implementation and mode runs, reports the fields, and gets every element right."""

import pytest
import util

pytestmark = pytest.mark.mpi(min_size=2)


def load_benchmark():
    return util.load_benchmark("allreduce")


def test_tiny_sweep(world, tmp_path_factory):
    from mpi4py import MPI

    bench = load_benchmark()
    path = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("bench") / "ar.json"))
    results = bench.main(
        ["--sizes", "4,4096", "--samples", "2", "--iters", "3", "--json", path]
    )
    keys = {(r["impl"], r["mode"], r["bytes"]) for r in results}
    assert keys == {
        (i, m, b) for i in bench.IMPLS for m in bench.MODES for b in (4, 4096)
    }
    for row in results:
        assert row["wrong"] == 0
        assert 0 < row["t_min_s"] <= row["t_median_s"] <= row["t_max_s"]
        for field in ("algbw_GBps", "busbw_GBps", "ratio", "peak_mem_x"):
            assert field in row
    if MPI.COMM_WORLD.Get_rank() == 0:
        import json

        data = json.load(open(path))
        assert data["meta"]["world_size"] == MPI.COMM_WORLD.Get_size()
        assert data["meta"]["cpu_collectives"] == "gloo"
        assert len(data["results"]) == len(results)


def test_sizes_parse():
    bench = load_benchmark()
    assert bench.parse_sizes("4,4096,16KiB,1MiB") == [4, 4096, 16384, 1 << 20]
    with pytest.raises(ValueError, match="--sizes"):
        bench.parse_sizes("4,lots")
    assert bench.DEFAULT_SIZES[0] == 4 and bench.DEFAULT_SIZES[-1] == 64 << 20
