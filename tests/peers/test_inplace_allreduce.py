"""With peers: mpi4jax_dist.allreduce, in place and above 2**31 elements.

mpiexec -n 2 (and 4) python -m pytest --with-mpi. Results are checked against
mpi4py's Allreduce; what the handler did (one buffer or two, how many MPI calls
of what size) is counted by the extension itself. Asserts gather the outcome
first, so that one failing rank does not leave the others in a collective.
"""

import math
import re
import subprocess
import sys

import numpy as np
import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import _compat, _config, _ffi
from mpi4jax_dist.ops import allreduce as allreduce_ops
from mpi4jax_dist.ops import common

pytestmark = [pytest.mark.mpi(min_size=2), util.every_mpi]

CHUNK = _config.ALLREDUCE_CHUNK_BYTES
INT_MAX = 2**31 - 1


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def extension():
    return _ffi.load()


def first_line(library_version: str) -> str:
    return " ".join(library_version.strip().splitlines()[0].split())


def values(dtype: str, op: str, rank: int, n: int = 37) -> np.ndarray:
    """Per-rank inputs whose reduction is exact (:func:`util.exact_inputs`)."""
    return util.exact_inputs(dtype, op, rank, seed=1000, n=n)


def test_every_dtype_and_op_against_mpi4py():
    import jax
    from mpi4py import MPI

    comm = world()
    wrong, refused = [], []
    with _compat.enable_x64(True):
        for dtype, allowed in common.OPS_BY_DTYPE.items():
            for op in common.OPS:
                x = values(dtype, op, comm.rank)
                mpi_op = getattr(MPI, op)
                if op not in allowed:
                    try:
                        mpi4jax_dist.allreduce(x, mpi_op)
                        refused.append(f"{dtype} {op}: no TypeError")
                    except TypeError as e:
                        if f"MPI.{op}" not in str(e) or dtype not in str(e):
                            refused.append(f"{dtype} {op}: {e}")
                    continue
                expected = np.empty_like(x)
                comm.Allreduce(x, expected, op=mpi_op)
                got = jax.jit(lambda a, o=mpi_op: mpi4jax_dist.allreduce(a, o))(x)
                got = np.asarray(got)
                if got.dtype != x.dtype or not np.array_equal(got, expected):
                    wrong.append(f"{dtype} {op}: {got[:4]} != {expected[:4]}")
    all_ranks(not wrong, wrong)
    all_ranks(not refused, refused)


def test_eager_jit_loops_and_vmap():
    import jax
    import jax.numpy as jnp
    from jax import lax

    comm = world()
    rank, size = comm.rank, comm.size
    x = jnp.arange(6, dtype=jnp.float32) + rank
    total = np.arange(6, dtype=np.float32) * size + size * (size - 1) / 2
    # Three steps of c -> allreduce(c + 1), starting from the per-rank x.
    three = total + size
    for _ in range(2):
        three = size * (three + 1)

    def body(c):
        return mpi4jax_dist.allreduce(c + 1)

    def while_three(a):
        def next_state(s):
            return s[0] + 1, body(s[1])

        return lax.while_loop(lambda s: s[0] < 3, next_state, (0, a))[1]

    def scan_three(a):
        return lax.scan(lambda c, _: (body(c), c.sum()), a, None, length=3)

    stacked = jnp.stack([x, 2 * x, 3 * x])
    cases = {
        "eager": (lambda: mpi4jax_dist.allreduce(x), total),
        "eager scalar": (lambda: mpi4jax_dist.allreduce(1.5), 1.5 * size),
        "jit": (lambda: jax.jit(mpi4jax_dist.allreduce)(x), total),
        "fori_loop": (
            lambda: jax.jit(lambda a: lax.fori_loop(0, 3, lambda i, c: body(c), a))(x),
            three,
        ),
        "while_loop": (lambda: jax.jit(while_three)(x), three),
        "scan": (lambda: jax.jit(scan_three)(x)[0], three),
        "vmap": (
            lambda: jax.vmap(mpi4jax_dist.allreduce)(stacked),
            np.stack([total, 2 * total, 3 * total]),
        ),
        "vmap axis 1": (
            lambda: jax.vmap(mpi4jax_dist.allreduce, in_axes=1, out_axes=1)(stacked),
            np.stack([total, 2 * total, 3 * total]),
        ),
        "jit of vmap": (
            lambda: jax.jit(jax.vmap(mpi4jax_dist.allreduce))(stacked),
            np.stack([total, 2 * total, 3 * total]),
        ),
    }
    wrong = []
    for name, (run, expected) in cases.items():
        try:
            got = np.asarray(run())
            if not np.array_equal(got, expected):
                wrong.append(f"{name}: {got} != {expected}")
        except Exception as e:  # report, do not leave the other ranks waiting
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    all_ranks(not wrong, wrong)


