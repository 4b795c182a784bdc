"""mpi4jax_dist.allreduce on CUDA GPUs: the CUDA handler in _ffi/cuda.cc.

Two parts. The lowering for CUDA (target, attributes, aliasing, the CUDA-aware
switch, the error without a CUDA build) is checked anywhere the CUDA module was
built, GPU or not, by exporting for the "cuda" platform. The handler itself runs
only where ``jax.devices()`` has a GPU: tests/conftest.py puts JAX on the CPU
unless ``JAX_PLATFORMS`` says otherwise, so on a GPU machine run

    JAX_PLATFORMS=cuda mpiexec -n 2 python -m pytest --with-mpi \\
        tests/gpu/test_inplace_allreduce_gpu.py

or ``bash tools/gpu_check.sh``, which builds everything, runs this file and then
the device-memory table of ``benchmarks/memory.py --gpu``, in one command. There,
results are checked against mpi4py's Allreduce on host copies;
device memory against ``memory_stats()``; what the handler did (staged or
CUDA-aware, how many pieces, pinned host bytes) is counted by the extension.
tests/gpu/test_cuda_fake.py runs the staging itself on the CPU, over a fake CUDA
runtime.
"""

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import _compat, _config, _ffi, _mpi

# Ranks sharing one GPU must not each take 75% of its memory up front (XLA's
# default); set before any test makes a GPU backend, and ignored on the CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CHUNK = _config.ALLREDUCE_CHUNK_BYTES
AWARE = _config.CUDA_AWARE_MPI
MPI4JAX_AWARE = _config.MPI4JAX_CUDA_AWARE_MPI
STAGING = _config.STAGING_BYTES
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
            f"JAX_PLATFORMS=cuda (tools/gpu_check.sh)"
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
    # Told CUDA-aware, by our variable or by mpi4jax's, from an MPI that says
    # yes; or forced where it cannot say: the handler hands MPI the device buffer.
    for support, variable, value in (
        (True, AWARE, "1"),
        (True, MPI4JAX_AWARE, "1"),
        (None, AWARE, "force"),
        (True, AWARE, "force"),
    ):
        monkeypatch.setattr(ext, "mpi_cuda_support", lambda s=support: s)
        monkeypatch.setenv(variable, value)
        aware = call(cuda_module_text(jax.jit(lambda a: reduce(a) * 1), spec))
        if "cuda_aware = 1 : i32" not in aware:
            problems.append(f"{variable}={value}, MPI says {support}: {aware}")
        monkeypatch.delenv(variable)
    # Ours wins over mpi4jax's.
    monkeypatch.setenv(MPI4JAX_AWARE, "1")
    monkeypatch.setenv(AWARE, "0")
    text = call(cuda_module_text(jax.jit(lambda a: reduce(a) * 2), spec))
    if "cuda_aware = 0 : i32" not in text:
        problems.append(f"{AWARE}=0 beside {MPI4JAX_AWARE}=1: {text}")
    all_ranks(not problems, problems)


def lowering_error(f, spec) -> str:
    """The RuntimeError's message from exporting ``f`` for CUDA, or a note."""
    try:
        cuda_module_text(f, spec)
    except RuntimeError as e:
        return str(e)
    return "no RuntimeError"


@pytest.mark.mpi(min_size=2)
def test_cuda_aware_refused_where_mpi_says_no(monkeypatch):
    import jax
    import jax.numpy as jnp

    ext = cuda_extension()
    monkeypatch.setattr(ext, "mpi_cuda_support", lambda: False)
    spec = jax.ShapeDtypeStruct((10,), jnp.float32)
    messages = []
    # Forcing does not override an MPI that says no.
    for value in ("1", "force"):
        monkeypatch.setenv(AWARE, value)
        f = jax.jit(lambda a, v=value: mpi4jax_dist.allreduce(a) * len(v))
        messages.append(lowering_error(f, spec))
    all_ranks(
        all(AWARE in m and "MPIX_Query_cuda_support" in m for m in messages),
        messages,
    )


