"""mpi4jax_dist.allreduce on CUDA GPUs: the CUDA handler in _ffi/cuda.cc.

Two parts. The lowering for CUDA (target, attributes, aliasing, the CUDA-aware
switch, the error without a CUDA build) is checked anywhere the CUDA module was
built, GPU or not, by exporting for the "cuda" platform. The handler itself runs
only where ``jax.devices()`` has a GPU: tests/conftest.py puts JAX on the CPU
unless ``JAX_PLATFORMS`` says otherwise, so on a GPU machine run

    JAX_PLATFORMS=cuda mpiexec -n 2 python -m pytest --with-mpi \\
        tests/test_inplace_allreduce_gpu.py

or ``python benchmarks/gpu_allreduce.py``, which runs this file and the GPU
memory table. There, results are checked against mpi4py's Allreduce on host
copies; device memory against ``memory_stats()``; what the handler did (staged
or CUDA-aware, how many chunks, pinned host bytes) is counted by the extension.
"""

import os
import re

import numpy as np
import pytest
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import _config, _ffi, _jax_compat

# Ranks sharing one GPU must not each take 75% of its memory up front (XLA's
# default); set before any test makes a GPU backend, and ignored on the CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CHUNK = _config.ALLREDUCE_CHUNK_BYTES
AWARE = _config.CUDA_AWARE_MPI
MPI4JAX_AWARE = _config.MPI4JAX_CUDA_AWARE_MPI
MiB = 1 << 20


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def cuda_extension():
    """The CUDA module, or a skip where this install has none."""
    if not _ffi.built("cuda"):
        pytest.skip(
            "mpi4jax_dist was installed without its CUDA handler (no CUDA toolkit "
            "where it was built), so there is no CUDA lowering to check"
        )
    return _ffi.load_cuda()


def gpu():
    """The first GPU JAX sees, or a skip with the reason."""
    import jax

    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        pytest.skip(
            f"no GPU among jax.devices() ({jax.default_backend()} only; "
            f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}): the CUDA "
            f"handler runs on a machine with an NVIDIA GPU, with "
            f"JAX_PLATFORMS=cuda (benchmarks/gpu_allreduce.py)"
        )
    cuda_extension()
    return devices[0]


@pytest.fixture
def staged(monkeypatch):
    """Staging through host memory, whatever the job's environment says."""
    monkeypatch.setenv(AWARE, "0")
    monkeypatch.delenv(MPI4JAX_AWARE, raising=False)


# ---------------------------------------------------------------------------------
# The lowering for CUDA: anywhere the CUDA module is built


def cuda_module_text(f, *specs) -> str:
    """StableHLO of ``f`` exported for the CUDA platform (lowered, not run)."""
    import jax

    try:
        import jax.export  # an attribute of jax only once imported, in jax 0.6
    except ModuleNotFoundError as err:
        pytest.skip(
            f"jax {jax.__version__}'s jax.export imports {err.name}, which jax 0.6 "
            f"does not install (pip install absl-py)"
        )

    checks = [
        jax.export.DisabledSafetyCheck.custom_call(target)
        for target in (_ffi.ALLREDUCE_TARGET, _ffi.TOKEN_AFTER_TARGET)
    ]
    exported = jax.export.export(f, platforms=["cuda"], disabled_checks=checks)
    return exported(*specs).mlir_module()


CALL = re.compile(r"stablehlo\.custom_call @mpi4jax_dist_allreduce\(.*")


