"""The allreduce benchmark's exact check can fail: faults it must catch, serially on
the pattern and for real through an injected faulty implementation."""

import numpy as np
import pytest
import util


@pytest.fixture(scope="module")
def bench():
    """The implementations' module, which holds the checked pattern."""
    return util.load_benchmark("_allreduce_impls")


def inputs(bench, n, procs, dtype="float32"):
    return [bench.pattern(n, r, procs, dtype) for r in range(procs)]


@pytest.mark.parametrize("procs", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_expected_is_the_exact_sum(bench, procs, dtype):
    n = 4096
    e = inputs(bench, n, procs, dtype)
    exact = np.sum([x.astype(np.int64) for x in e], axis=0)
    assert np.array_equal(bench.expected(n, procs, dtype).astype(np.int64), exact)
    twice = bench.expected(n, procs, dtype, 2).astype(np.int64)
    assert np.array_equal(twice, procs * exact)
    # The float sum in any order is the exact integer.
    assert np.array_equal(np.sum(e, axis=0), bench.expected(n, procs, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_exact_at_the_largest_world(bench, dtype):
    procs = bench.max_procs(dtype)
    bound = bench.pattern_bound(procs, dtype)
    q = (procs - 1) * procs * (2 * procs - 1) // 6
    largest = procs * (procs * bound + bound * procs * (procs - 1) // 2 + q)
    assert largest < bench.EXACT_BELOW[dtype]
    assert int(np.asarray(largest, dtype)) == largest  # held exactly
    with pytest.raises(ValueError, match=f"--dtype {dtype}.*{procs} ranks"):
        bench.pattern_bound(procs + 1, dtype)


def faults(bench, n, procs):
    """Return ``{name: result}`` of wrong results an allreduce could give."""
    e = inputs(bench, n, procs)
    s = bench.expected(n, procs, "float32")
    value = s.copy()
    value[n // 3] += 1
    found = {
        "roll": np.roll(s, 1),
        "reverse": s[::-1].copy(),
        "one element broadcast": np.full_like(s, s[0]),
        "value": value,
        "shorter": s[:-1],
    }
    for r in range(procs):
        found[f"rank {r}'s data"] = e[r]
        found[f"P times rank {r}'s data"] = procs * e[r]
    return found


@pytest.mark.parametrize("procs", [2, 3, 4, 5])
def test_every_fault_is_counted_wrong(bench, procs):
    n = 1000
    s = bench.expected(n, procs, "float32")
    assert bench.count_wrong(s.copy(), s) == 0
    for name, result in faults(bench, n, procs).items():
        assert bench.count_wrong(result, s) > 0, name
    # A permutation moves almost every element to a different value.
    assert bench.count_wrong(np.roll(s, 1), s) > 0.99 * n


def test_old_pattern_missed_a_rolled_result():
    """Why the pattern changed: with ``e_r(i) = (i + r) mod P`` (the benchmark up
    to commit 488c2ef) every index sums to ``P (P - 1) / 2``, so a rolled, reversed
    or broadcast result is right at every element."""
    n, procs = 1000, 2
    old = [((np.arange(n) + r) % procs).astype(np.float32) for r in range(procs)]
    s = np.sum(old, axis=0)
    assert np.all(s == procs * (procs - 1) // 2)
    for fault in (np.roll(s, 1), s[::-1], np.full_like(s, s[0])):
        assert np.count_nonzero(fault != s) == 0


def test_pattern_differs_between_ranks_and_indices(bench):
    n, procs = 4096, 3
    e = inputs(bench, n, procs)
    assert not np.array_equal(e[0], e[1])
    s = bench.expected(n, procs, "float32")
    assert len(np.unique(s)) > n // 4
    # Neighbours almost never share a value: what makes a roll visible.
    assert np.count_nonzero(s[1:] == s[:-1]) < n // 100


@util.skip_in_mpi_job
def test_injected_permutations_fail_the_run():
    """mpi4jax followed by a roll or a reversal: the run exits 1 naming each."""
    proc = util.run_mpi(
        "faulty_allreduce.py",
        2,
        "--sizes",
        "4096",
        "--samples",
        "1",
        "--iters",
        "3",
        "--loop-iters",
        "3",
        timeout=180,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    for impl in ("mpi4jax_rolled", "mpi4jax_reversed"):
        for mode in ("call", "loop"):
            assert f"WRONG: {impl} {mode} at 4096 bytes per rank: " in out, out
    assert "WRONG: mpi4jax " not in out, out