def test_grad_and_jvp_as_mpi4jax():
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    rank = world().rank
    x = jnp.linspace(0.1, 1.0, 5, dtype=jnp.float32) + rank

    def loss(reduce):
        return lambda a: jnp.sum(jnp.sin(reduce(a * a)))

    ours = loss(mpi4jax_dist.allreduce)
    theirs = loss(lambda a: mpi4jax.allreduce(a, op=MPI.SUM))
    problems = []
    for name, got, want in (
        ("grad", jax.grad(ours)(x), jax.grad(theirs)(x)),
        ("jit(grad)", jax.jit(jax.grad(ours))(x), jax.jit(jax.grad(theirs))(x)),
    ):
        if not np.array_equal(np.asarray(got), np.asarray(want)):
            problems.append(f"{name}: {got} != mpi4jax's {want}")
    value, tangent = jax.jvp(mpi4jax_dist.allreduce, (x,), (2 * x,))
    if not np.array_equal(np.asarray(tangent), 2 * np.asarray(value)):
        problems.append(f"jvp: {tangent} != 2 * {value}")
    try:
        jax.grad(lambda a: jnp.sum(mpi4jax_dist.allreduce(a, MPI.MAX)))(x)
        problems.append("grad of MAX: no NotImplementedError")
    except NotImplementedError as e:
        if "MPI.SUM" not in str(e):
            problems.append(f"grad of MAX: {e}")
    all_ranks(not problems, problems)


def memory(f, x) -> int:
    """Temp bytes XLA plans for ``f`` on ``x``."""
    return f.lower(x).compile().memory_analysis().temp_size_in_bytes


@util.more_ranks  # in place over more than a pair's rounds
def test_donated_call_reduces_in_place():
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    comm = world()
    n = 1 << 18  # 1 MiB of float32
    ours = jax.jit(mpi4jax_dist.allreduce, donate_argnums=0)
    theirs = jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM), donate_argnums=0)
    x = jnp.arange(n, dtype=jnp.float32) + comm.rank
    before = x.unsafe_buffer_pointer()
    ext = extension()
    ext.reset_stats()
    y = ours(x)
    y.block_until_ready()
    stats = ext.stats()
    expected = np.arange(n, dtype=np.float32) * comm.size + sum(range(comm.size))
    problems = []
    if y.unsafe_buffer_pointer() != before or not x.is_deleted():
        problems.append("the donated buffer was not the result's")
    if stats["handler_calls"] != 1 or stats["same_buffer_calls"] != 1:
        problems.append(f"handler did not see one buffer: {stats}")
    if not np.array_equal(np.asarray(y), expected):
        problems.append("wrong sum")
    spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    temp, temp_mpi4jax = memory(ours, spec), memory(theirs, spec)
    if temp != 0:
        problems.append(f"{temp} temp bytes planned for the in-place op")
    # The same measurement sees mpi4jax's out-of-place buffer: the check can fail.
    if temp_mpi4jax < 4 * n:
        problems.append(f"mpi4jax plans {temp_mpi4jax} temp bytes, < one message")
    all_ranks(not problems, problems)


