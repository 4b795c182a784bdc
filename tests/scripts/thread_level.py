"""The compiled ops at the thread level MPI provides (tests/jobs/test_thread_level.py).

    MPI4PY_RC_THREAD_LEVEL=serialized mpiexec -n 2 python tests/scripts/thread_level.py

mpi4py asks for the level in MPI4PY_RC_THREAD_LEVEL; the MPI may give less (Cray
MPICH: what MPICH_MAX_THREAD_SAFETY allows). At SERIALIZED or MULTIPLE each rank
runs the blocking allreduce (eager, jitted, in chunks, in a loop), the
non-blocking one (start, test, overlapped work, wait), and cg in every variant,
and compares with mpi4py's own results; meanwhile a Python thread registers a
communicator again and again, beside a running program: the one caller besides
XLA's threads. Below SERIALIZED each op must refuse. Each rank prints one line
``RESULT {json}``: the level, what it saw, and the extension's counts.
"""

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpi4jax_dist
from mpi4jax_dist import _ffi, _mpi
from mpi4jax_dist.cg import VARIANTS

jax.config.update("jax_enable_x64", True)
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
ext = _ffi.load()
level = MPI.Query_thread()
result = {"rank": rank, "level": _mpi.thread_level_name(level)}


def exact(n, seed):
    """Integers as float64, whose sum is exact in any order."""
    return np.random.default_rng(seed + rank).integers(-1000, 1000, n).astype("f8")


def mpi_sum(x):
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=MPI.SUM)
    return out


def refusals():
    """What each op says below SERIALIZED (None: it ran)."""
    said = {}
    x = jnp.ones(4)
    ops = {
        "allreduce": lambda: mpi4jax_dist.allreduce(x),
        "iallreduce": lambda: mpi4jax_dist.iallreduce(x).wait(),
        "cg": lambda: mpi4jax_dist.cg(lambda v: 2.0 * v, x, comm=comm),
    }
    for name, op in ops.items():
        try:
            jax.block_until_ready(op())
            said[name] = None
        except RuntimeError as error:
            said[name] = str(error)
    return said


def overlapped(x, w):
    req = mpi4jax_dist.iallreduce(x)
    req, a = req.overlap(lambda v: jnp.sin(v) * 2, w)
    req = req.test()
    req, b = req.overlap(lambda v: jnp.sum(v * v), a)
    return req.wait(), b


def runs():
    """The ops' results against mpi4py's: the largest difference of each."""
    errors = {}
    small = exact(1, 1)
    errors["allreduce 8 B eager"] = mpi4jax_dist.allreduce(small) - mpi_sum(small)
    big = exact(1 << 17, 2)  # 1 MiB, in 256 KiB chunks (the test sets the size)
    errors["allreduce 1 MiB chunked"] = jax.jit(mpi4jax_dist.allreduce)(big) - mpi_sum(
        big
    )

    def loop(v):
        return jax.lax.fori_loop(0, 50, lambda i, u: mpi4jax_dist.allreduce(u), v)

    expected = small.copy()
    for _ in range(50):
        expected = mpi_sum(expected)
    errors["allreduce x50 in a loop"] = jax.jit(loop)(small) - expected
    mid = exact(1000, 3)
    got, _ = jax.jit(overlapped)(mid, jnp.ones(64))
    errors["iallreduce start/test/overlap/wait"] = got - mpi_sum(mid)
    errors["iallreduce eager"] = mpi4jax_dist.iallreduce(mid).wait() - mpi_sum(mid)

    # cg on vectors split over the ranks: A = diag(d), d local; every variant.
    d = 2.0 + np.arange(rank * 8, rank * 8 + 8, dtype="f8")
    b = exact(8, 4)
    for variant in VARIANTS:
        x, info = mpi4jax_dist.cg(
            lambda v: jnp.asarray(d) * v, b, tol=1e-12, comm=comm, variant=variant
        )
        errors[f"cg {variant}"] = np.asarray(x) - b / d
    return {k: float(np.max(np.abs(v))) for k, v in errors.items()}


def beside_a_program():
    """Register the world's communicator from a Python thread, again and again,
    while a jitted loop of allreduces runs: under the lock the thread waits its
    turn (std::mutex is not fair: it may get few), nothing hangs, and the
    program's value stays right. 2,000 under the lock, whose sections the test
    counts; 500 at MPI_THREAD_MULTIPLE, where the thread's calls slow each of
    them to about 3 ms (6.6 s for 2,000 on an idle 2-core machine)."""
    steps = 2000 if level == MPI.THREAD_SERIALIZED else 500
    handle = comm.py2f()
    stop = threading.Event()
    registered = []

    def register():
        while not stop.is_set():
            registered.append(ext.register_comm(handle))

    def loop(v):
        body = lambda i, u: mpi4jax_dist.allreduce(u) / size  # noqa: E731
        return jax.lax.fori_loop(0, steps, body, v)

    x = jnp.ones(1)
    f = jax.jit(loop)
    f(x).block_until_ready()  # compiled, and the communicator checked
    thread = threading.Thread(target=register)
    before = ext.stats()["locked_sections"]
    thread.start()
    out = f(x).block_until_ready()
    stop.set()
    thread.join()
    return {
        "value": float(out[0]),
        "registrations": len(registered),
        "locked_during": ext.stats()["locked_sections"] - before,
    }


if level < MPI.THREAD_SERIALIZED:
    result["refusals"] = refusals()
else:
    ext.reset_stats()
    result["errors"] = runs()
    result["stats"] = {
        k: v for k, v in ext.stats().items() if k in ("mpi_calls", "locked_sections")
    }
    result["beside"] = beside_a_program()
print("RESULT " + json.dumps(result), flush=True)