@pytest.mark.mpi(min_size=2)
def test_cuda_lowering(monkeypatch):
    import jax
    import jax.numpy as jnp

    ext = cuda_extension()
    monkeypatch.delenv(AWARE, raising=False)
    monkeypatch.delenv(MPI4JAX_AWARE, raising=False)
    monkeypatch.setenv(CHUNK, "1M")
    spec = jax.ShapeDtypeStruct((1000,), jnp.float32)
    problems = []

    def call(text):
        found = CALL.findall(text)
        return found[0] if len(found) == 1 else f"{len(found)} calls"

    def reduce(a):
        return mpi4jax_dist.allreduce(a)

    default = call(cuda_module_text(jax.jit(reduce, donate_argnums=0), spec))
    for part in ("cuda_aware = 0 : i32", "chunk_bytes = 1048576", "operand_index = 0"):
        if part not in default:
            problems.append(f"by default: no {part!r} in {default}")
    # Told CUDA-aware, by our variable or by mpi4jax's, from an MPI that cannot
    # say (None) or says yes: the handler hands MPI the device buffer.
    monkeypatch.setattr(ext, "mpi_cuda_support", lambda: None)
    for variable in (AWARE, MPI4JAX_AWARE):
        monkeypatch.setenv(variable, "1")
        aware = call(cuda_module_text(jax.jit(lambda a: reduce(a) * 1), spec))
        if "cuda_aware = 1 : i32" not in aware:
            problems.append(f"{variable}=1: {aware}")
        monkeypatch.delenv(variable)
    # Ours wins over mpi4jax's.
    monkeypatch.setenv(MPI4JAX_AWARE, "1")
    monkeypatch.setenv(AWARE, "0")
    text = call(cuda_module_text(jax.jit(lambda a: reduce(a) * 2), spec))
    if "cuda_aware = 0 : i32" not in text:
        problems.append(f"{AWARE}=0 beside {MPI4JAX_AWARE}=1: {text}")
    all_ranks(not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_cuda_aware_refused_where_mpi_says_no(monkeypatch):
    import jax
    import jax.numpy as jnp

    ext = cuda_extension()
    monkeypatch.setattr(ext, "mpi_cuda_support", lambda: False)
    monkeypatch.setenv(AWARE, "1")
    spec = jax.ShapeDtypeStruct((10,), jnp.float32)
    try:
        cuda_module_text(jax.jit(lambda a: mpi4jax_dist.allreduce(a) * 3), spec)
        message = "no RuntimeError"
    except RuntimeError as e:
        message = str(e)
    all_ranks(AWARE in message and "MPIX_Query_cuda_support" in message, message)


@pytest.mark.mpi(min_size=2)
def test_no_cuda_build_says_how_to_get_one(monkeypatch):
    real = _ffi.built
    monkeypatch.setattr(
        _ffi, "built", lambda kind="cpu": {} if kind == "cuda" else real()
    )
    try:
        _ffi.load_cuda.__wrapped__()
        message = "no ImportError"
    except ImportError as e:
        message = str(e)
    all_ranks("no CUDA handler" in message and "CUDA_HOME" in message, message)


@pytest.mark.mpi(min_size=2)
def test_cuda_extension_matches_mpi4py():
    from mpi4py import MPI

    ext = cuda_extension()
    theirs = MPI.Get_library_version()
    problems = []
    if ext.library_version() != theirs:
        problems.append(f"{ext.library_version()!r} != {theirs!r}")
    if _ffi.mismatch(theirs, ext.HEADER_MPI, theirs, "x.so") is not None:
        problems.append(f"{ext.HEADER_MPI} refused beside {theirs!r}")
    if ext.mpi_cuda_support() not in (True, False, None):
        problems.append(f"mpi_cuda_support() = {ext.mpi_cuda_support()!r}")
    all_ranks(not problems, problems)


def test_cuda_aware_setting_parsed():
    parse = _config.cuda_aware_mpi
    assert parse({}) is False
    assert parse({AWARE: "1"}) is True
    assert parse({MPI4JAX_AWARE: "true"}) is True
    assert parse({AWARE: "0", MPI4JAX_AWARE: "1"}) is False
    assert parse({AWARE: "", MPI4JAX_AWARE: "1"}) is True
    with pytest.warns(RuntimeWarning, match=AWARE):
        assert parse({AWARE: "maybe"}) is False


# ---------------------------------------------------------------------------------
# The handler on a GPU


def values(dtype: str, op: str, rank: int, n: int = 37) -> np.ndarray:
    """Per-rank inputs whose reduction is exact and fits the dtype at 4 ranks."""
    rng = np.random.default_rng(2000 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if op == "PROD":
        base = rng.integers(1, 3, n)
    elif op in ("BAND", "BOR", "BXOR"):
        base = rng.integers(0, 128, n)
    else:
        base = rng.integers(0, 50, n) - (25 if dtype[0] in "fic" else 0)
    if dtype.startswith("complex"):
        return (base + 1j * rng.integers(0, 2, n)).astype(dtype)
    return base.astype(dtype)


CASES = [
    ("float32", "SUM"),
    ("float32", "MAX"),
    ("float64", "PROD"),
    ("complex64", "SUM"),
    ("complex128", "PROD"),
    ("int8", "SUM"),
    ("int32", "MIN"),
    ("int64", "BXOR"),
    ("uint16", "BOR"),
    ("uint64", "SUM"),
    ("bool", "LOR"),
    ("bool", "LAND"),
]


def check_against_mpi4py(device, chunk: str) -> list[str]:
    """Every case of CASES, donated, against mpi4py on host copies."""
    import jax
    from mpi4py import MPI

    comm = world()
    wrong = []
    with _jax_compat.enable_x64(True):
        for dtype, op in CASES:
            x = values(dtype, op, comm.rank)
            mpi_op = getattr(MPI, op)
            expected = np.empty_like(x)
            comm.Allreduce(x, expected, op=mpi_op)
            reduce = jax.jit(
                lambda a, o=mpi_op: mpi4jax_dist.allreduce(a, o), donate_argnums=0
            )
            got = np.asarray(reduce(jax.device_put(x, device)))
            if got.dtype != x.dtype or not np.array_equal(got, expected):
                wrong.append(f"{chunk} {dtype} {op}: {got[:4]} != {expected[:4]}")
    return wrong


@pytest.mark.mpi(min_size=2)
def test_gpu_matches_mpi4py_staged(monkeypatch, staged):
    device = gpu()
    ext = _ffi.load_cuda()
    wrong = []
    # One chunk per call, then 8-byte chunks: several per message, and a
    # remainder where the element size does not divide.
    for chunk in ("", "8"):
        monkeypatch.setenv(CHUNK, chunk)
        ext.reset_stats()
        wrong += check_against_mpi4py(device, chunk or "default chunks")
        stats = ext.stats()
        if stats["staged_calls"] != len(CASES) or stats["cuda_aware_calls"]:
            wrong.append(f"{CHUNK}={chunk!r}: not all staged: {stats}")
    all_ranks(not wrong, wrong)


@pytest.mark.mpi(min_size=2)
def test_gpu_matches_mpi4py_cuda_aware(monkeypatch):
    device = gpu()
    ext = _ffi.load_cuda()
    support = ext.mpi_cuda_support()
    everyone = world().allgather(support)
    if not all(everyone):
        pytest.skip(
            f"this MPI does not say that it reads device memory "
            f"(MPIX_Query_cuda_support: {everyone}): only the staged mode runs here"
        )
    monkeypatch.setenv(AWARE, "1")
    ext.reset_stats()
    wrong = check_against_mpi4py(device, "CUDA-aware")
    stats = ext.stats()
    if stats["cuda_aware_calls"] != len(CASES) or stats["staged_calls"]:
        wrong.append(f"not all CUDA-aware: {stats}")
    all_ranks(not wrong, wrong)


@pytest.mark.mpi(min_size=2)
def test_gpu_donated_in_place_one_message(staged):
    """The donated buffer is the result's, and device memory rises by less than
    half a message where mpi4jax's rises by one (the check can fail)."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    device = gpu()
    comm = world()
    ext = _ffi.load_cuda()
    n = 64 * MiB  # 256 MiB of float32: larger than anything before in this process
    nbytes = 4 * n
    ours = jax.jit(mpi4jax_dist.allreduce, donate_argnums=0)
    theirs = jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM), donate_argnums=0)
    # Built in int32: float32 counts exactly only up to 2**24.
    make = jax.jit(
        lambda: (jnp.arange(n, dtype=jnp.int32) % 1000 + comm.rank).astype(jnp.float32)
    )
    expected = (np.arange(n) % 1000 * comm.size + sum(range(comm.size))).astype(
        np.float32
    )
    spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    ours.lower(spec).compile()
    theirs.lower(spec).compile()

    def rise(f):
        x = make()
        x.block_until_ready()
        jax.effects_barrier()
        stats = device.memory_stats() or {}
        base = stats.get("bytes_in_use")
        before = x.unsafe_buffer_pointer()
        y = f(x)
        y.block_until_ready()
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
        same = y.unsafe_buffer_pointer() == before and x.is_deleted()
        ok = np.array_equal(np.asarray(y), expected)
        return (None if None in (base, peak) else peak - base), same, ok

    ext.reset_stats()
    ours_rise, ours_same, ours_ok = rise(ours)
    stats = ext.stats()
    theirs_rise, _, theirs_ok = rise(theirs)
    problems = []
    if not (ours_same and stats["same_buffer_calls"] == 1):
        problems.append(f"the donated buffer was not the result's: {stats}")
    if not (ours_ok and theirs_ok):
        problems.append(f"wrong sums: ours {ours_ok}, mpi4jax {theirs_ok}")
    if ours_rise is None or theirs_rise is None:
        problems.append(f"no memory_stats on {device}: {device.memory_stats()}")
    else:
        if ours_rise >= nbytes // 2:
            problems.append(f"ours rose {ours_rise / nbytes:.2f} messages")
        if theirs_rise < nbytes:
            problems.append(
                f"mpi4jax rose {theirs_rise / nbytes:.2f} messages (< 1): the "
                f"measurement cannot see an out-of-place buffer"
            )
    # Host memory: one pinned chunk (64 MiB by default), not the message.
    chunk = _config.allreduce_chunk_bytes()
    if not 0 < stats["pinned_peak_bytes"] <= chunk:
        problems.append(f"pinned {stats['pinned_peak_bytes']} B > one chunk: {stats}")
    if stats["staged_chunks"] != nbytes // chunk:
        problems.append(f"not {nbytes // chunk} chunks: {stats}")
    all_ranks(not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_gpu_pinned_buffer_bounded_and_reused(monkeypatch, staged):
    import jax
    import jax.numpy as jnp

    gpu()
    comm = world()
    ext = _ffi.load_cuda()
    monkeypatch.setenv(CHUNK, "1M")
    n = 4 * MiB  # 16 MiB of float32: 16 chunks of 1 MiB
    reduce = jax.jit(lambda a: mpi4jax_dist.allreduce(a), donate_argnums=0)
    ext.release_pinned()
    ext.reset_stats()
    problems = []
    for _ in range(3):
        y = reduce(jnp.full((n,), comm.rank + 1, jnp.float32))
        if not bool(jnp.all(y == sum(range(1, comm.size + 1)))):
            problems.append("wrong sum")
    stats = ext.stats()
    # Allocated once at 1 MiB and reused by every chunk of all three calls.
    if stats["pinned_peak_bytes"] != MiB or stats["pinned_bytes"] != MiB:
        problems.append(f"pinned bytes not one chunk: {stats}")
    if stats["staged_chunks"] != 3 * 16 or stats["max_call_count"] != MiB // 4:
        problems.append(f"not 16 chunks of 1 MiB per call: {stats}")
    if ext.release_pinned() != MiB or ext.stats()["pinned_bytes"] != 0:
        problems.append("release_pinned did not free the one buffer")
    all_ranks(not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_gpu_order_with_mpi4jax(staged):
    """Our call and mpi4jax's in one program keep program order (one token)."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    gpu()
    comm = world()

    @jax.jit
    def f(a):
        b = mpi4jax_dist.allreduce(a)
        c = mpi4jax.allreduce(b * 2, op=MPI.SUM)
        return mpi4jax_dist.allreduce(c, MPI.MAX)

    p = comm.size
    got = np.asarray(f(jnp.arange(8, dtype=jnp.float32) + comm.rank))
    expected = 2 * p * (np.arange(8) * p + p * (p - 1) / 2)
    all_ranks(np.array_equal(got, expected.astype(np.float32)), got)


# 2**31 + 16 int8 per rank: 2 GiB on the device, one 64 MiB pinned chunk on the host.
LARGE = 2**31 + 16


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(900)
def test_gpu_count_above_2_31(staged):
    import jax
    import jax.numpy as jnp
    from jax import lax

    device = gpu()
    comm = world()
    limit = (device.memory_stats() or {}).get("bytes_limit", 0)
    # Ranks may share the GPU: each holds its 2 GiB message, and a little more.
    limits = comm.allgather(limit)
    if min(limits) < comm.size * (3 << 30):
        pytest.skip(
            f"2**31 + 16 int8 per rank needs 3 GiB of device memory per rank; "
            f"the GPU allows {min(limits) / 2**30:.1f} GiB"
        )
    ext = _ffi.load_cuda()
    rank = comm.rank
    total = comm.size * (comm.size + 1) // 2  # of rank + 1 over the ranks

    @jax.jit
    def make():
        ends = jnp.arange(16, dtype=jnp.int8) + rank
        x = jnp.full((LARGE,), rank + 1, jnp.int8)
        x = lax.dynamic_update_slice(x, ends, (np.int64(0),))
        return lax.dynamic_update_slice(x, -ends, (np.int64(LARGE - 16),))

    @jax.jit
    def check(a):
        head, tail = lax.slice(a, (0,), (16,)), lax.slice(a, (LARGE - 16,), (LARGE,))
        middle = jnp.all(lax.slice(a, (16,), (LARGE - 16,)) == total)
        return head, tail, middle

    with _jax_compat.enable_x64(True):
        x = make()
    ext.reset_stats()
    y = jax.jit(mpi4jax_dist.allreduce, donate_argnums=0)(x)
    head, tail, middle = (np.asarray(a) for a in check(y))
    stats = ext.stats()
    p = comm.size
    want = (p * np.arange(16) + p * (p - 1) // 2).astype(np.int8)
    problems = []
    if not (np.array_equal(head, want) and np.array_equal(tail, -want) and middle):
        problems.append(f"wrong: {head} {tail} {middle}")
    if stats["staged_chunks"] != -(-LARGE // (64 << 20)):
        problems.append(f"not in 64 MiB chunks: {stats}")
    all_ranks(not problems, problems)
