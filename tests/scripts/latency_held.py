"""One process under the benchmarks' PMPI latency interposer (benchmarks/_latency.py
preloads it, running this script again): what it holds, and what the extension's
wait counters then report. Prints one ``NAME value...`` line per measurement."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import _latency  # noqa: E402

_latency.preload()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpi4jax_dist  # noqa: E402
from mpi4jax_dist.ops import common  # noqa: E402

comm = MPI.COMM_SELF
x = jnp.arange(5.0)


def seconds(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


# MPI's own calls: a blocking allreduce, and a non-blocking one tested then waited.
a, b = np.ones(3), np.empty(3)
_latency.set_us(30_000)  # 30 ms
took, _ = seconds(lambda: comm.Allreduce(a, b))
print("ALLREDUCE", took, flush=True)
# Its wait returns no sooner than the delay after the post (timed from before the
# post: a process kept off its core between post and wait waits the less).
posted = time.perf_counter()
req = comm.Iallreduce(a, b)
early = req.Test()
req.Wait()
print("IALLREDUCE", int(early), time.perf_counter() - posted, flush=True)

# The package's non-blocking allreduce, jitted and eagerly: held, and right.
f = jax.jit(lambda v: mpi4jax_dist.iallreduce(v, comm=comm).wait())
f(x).block_until_ready()
took = min(seconds(lambda: f(x).block_until_ready())[0] for _ in range(3))
y = f(x)
print("JIT", took, int(np.array_equal(np.asarray(y), np.arange(5.0))), flush=True)
took, y = seconds(
    lambda: mpi4jax_dist.iallreduce(x, comm=comm).wait().block_until_ready()
)
print("EAGER", took, int(np.array_equal(np.asarray(y), np.arange(5.0))), flush=True)

# The extension's per-wait counters: slack (post to wait, here a sleep), blocked
# (what the wait then waited), and whether its first MPI_Test completed it.
ext = common.extension()


def one_wait(delay_us, sleep_s):
    _latency.set_us(delay_us)
    ext.reset_stats()
    req = mpi4jax_dist.iallreduce(x, comm=comm)
    time.sleep(sleep_s)
    assert np.array_equal(np.asarray(req.wait()), np.asarray(x))
    stats = ext.stats()
    return (
        stats["iallreduce_waits"],
        stats["iallreduce_done_before_wait"],
        stats["iallreduce_wait_slack_ns"] / 1e6,
        stats["iallreduce_wait_blocked_ns"] / 1e6,
    )


print("WAIT0", *one_wait(0, 0.02), flush=True)
print("WAIT60", *one_wait(60_000, 0.02), flush=True)
_latency.set_us(0)
took, _ = seconds(lambda: comm.Allreduce(a, b))
print("AFTER", took, flush=True)
