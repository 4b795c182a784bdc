"""XLA's own MPI collectives on CPU, through mpi4jax_dist's MPIABI wrapper.

Usage::

    MPITRAMPOLINE_LIB=<mpi4jax_dist/_ffi/_mpiabi_<family>...so> JAX_PLATFORMS=cpu \\
        mpiexec -n 2 python mpi_collectives.py [--impl mpi|gloo] [--no-warmup]
        [--bench] [--iters N] [--repeat N]

``import mpi4jax_dist`` (its cluster env bootstraps JAX from mpi4py), then
``jax_cpu_collectives_implementation`` (``--impl``, default ``mpi``), then
``jax.distributed.initialize()``. Over ``mpi4jax_dist.global_mesh()`` with
``shard_map``: psum, pmax, all_gather, psum_scatter, ppermute (a ring shift) and
all_to_all, each checked against NumPy; then psum, ``mpi4jax.allreduce`` and
``mpi4jax_dist.allreduce`` interleaved, each feeding the next, three rounds
(``interleaved``). They cannot share one jitted program: JAX refuses mpi4jax's
ordered effect in a program over more than one device ("ordered effects are not
supported for more than 1 device"), and psum needs the mesh's devices; so the psum
runs in its jitted shard_map and the allreduces in a jitted function of this
process's block, alternating. Each rank prints one ``RESULT {json}`` line and exits 0
when every check passed, 1 otherwise.

Right after initialize, one tiny psum runs from the main thread (``--warmup
main``, the default), from a new Python thread (``thread``) or not at all
(``none``): XLA creates its MPI communicators lazily, on whichever thread first runs
a collective, and refuses ("MPI: Communicator requested from a thread that is not
the one MPI was initialized from") unless ``MPI_Is_thread_main`` says yes there.
With the wrapper's rule (every thread counts as the main one under
``MPI_THREAD_MULTIPLE``, which mpi4py provides by default) all three pass.

``--bench`` also times a psum of 4 B and of 4 KiB in a jitted ``fori_loop`` and
reports the median microseconds per psum over ``--repeat`` runs of ``--iters``
psums each (``bench`` in the RESULT line).

MPITRAMPOLINE_LIB must be set before Python starts (or by mpi4jax_dist's own switch
before jax is imported): jaxlib's MPItrampoline reads it as jaxlib loads. Without
it, ``--impl mpi`` fails with MPItrampoline's "MPITRAMPOLINE_LIB is not set".
"""

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

# isort: off
# mpi4jax_dist first: its own switch (MPI4JAX_DIST_CPU_COLLECTIVES=mpi) must see
# jaxlib before it loads. It registers the cluster env.
import mpi4jax_dist
from mpi4jax_dist import xla_mpi
import jax
from jax.sharding import PartitionSpec as P
from mpi4jax_dist import _compat

# isort: on

parser = argparse.ArgumentParser()
parser.add_argument("--impl", default="mpi", choices=["mpi", "gloo"])
parser.add_argument("--warmup", default="main", choices=["main", "thread", "none"])
parser.add_argument("--bench", action="store_true")
parser.add_argument("--iters", type=int, default=200)
parser.add_argument("--repeat", type=int, default=5)
args = parser.parse_args()

jax.config.update("jax_cpu_collectives_implementation", args.impl)
jax.distributed.initialize()

mesh = mpi4jax_dist.global_mesh()
axis = mesh.axis_names[0]
rank, size = jax.process_index(), jax.process_count()


def shard_map(f):
    return jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def local(array):
    """This process's block of a result (one device per process)."""
    (shard,) = array.addressable_shards
    return np.asarray(shard.data)


warmup_error = None
if args.warmup != "none":
    # Before any other collective, from the main thread or from another one (which
    # XLA's check refuses unless MPI_Is_thread_main says yes there): see above.
    tiny = mpi4jax_dist.to_global(np.ones(1, np.float32), mesh)

    def warm():
        global warmup_error
        try:
            local(shard_map(lambda b: jax.lax.psum(b, axis))(tiny))
        except Exception as err:
            warmup_error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"

    if args.warmup == "main":
        warm()
    else:
        thread = threading.Thread(target=warm)
        thread.start()
        thread.join()

# Rank r holds a_r = arange(k) + 100 r; k divisible by the number of ranks.
k = 3 * size
m = k // size
blocks = [np.arange(k, dtype=np.float32) + 100 * r for r in range(size)]
x = mpi4jax_dist.to_global(blocks[rank], mesh)

ring = [(i, (i + 1) % size) for i in range(size)]
ops = {
    "psum": (lambda b: jax.lax.psum(b, axis), sum(blocks)),
    "pmax": (lambda b: jax.lax.pmax(b, axis), np.maximum.reduce(blocks)),
    "all_gather": (
        lambda b: jax.lax.all_gather(b, axis, tiled=True),
        np.concatenate(blocks),
    ),
    "psum_scatter": (
        lambda b: jax.lax.psum_scatter(b, axis, scatter_dimension=0, tiled=True),
        sum(blocks)[rank * m : (rank + 1) * m],
    ),
    "ppermute": (
        lambda b: jax.lax.ppermute(b, axis, perm=ring),
        blocks[(rank - 1) % size],
    ),
    "all_to_all": (
        # Chunk j of rank r's result is chunk r of rank j's block.
        lambda b: jax.lax.all_to_all(b, axis, split_axis=0, concat_axis=0, tiled=True),
        np.concatenate([blocks[j][rank * m : (rank + 1) * m] for j in range(size)]),
    ),
}
results, errors = {}, {}
for name, (f, expected) in ops.items():
    try:
        got = local(shard_map(f)(x))
        ok = got.shape == expected.shape and np.array_equal(got, expected)
        results[name] = bool(ok)
        if not ok:
            errors[name] = f"got {got.tolist()}, expected {expected.tolist()}"
    except Exception as err:  # reported per op; the exit status says it failed
        results[name] = False
        errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"