def test_op_counts_count_what_ran():
    """The public diagnostic counts what ran, from zero after a reset: two calls,
    each one MPI call of 8 elements, each handed one buffer (the donated one
    reduced where it was; the other XLA copied first, its caller's buffer kept:
    the addresses tell the two apart, not the count)."""
    import jax
    import jax.numpy as jnp

    comm = world()
    mpi4jax_dist.op_counts(reset=True)
    assert mpi4jax_dist.op_counts()["handler_calls"] == 0
    donated = jax.jit(lambda a: mpi4jax_dist.allreduce(a), donate_argnums=0)
    kept = jax.jit(lambda a: mpi4jax_dist.allreduce(a))
    x, w = jnp.ones(8), jnp.ones(8)
    x_at, w_at = x.unsafe_buffer_pointer(), w.unsafe_buffer_pointer()
    y, z = kept(x), donated(w)
    counts = mpi4jax_dist.op_counts(reset=True)
    problems = []
    want = {"handler_calls": 2, "same_buffer_calls": 2, "mpi_calls": 2}
    if {k: counts[k] for k in want} != want or counts["max_call_count"] != 8:
        problems.append(f"counts: {counts}")
    if y.unsafe_buffer_pointer() == x_at or z.unsafe_buffer_pointer() != w_at:
        problems.append("the kept argument was written, or the donated one moved")
    if not (np.asarray(y) == comm.size).all() or not (np.asarray(z) == comm.size).all():
        problems.append("wrong sum")
    if mpi4jax_dist.op_counts()["handler_calls"] != 0:
        problems.append("reset=True did not reset")
    all_ranks(not problems, problems)


def test_chunks_and_one_call(monkeypatch):
    import jax
    import jax.numpy as jnp

    comm = world()
    ext = extension()
    n = 1001
    x = jnp.arange(n, dtype=jnp.float32) + comm.rank
    expected = np.arange(n, dtype=np.float32) * comm.size + sum(range(comm.size))
    problems = []
    # 12 bytes: 3 float32 per MPI call, the last call takes the 2 left over.
    for setting, calls, largest in (("12", math.ceil(n / 3), 3), ("0", 1, n)):
        monkeypatch.setenv(CHUNK, setting)
        ext.reset_stats()
        got = np.asarray(jax.jit(lambda a: mpi4jax_dist.allreduce(a * 1))(x))
        stats = ext.stats()
        if not np.array_equal(got, expected):
            problems.append(f"{CHUNK}={setting}: wrong sum")
        if (stats["mpi_calls"], stats["max_call_count"]) != (calls, largest):
            problems.append(f"{CHUNK}={setting}: {stats}, not {calls} x {largest}")
    monkeypatch.setenv(CHUNK, "lots")
    try:
        jax.jit(lambda a: mpi4jax_dist.allreduce(a * 2))(x)
        problems.append(f"{CHUNK}=lots: no ValueError")
    except ValueError as e:
        if CHUNK not in str(e):
            problems.append(str(e))
    all_ranks(not problems, problems)


def test_chunk_setting_parsed():
    parse = _config.allreduce_chunk_bytes
    assert parse({}) == 64 << 20
    assert parse({CHUNK: "0"}) == 0
    assert parse({CHUNK: "4096"}) == 4096
    assert parse({CHUNK: "16M"}) == parse({CHUNK: "16MiB"}) == 16 << 20
    assert parse({CHUNK: "1g"}) == 1 << 30
    for bad in ("-1", "1.5M", "64 MB please"):
        with pytest.raises(ValueError, match=CHUNK):
            parse({CHUNK: bad})


@pytest.mark.parametrize(
    "platform, advice",
    [
        ("rocm", "On AMD GPUs use mpi4jax.allreduce"),
        ("oneapi", "MPI4JAX_USE_SYCL_MPI=1"),
        ("tpu", "There use mpi4jax.allreduce, or lax.psum inside shard_map"),
    ],
)
def test_a_platform_without_a_handler_is_refused_by_name(platform, advice):
    """Lowered for a platform it has no handler for (JAX lowers for a platform
    name without its plugin), the allreduce raises naming it and what runs there:
    no CPU fallback. CUDA lowers (its handler is tested in _gpu)."""
    import jax
    import jax.numpy as jnp

    traced = jax.jit(mpi4jax_dist.allreduce).trace(jnp.ones(3))
    traced.lower(lowering_platforms=("cuda",))
    with pytest.raises(NotImplementedError) as info:
        traced.lower(lowering_platforms=(platform,))
    said = str(info.value)
    assert f"no handler for the {platform} platform" in said, said
    assert "runs on CPU and CUDA only" in said and "does not fall back" in said, said
    assert advice in said, said