@pytest.mark.mpi(min_size=2)
def test_cuda_aware_refused_where_mpi_cannot_say(monkeypatch):
    """An MPI without MPIX_Query_cuda_support (Open MPI without its CUDA
    extension, Intel MPI) is not handed device memory on a plain 'yes': the
    error names the MPI and the setting that forces it."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    ext = cuda_extension()
    monkeypatch.setattr(ext, "mpi_cuda_support", lambda: None)
    spec = jax.ShapeDtypeStruct((10,), jnp.float32)
    library = MPI.Get_library_version().split()[0]
    messages = []
    for variable in (AWARE, MPI4JAX_AWARE):
        monkeypatch.setenv(variable, "1")
        f = jax.jit(lambda a, v=variable: mpi4jax_dist.allreduce(a) * len(v))
        messages.append(lowering_error(f, spec))
        monkeypatch.delenv(variable)
    ok = all(
        f"{AWARE}=force" in m and variable in m and library in m
        for m, variable in zip(messages, (AWARE, MPI4JAX_AWARE), strict=True)
    )
    all_ranks(ok, messages)


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
    assert parse({}) == "off"
    assert parse({AWARE: "1"}) == "on"
    assert parse({AWARE: "Force"}) == "force"
    assert parse({MPI4JAX_AWARE: "true"}) == "on"
    assert parse({AWARE: "0", MPI4JAX_AWARE: "1"}) == "off"
    assert parse({AWARE: "", MPI4JAX_AWARE: "1"}) == "on"
    # mpi4jax's variable is a boolean: only ours forces.
    with pytest.warns(RuntimeWarning, match=MPI4JAX_AWARE):
        assert parse({MPI4JAX_AWARE: "force"}) == "off"
    with pytest.warns(RuntimeWarning, match=f"{AWARE}.*force"):
        assert parse({AWARE: "maybe"}) == "off"
    assert _config.cuda_aware_source({AWARE: "1"}) == f"{AWARE}='1'"
    assert _config.cuda_aware_source({MPI4JAX_AWARE: "1"}) == f"{MPI4JAX_AWARE}='1'"


def test_staging_setting_parsed():
    parse = _config.staging_bytes
    assert parse({}) == 64 * MiB
    assert parse({STAGING: ""}) == 64 * MiB
    assert parse({STAGING: "1M"}) == MiB
    assert parse({STAGING: "256MiB"}) == 256 * MiB
    assert parse({STAGING: "32"}) == 32
    for bad in ("0", "16", "lots", "-64M", "1.5G"):
        with pytest.raises(ValueError, match=f"{STAGING}=.*at least 32"):
            parse({STAGING: bad})


# ---------------------------------------------------------------------------------
# Whether the CUDA extension can run here: anywhere, with made-up versions


def test_cuda_mismatch_by_versions():
    check = _ffi.cuda_mismatch
    # Runs: no driver (nothing runs on a GPU, the lowering still compiles), a
    # driver of the same major (minor compatibility: no kernels) or newer, and
    # a plugin of the same major.
    assert check(13000, 0, [], "x.so") is None
    assert check(13000, 13000, [13], "x.so") is None
    assert check(12060, 12020, [12], "x.so") is None
    assert check(12080, 13000, [], "x.so") is None
    assert check(13000, 13020, [12, 13], "x.so") is None
    # A driver too old for the runtime: both versions, and the fix.
    message = check(13000, 12080, [], "x.so")
    assert message and "13.0" in message and "12.8" in message, message
    assert "x.so" in message and "--force-reinstall" in message, message
    assert "cudaErrorInsufficientDriver" in message, message
    # JAX's plugin for another major: both named, whatever the driver.
    for driver in (0, 13000):
        message = check(13000, driver, [12], "x.so")
        assert message and "13.0" in message and "jax_cuda12_plugin" in message
        assert "--force-reinstall" in message, message


def test_cuda_plugin_majors_found_on_the_path(tmp_path, monkeypatch):
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_cuda_plugin_x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('no')\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert _ffi.cuda_plugin_majors() == [12, 13]
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing")])
    assert _ffi.cuda_plugin_majors() == []


@pytest.mark.mpi(min_size=2)
def test_cuda_extension_refused_beside_another_plugin(monkeypatch):
    """load_cuda refuses an extension of another CUDA major than JAX's plugin,
    before it registers anything, naming both."""
    ext = cuda_extension()
    other = ext.CUDART_VERSION // 1000 - 1
    monkeypatch.setattr(_ffi, "cuda_plugin_majors", lambda: [other])
    try:
        _ffi.load_cuda.__wrapped__()
        message = "no ImportError"
    except ImportError as e:
        message = str(e)
    ok = f"jax_cuda{other}_plugin" in message and Path(ext.__file__).name in message
    all_ranks(ok, message)


@pytest.mark.mpi(min_size=2)
def test_staging_size_set_from_the_variable(monkeypatch):
    ext = cuda_extension()
    problems = []
    monkeypatch.setenv(STAGING, "lots")
    try:
        _ffi.load_cuda.__wrapped__()
        problems.append(f"{STAGING}=lots: no ValueError")
    except ValueError as e:
        if STAGING not in str(e):
            problems.append(str(e))
    # The module's own check, and a size taken while no buffer exists (none
    # does without a GPU; on one, release_pinned frees the idle ones).
    ext.release_pinned()
    before = ext.staging_bytes()
    try:
        ext.set_staging_bytes(16)
        problems.append("set_staging_bytes(16): no ValueError")
    except ValueError:
        pass
    ext.set_staging_bytes(MiB)
    if ext.staging_bytes() != MiB:
        problems.append(f"staging_bytes() = {ext.staging_bytes()}")
    ext.set_staging_bytes(before)
    all_ranks(not problems, problems)


# The CUDA module's MPI query before MPI_Init and after MPI_Finalize, in a fresh
# process: MPICH's own query ends the process there.
SUPPORT_WITHOUT_MPI = """
import importlib, sys
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
module = importlib.import_module(sys.argv[1])
print("before", module.mpi_cuda_support(), flush=True)
MPI.Init()
MPI.Finalize()
print("after", module.mpi_cuda_support(), flush=True)
"""


@util.serial_only
def test_mpi_cuda_support_none_outside_mpi():
    version = _ffi._mpi4py_library_version()
    family = _mpi.family(version) if version else None
    builds = _ffi.built("cuda")
    if family not in builds:
        pytest.skip(
            f"no CUDA module built for mpi4py's MPI ({family}; built: "
            f"{sorted(builds) or 'none'}): mpi4jax_dist was installed without CUDA"
        )
    module = "mpi4jax_dist._ffi._cuda"
    proc = util.run_command(
        [sys.executable, "-c", SUPPORT_WITHOUT_MPI, module],
        env=util.clean_env(),
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.split() == ["before", "None", "after", "None"], out


def test_cpu_and_cuda_modules_share_one_core():
    """A process that loads both modules has one core (_core): the registry,
    the record and the counts that a call through the CPU handler writes are
    those the CUDA module reads, and both hand _stacks the same reader of the
    record. (Each module kept its own of each before.)"""
    import ctypes

    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    cuda = cuda_extension()
    cpu = _ffi.load()
    comm = MPI.COMM_WORLD.Dup()
    try:
        before = cuda.stats()["handler_calls"]
        y = jax.jit(lambda a: mpi4jax_dist.allreduce(a, comm=comm))(jnp.ones(4))
        y.block_until_ready()
        seen = cuda.stats()["handler_calls"] - before
        counts = cuda.call_counts(), cpu.call_counts()
        comm_id = cuda.register_comm(comm.py2f())
    finally:
        comm.Free()
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype = ctypes.c_void_p
    pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    readers = {
        pointer(m.in_flight_reader(), b"mpi4jax_dist.in_flight") for m in (cpu, cuda)
    }
    problems = []
    if seen != 1:
        problems.append(f"the CUDA module counted {seen} CPU handler calls, not 1")
    if counts[0] != counts[1] or counts[0][comm_id - 1] != 1:
        problems.append(f"call_counts: CUDA module {counts[0]}, CPU module {counts[1]}")
    if len(readers) != 1:
        problems.append(f"two records: in_flight_reader() at {sorted(readers)}")
    totals = mpi4jax_dist.op_counts()
    if totals["handler_calls"] != cpu.stats()["handler_calls"]:
        problems.append(f"op_counts {totals} counts the one core twice")
    util.all_ranks(not problems, problems)


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
    with _compat.enable_x64(True):
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
    # Host memory: one staging buffer (64 MiB by default), not the message.
    staging = ext.staging_bytes()
    if not 0 < stats["pinned_peak_bytes"] <= staging:
        problems.append(f"pinned {stats['pinned_peak_bytes']} B > {staging}: {stats}")
    want = pieces(nbytes, 4, staging, _config.allreduce_chunk_bytes())
    if stats["staged_chunks"] != want:
        problems.append(f"not {want} pieces: {stats}")
    all_ranks(not problems, problems)


def pieces(nbytes: int, itemsize: int, staging: int, chunk: int) -> int:
    """How many pieces the staged handler sends a message in: each at most half
    the staging buffer (a multiple of 16 bytes) and at most one chunk."""
    per_piece = staging // 2 // 16 * 16 // itemsize
    if chunk:
        per_piece = min(per_piece, max(1, chunk // itemsize))
    return -(-(nbytes // itemsize) // per_piece)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunk", ["1M", "256K", "0"])
def test_gpu_pinned_buffer_bounded_and_reused(monkeypatch, staged, chunk):
    """Three calls of 16 MiB through one 1 MiB staging buffer, allocated once:
    in pieces of half the buffer, or of a smaller chunk; and with chunking off
    (0), still half the buffer, never the message."""
    import jax
    import jax.numpy as jnp

    gpu()
    comm = world()
    ext = _ffi.load_cuda()
    monkeypatch.setenv(CHUNK, chunk)
    n = 4 * MiB  # 16 MiB of float32
    p = comm.size
    reduce = jax.jit(lambda a: mpi4jax_dist.allreduce(a), donate_argnums=0)
    problems = []
    size = ext.staging_bytes()
    ext.release_pinned()
    ext.set_staging_bytes(MiB)
    try:
        ext.reset_stats()
        for i in range(3):
            # Different on every element and call: a piece copied back to the
            # wrong place, or a half overwritten too early, shows.
            x = jnp.arange(n, dtype=jnp.int32) % 4099 + comm.rank + i
            y = np.asarray(reduce(x.astype(jnp.float32)))
            want = np.arange(n) % 4099 * p + p * (p - 1) // 2 + p * i
            if not np.array_equal(y, want.astype(np.float32)):
                bad = np.flatnonzero(y != want)
                problems.append(f"call {i}: {bad.size} wrong, first at {bad[:4]}")
        stats = ext.stats()
        freed = ext.release_pinned()
    finally:
        ext.release_pinned()
        ext.set_staging_bytes(size)
    want_pieces = pieces(4 * n, 4, MiB, _config.allreduce_chunk_bytes())
    # Allocated once and reused by every piece of all three calls.
    if stats["pinned_peak_bytes"] != MiB or stats["pinned_bytes"] != MiB:
        problems.append(f"pinned bytes not one 1 MiB buffer: {stats}")
    if stats["staged_chunks"] != 3 * want_pieces:
        problems.append(f"not {want_pieces} pieces per call: {stats}")
    if stats["max_call_count"] > MiB // 2 // 4:
        problems.append(f"an MPI call above half the buffer: {stats}")
    if freed != MiB:
        problems.append(f"release_pinned freed {freed} bytes, not the one buffer")
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


# 2**31 + 16 int8 per rank: 2 GiB on the device, one 64 MiB staging buffer on the
# host.
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

    with _compat.enable_x64(True):
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
    want = pieces(LARGE, 1, ext.staging_bytes(), _config.allreduce_chunk_bytes())
    if stats["staged_chunks"] != want:
        problems.append(f"not in {want} pieces: {stats}")
    all_ranks(not problems, problems)