def interleaved(rounds: int = 3):
    """psum (XLA over MPI), then mpi4jax's and our allreduce (jitted on this
    process's block), each feeding the next, ``rounds`` times; checked against
    NumPy after every step."""
    import mpi4jax
    from mpi4py import MPI

    psum = shard_map(lambda b: jax.lax.psum(b, axis))
    allreduces = jax.jit(
        lambda v: mpi4jax_dist.allreduce(mpi4jax.allreduce(v, op=MPI.SUM) + 1.0)
    )
    value, expected = x, blocks[rank]
    for step in range(rounds):
        summed = local(psum(value))
        expected = sum(blocks) if step == 0 else size * expected
        if not np.array_equal(summed, expected):
            return f"psum of round {step}: got {summed.tolist()}"
        mine = np.asarray(allreduces(summed * (1.0 / size)))
        expected = size * (expected + 1.0)
        if not np.array_equal(mine, expected):
            return f"allreduces of round {step}: got {mine.tolist()}"
        value = mpi4jax_dist.to_global(mine / size, mesh)
        expected = expected / size
    return None


try:
    problem = interleaved()
except Exception as err:
    problem = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
results["interleaved"] = problem is None
if problem:
    errors["interleaved"] = problem


def bench(nbytes: int) -> float:
    """Median microseconds per psum of ``nbytes`` per rank."""
    n = max(nbytes // 4, 1)
    step = _compat.shard_map(
        lambda b: jax.lax.psum(b, axis) * (1.0 / size),
        mesh=mesh,
        in_specs=P(axis),
        out_specs=P(axis),
    )

    @jax.jit
    def loop(v):
        return jax.lax.fori_loop(0, args.iters, lambda i, v: step(v), v)

    v = mpi4jax_dist.to_global(np.ones(n, np.float32), mesh)
    # Compile and warm up; the mean of ones over the ranks stays ones.
    if not np.array_equal(local(loop(v)), np.ones(n, np.float32)):
        raise AssertionError(f"psum loop of {nbytes} B: wrong result")
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        loop(v).block_until_ready()
        times.append((time.perf_counter() - start) / args.iters * 1e6)
    return float(np.median(times))


timings = {}
if args.bench and all(results.values()):
    timings = {"4B": round(bench(4), 2), "4KiB": round(bench(4096), 2)}

from mpi4py import MPI  # noqa: E402  (initialized by the cluster env)

library = os.environ.get("MPITRAMPOLINE_LIB")
with open("/proc/self/maps") as maps:
    mapped = library is not None and any(
        line.rstrip().endswith(os.path.realpath(library)) for line in maps
    )


def xla_world() -> dict | None:
    """The world our wrapper gives XLA: whether it is a private duplicate of
    MPI_COMM_WORLD (another handle, congruent), and in how many calls XLA passed
    MPI_COMM_WORLD and got it. None where the wrapper is not ours (or gloo)."""
    import ctypes

    try:
        wrapper = ctypes.CDLL(library)
        world, redirects = (
            wrapper.mpi4jax_dist_mpiabi_world,
            wrapper.mpi4jax_dist_mpiabi_world_redirects,
        )
    except (OSError, TypeError, AttributeError):
        return None
    world.restype, redirects.restype = ctypes.c_size_t, ctypes.c_ulonglong
    handle = world()
    given = MPI.Comm.fromhandle(handle)
    return dict(
        private=handle != MPI._handleof(MPI.COMM_WORLD),
        congruent=MPI.Comm.Compare(MPI.COMM_WORLD, given) == MPI.CONGRUENT,
        redirects=redirects(),
    )


report = dict(
    rank=rank,
    size=size,
    impl=args.impl,
    warmup=args.warmup,
    warmup_error=warmup_error,
    ok=all(results.values()) and warmup_error is None,
    ops=results,
    errors=errors,
    bench_us=timings,
    iters=args.iters if timings else None,
    wrapper=os.path.basename(library) if library else None,
    wrapper_loaded=mapped,
    xla_world=xla_world() if mapped else None,
    # What the diagnostics report of it (python -m mpi4jax_dist --check --json).
    reported_redirects=xla_mpi.report()["xla_world_redirects"],
    reported_world=xla_mpi.report()["xla_world"],
    mpi=MPI.Get_library_version().splitlines()[0].strip(),
    thread_level=MPI.Query_thread(),
    jax=jax.__version__,
)
print("RESULT " + json.dumps(report), flush=True)
sys.exit(0 if report["ok"] else 1)