def test_refused_before_any_mpi_call(monkeypatch):
    import jax.numpy as jnp
    from mpi4py import MPI

    def no_mpi(*args, **kwargs):
        raise AssertionError("MPI was reached")

    monkeypatch.setattr(allreduce_ops, "check_mpi", no_mpi)
    monkeypatch.setattr(allreduce_ops, "communicator", no_mpi)
    monkeypatch.setattr(_ffi, "load", no_mpi)
    problems = []
    cases = (
        (jnp.ones(3, jnp.bfloat16), None, ("bfloat16", "float32")),
        (jnp.ones(3, jnp.float16), MPI.SUM, ("float16",)),
        (jnp.ones(3, jnp.complex64), MPI.MIN, ("complex64", "MPI.MIN", "MPI.SUM")),
        (jnp.ones(3, bool), MPI.SUM, ("bool", "MPI.LOR")),
        (jnp.ones(3, jnp.float32), MPI.BAND, ("float32", "MPI.BAND")),
        (jnp.ones(3, jnp.float32), MPI.MAXLOC, ("MPI.SUM",)),
        (jnp.ones(3, jnp.float32), "sum", ("MPI.SUM",)),
    )
    for x, op, words in cases:
        try:
            mpi4jax_dist.allreduce(x, op)
            problems.append(f"{x.dtype} {op}: no TypeError")
        except TypeError as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                problems.append(f"{x.dtype} {op}: {missing} not in {e}")
        except AssertionError as e:
            problems.append(f"{x.dtype} {op}: {e}")
    monkeypatch.undo()
    try:
        mpi4jax_dist.allreduce(jnp.ones(3), comm="world")
        problems.append("comm='world': no TypeError")
    except TypeError:
        pass
    all_ranks(not problems, problems)


def test_refused_dtype_starts_no_mpi_in_fresh_process():
    comm = world()
    code = (
        "import sys, jax.numpy as jnp, mpi4jax_dist\n"
        "try:\n"
        "    mpi4jax_dist.allreduce(jnp.ones(3, jnp.bfloat16))\n"
        "except TypeError:\n"
        "    print('TypeError', 'mpi4py.MPI' in sys.modules, 'mpi4jax' in sys.modules)"
    )
    out = None
    if comm.rank == 0:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=util.clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = proc.stdout.strip() + proc.stderr[-500:]
    out = comm.bcast(out)
    all_ranks(out == "TypeError False False", out)


CALL = re.compile(r"(%[\w#]+)(?::\d+)? = stablehlo\.custom_call @(\w+)\(([^)]*)\)")


def token_chain(text: str) -> list[str]:
    """Return the MPI custom calls of a lowered module as one token chains them.

    Each call takes its token last; the chain follows it back, through
    ``mpi4jax_dist_token_after`` (a token made from an allreduce's result) or an
    mpi4jax call's second result, to the call before. A call whose token does
    not come from the one before it (two chains, a call left out) breaks it off.
    """
    calls, made_from = [], {}
    for result, target, operands in CALL.findall(text):
        args = [a.strip() for a in operands.split(",") if a.strip()]
        if target == "mpi4jax_dist_token_after":
            made_from[result] = args[0]
        else:
            calls.append((result, target, args[-1]))
    chain, previous = [], None
    for result, target, token in calls:
        source = made_from.get(token, token.split("#")[0])
        if previous is not None and source != previous:
            break
        chain.append(target)
        previous = result
    return chain


