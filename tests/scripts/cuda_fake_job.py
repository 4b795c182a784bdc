"""Under mpiexec: the CUDA allreduce's device-side path (``ReduceDeviceBuffer`` in
``_ffi/cuda.cc``) over the fake CUDA runtime of tests/cuda_fake/staging_module.cc,
built by tests/gpu/test_cuda_fake.py into the folder named by ``argv[1]``.

Each case reduces per-rank values with MPI.SUM through one fake stream whose
copies each wait up to ``delay_us`` before they run, and checks the result, what
the handler counted, and what it asked of the runtime. Each rank prints one
``RESULT {json}`` line: the cases run and the problems found.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, sys.argv[1])
import _cuda_fake as fake  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
# The buffers' device; the thread's current device is another one, which the
# handler must make current for the call and restore after it.
DEVICE, CURRENT = 1, 0
stream = fake.new_stream()
problems = []
kept = []  # the arrays registered as device memory live as long as the job


def device_array(values: np.ndarray) -> np.ndarray:
    array = np.array(values)
    fake.register_device(array.ctypes.data, max(1, array.nbytes), DEVICE)
    kept.append(array)
    return array


def inputs(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's values and the sum over the ranks: different at every element
    (within each piece's period), so that a piece in the wrong place shows."""
    period = 7 if dtype == "int8" else 4099
    base = np.arange(n) % period
    mine = (base + rank + seed).astype(dtype)
    total = (base * size + size * (size - 1) // 2 + seed * size).astype(dtype)
    return mine, total


def pieces(n: int, itemsize: int, staging: int, chunk: int) -> int:
    per_piece = staging // 2 // 16 * 16 // itemsize
    if chunk:
        per_piece = min(per_piece, max(1, chunk // itemsize))
    return -(-n // per_piece), per_piece


def case(name, n, dtype, staging, chunk=0, aliased=True, aware=False, seed=0):
    """One reduction; returns the stats, and appends what went wrong."""
    fake.configure(delay_us=30, current_device=CURRENT)
    if fake.staging_bytes() != staging:
        fake.release_pinned()
        fake.set_staging_bytes(staging)
    mine, total = inputs(n, dtype, seed)
    x = device_array(mine)
    y = x if aliased else device_array(np.zeros_like(mine))
    fake.reset_stats()
    before = fake.counts()
    itemsize = np.dtype(dtype).itemsize
    fake.reduce(
        stream,
        x.ctypes.data,
        y.ctypes.data,
        n,
        itemsize,
        dtype,
        comm.py2f(),
        chunk,
        aware,
    )
    after = fake.counts()
    stats = fake.stats()
    wrong = []
    if not np.array_equal(y, total):
        bad = np.flatnonzero(y != total)
        wrong.append(f"{bad.size} wrong values, first at {bad[:4].tolist()}")
    if not aliased and not np.array_equal(x, mine):
        wrong.append("the input changed")
    if after["current_device"] != CURRENT:
        wrong.append(f"current device left at {after['current_device']}")
    if after["set_device_calls"] - before["set_device_calls"] != 2:
        wrong.append("the device was not set and restored once each")
    if after["host_frees"] != before["host_frees"]:
        wrong.append("pinned memory freed during the call")
    if aware:
        if stats["cuda_aware_calls"] != 1 or stats["staged_calls"]:
            wrong.append(f"not CUDA-aware: {stats}")
    else:
        want, per_piece = pieces(n, itemsize, staging, chunk)
        if stats["staged_chunks"] != want:
            wrong.append(f"{stats['staged_chunks']} pieces, not {want}")
        if stats["max_call_count"] > per_piece:
            wrong.append(f"an MPI call of {stats['max_call_count']} > {per_piece}")
        if stats["pinned_bytes"] != staging:
            wrong.append(f"pinned {stats['pinned_bytes']} bytes, not {staging}")
    problems.extend(f"{name}: {w}" for w in wrong)
    return after


# Pieces of half the buffer, of a smaller chunk, with a remainder, of 2 elements
# (a 48-byte buffer: halves of 16 bytes), and over 64 KiB halves; aliased or not.
case("float32 in halves", 10_000, "float32", 1024)
case("float32 in chunks", 10_000, "float32", 1024, chunk=100, aliased=False)
case("float64 two per piece", 1001, "float64", 48, seed=3)
case("int8 over 64 KiB halves", (1 << 20) + 3, "int8", 128 << 10, aliased=False)
case("one element", 1, "float64", 1024, aliased=False)
case("float32 in halves", 10_000, "float32", 1024, seed=2)

# The buffer is allocated once per size and reused: a second call allocates
# nothing, and it cannot be resized while it exists.
allocated = fake.counts()["host_allocs"]
case("again", 10_000, "float32", 1024, seed=1)
if fake.counts()["host_allocs"] != allocated:
    problems.append("the second call allocated pinned memory again")
try:
    fake.set_staging_bytes(1 << 20)
    problems.append("set_staging_bytes with a buffer there: no RuntimeError")
except RuntimeError:
    pass

# CUDA-aware: MPI on the device buffer itself (here host memory), after a copy
# when XLA gives two buffers.
case("CUDA-aware", 10_000, "float32", 1024, aliased=False, aware=True)

# A kernel before the call failed: reported as such, before any copy or MPI call
# (so on every rank alike, and no rank is left in a collective).
fake.configure(sticky_error=700)  # cudaErrorIllegalAddress
fake.reset_stats()
copies = fake.counts()["copies"]
try:
    x = device_array(np.ones(100, np.float32))
    fake.reduce(
        stream, x.ctypes.data, x.ctypes.data, 100, 4, "float32", comm.py2f(), 0, False
    )
    problems.append("sticky error: no RuntimeError")
except RuntimeError as error:
    message = str(error)
    if (
        "an earlier kernel on this stream failed: cudaErrorIllegalAddress"
        not in message
    ):
        problems.append(f"sticky error reported as: {message}")
if fake.counts()["copies"] != copies or fake.stats()["mpi_calls"]:
    problems.append("sticky error: copies or MPI calls made")
fake.configure(sticky_error=0)

# The checks above can fail: with the copies' events ignored, MPI reads halves
# before their copies came in, and the sums come out wrong.
fake.configure(delay_us=300, current_device=CURRENT, events_ignored=True)
fake.release_pinned()
fake.set_staging_bytes(1024)
mine, total = inputs(10_000, "float32", 5)
x = device_array(mine)
fake.reduce(
    stream, x.ctypes.data, x.ctypes.data, x.size, 4, "float32", comm.py2f(), 0, False
)
broken_wrong = not np.array_equal(x, total)
fake.configure(events_ignored=False)
if not comm.allreduce(broken_wrong, op=MPI.LOR):
    problems.append("ignoring the events changed nothing: the checks cannot fail")

fake.release_pinned()
fake.free_stream(stream)
print("RESULT " + json.dumps({"rank": rank, "problems": problems}), flush=True)