def test_one_token_orders_ours_and_mpi4jax():
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4jax._src.utils import ordered_effect
    from mpi4py import MPI

    comm = world()

    def f(a, b, c):
        # No data dependencies: only the token keeps these in program order.
        return (
            mpi4jax_dist.allreduce(a),
            mpi4jax.allreduce(b, op=MPI.MAX),
            mpi4jax_dist.allreduce(c, MPI.MIN),
        )

    a = jnp.arange(3.0) + comm.rank
    b = jnp.arange(1000.0) + comm.rank
    c = jnp.arange(7, dtype=jnp.int32) - comm.rank
    effects = jax.make_jaxpr(f)(a, b, c).effects
    text = jax.jit(f).lower(a, b, c).as_text()
    problems = []
    if effects != {ordered_effect}:
        problems.append(f"effects {effects}, expected mpi4jax's one ordered effect")
    chain = token_chain(text)
    if chain != [
        "mpi4jax_dist_allreduce",
        "mpi_allreduce_ffi",
        "mpi4jax_dist_allreduce",
    ]:
        problems.append(f"MPI calls not chained in program order: {chain}")
    # The check can fail: the last call's token taken from the one the first call
    # took (the jit's token input, or the token made in the program).
    calls = CALL.findall(text)
    first_token = calls[0][2].rsplit(",", 1)[-1].strip()
    *_, (_, _, last) = [c for c in calls if c[1] == "mpi4jax_dist_allreduce"]
    call = "@mpi4jax_dist_allreduce({})"
    cut = text.replace(
        call.format(last), call.format(f"{last.rsplit(',', 1)[0]}, {first_token}")
    )
    if len(token_chain(cut)) != 2:
        problems.append(f"a cut chain passes: {token_chain(cut)}")
    g = jax.jit(f)
    for _ in range(20):
        got = [np.asarray(r) for r in g(a, b, c)]
    want = [
        np.arange(3.0) * comm.size + sum(range(comm.size)),
        np.arange(1000.0) + comm.size - 1,
        np.arange(7) - (comm.size - 1),
    ]
    if not all(np.array_equal(g_, w) for g_, w in zip(got, want, strict=True)):
        problems.append(f"{got} != {want}")
    all_ranks(not problems, problems)


@util.more_ranks  # halves of two ranks each (of one at -n 2)
def test_any_intracommunicator():
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    comm = world()
    halves = comm.Split(comm.rank % 2, comm.rank)
    dup = comm.Dup()
    problems = []
    try:
        for name, c in (("COMM_WORLD", comm), ("Dup", dup), ("Split", halves)):
            x = np.arange(5, dtype=np.int32) * (comm.rank + 1)
            expected = np.empty_like(x)
            c.Allreduce(x, expected, op=MPI.SUM)
            got = jax.jit(lambda a, c=c: mpi4jax_dist.allreduce(a, comm=c))(
                jnp.asarray(x)
            )
            if not np.array_equal(np.asarray(got), expected):
                problems.append(f"{name}: {got} != {expected}")
    finally:
        halves.Free()
        dup.Free()
    all_ranks(not problems, problems)


def test_extension_matches_mpi4py():
    from mpi4py import MPI

    ext = extension()
    theirs = MPI.Get_library_version()
    problems = []
    if ext.library_version() != theirs:
        problems.append(f"{ext.library_version()!r} != {theirs!r}")
    if _ffi.mismatch(theirs, ext.HEADER_MPI, theirs, "x.so") is not None:
        problems.append(f"{ext.HEADER_MPI} refused beside {theirs!r}")
    # The check can fail: another library, or headers of another family.
    mpich = "MPICH" in theirs
    other = "Open MPI v5.0.11, package: x" if mpich else "MPICH Version: 5.0.2"
    message = _ffi.mismatch(other, ext.HEADER_MPI, theirs, "x.so") or ""
    if other.split(",")[0] not in message or first_line(theirs) not in message:
        problems.append(f"another library not named: {message!r}")
    other_header = "Open MPI 5.0.11" if mpich else "MPICH 5.0.2"
    if _ffi.mismatch(theirs, other_header, theirs, "x.so") is None:
        problems.append(f"headers of {other_header} accepted beside {theirs!r}")
    all_ranks(not problems, problems)


def test_missing_build_names_both_mpis(monkeypatch):
    from mpi4py import MPI

    monkeypatch.setattr(_ffi, "built", lambda: {})
    try:
        _ffi.load.__wrapped__()
        message = "no ImportError"
    except ImportError as e:
        message = str(e)
    first = first_line(MPI.Get_library_version())
    all_ranks(first in message and "no MPI at all" in message, message)


# 2**31 + 16 int8 per rank: 2 GiB per buffer. In place, a rank holds one buffer
# plus MPI's scratch (up to another message when one call takes it all, with
# MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES=0); 6 GiB per rank leaves room for JAX.
LARGE = 2**31 + 16
LARGE_NEED = 6 << 30


# The counts above INT_MAX are the package's C and the MPI's (every_mpi); JAX hands
# the op the same buffer under every version: not run again on the oldest JAX.
@util.same_under_every_jax
@pytest.mark.timeout(900)
def test_count_above_2_31(monkeypatch):
    import jax
    import jax.numpy as jnp
    import psutil
    from jax import lax
    from mpi4py import MPI

    comm = world()
    if comm.size != 2:
        pytest.skip(
            "2**31 + 16 int8 per rank runs in the 2-rank job only: 4 ranks on one "
            "host would need 24 GiB"
        )
    free = comm.allreduce(psutil.virtual_memory().available, op=MPI.MIN)
    if free < comm.size * LARGE_NEED:
        pytest.skip(
            f"2**31 + 16 int8 per rank needs {comm.size * LARGE_NEED >> 30} GiB "
            f"free on the host, {free / 2**30:.1f} GiB are"
        )
    rank, ext = comm.rank, extension()

    @jax.jit
    def make():  # in place: a concatenate of 2 GiB takes 15 s here, this 1 s
        ends = jnp.arange(16, dtype=jnp.int8) + rank
        x = jnp.full((LARGE,), rank + 1, jnp.int8)
        x = lax.dynamic_update_slice(x, ends, (np.int64(0),))
        return lax.dynamic_update_slice(x, -ends, (np.int64(LARGE - 16),))

    @jax.jit
    def ends(a):  # in jit: eagerly, an index above 2**31 overflows JAX's int32
        return lax.slice(a, (0,), (16,)), lax.slice(a, (LARGE - 16,), (LARGE,))

    @jax.jit
    def middle_ok(a):
        return jnp.all(lax.slice(a, (16,), (LARGE - 16,)) == 3)

    head = 2 * np.arange(16, dtype=np.int8) + 1
    problems = []
    # One MPI_Allreduce_c where the MPI has a working one (not Intel MPI 2021's).
    large = ext.ALLREDUCE_LARGE_COUNT
    one_call = (1, 1) if large else (2, 0)
    for setting, (calls, large_calls), largest in (
        ("0", one_call, LARGE if large else INT_MAX),
        ("", (math.ceil(LARGE / (64 << 20)), 0), 64 << 20),
    ):
        monkeypatch.setenv(CHUNK, setting)
        reduce = jax.jit(lambda a: mpi4jax_dist.allreduce(a), donate_argnums=0)
        with _compat.enable_x64(True):  # int64 indices for the update at the end
            x = make()
        ext.reset_stats()
        y = reduce(x)
        stats = ext.stats()
        got_head, got_tail = (np.asarray(a) for a in ends(y))
        if not np.array_equal(got_head, head) or not np.array_equal(got_tail, -head):
            problems.append(f"{CHUNK}={setting!r}: ends {got_head} {got_tail}")
        if not bool(middle_ok(y)):
            problems.append(f"{CHUNK}={setting!r}: middle not all 3")
        counted = (stats["mpi_calls"], stats["large_count_calls"])
        if counted != (calls, large_calls) or stats["max_call_count"] != largest:
            problems.append(f"{CHUNK}={setting!r}: {stats}")
        if stats["same_buffer_calls"] != 1:
            problems.append(f"{CHUNK}={setting!r}: not in place: {stats}")
        del x, y
    all_ranks(not problems, problems)
