"""The non-blocking allreduce: mpi4jax_dist.iallreduce and its Request's overlap,
test and wait.

With peers: mpiexec -n 2 (and 4) python -m pytest --with-mpi
tests/peers/test_iallreduce.py
(results against mpi4py's Allreduce, eager and jitted, in loops, with work
overlapped; the errors a start without its wait and other misuse raise). Serially
(python -m pytest): the order of start, overlapped work and wait in the compiled
program, and the report at exit, on one process. Asserts gather the outcome first
(``all_ranks``), so that one failing rank does not leave the others in a collective.
"""

import math
import re
import textwrap
import warnings

import numpy as np
import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import _compat, _ffi
from mpi4jax_dist.ops import common, lifecycle
from mpi4jax_dist.ops import iallreduce as iallreduce_ops

pytestmark = util.every_mpi

mpi = pytest.mark.mpi(min_size=2)
INT_MAX = 2**31 - 1


def values(dtype: str, op: str, rank: int, n: int = 37) -> np.ndarray:
    """Per-rank inputs whose reduction is exact (:func:`util.exact_inputs`)."""
    return util.exact_inputs(dtype, op, rank, seed=2000, n=n)


def reduced(comm, x, op):
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=op)
    return out


def overlapped(x, op, w):
    """Start reducing ``x``, overlap some work on ``w`` (with a test between two
    pieces), wait: the reduced ``x`` and the work's result."""
    import jax.numpy as jnp

    req = mpi4jax_dist.iallreduce(x, op)
    req, a = req.overlap(lambda v: jnp.sin(v) * 2, w)
    req = req.test()
    req, b = req.overlap(lambda v: jnp.sum(v * v), a)
    return req.wait(), b


def extension():
    return _ffi.load()


# ---------------------------------------------------------------------------------
# With peers: results


@mpi
def test_every_dtype_and_op_against_mpi4py(world):
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    w = jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32)
    work = float(jnp.sum(jnp.sin(w) ** 2 * 4))
    wrong = []
    eager_ops = set()  # eagerly, each op once: the same handler, another dispatch

    def check(dtype, op, how, got, b, expected):
        got = np.asarray(got)
        if got.dtype != expected.dtype or not np.array_equal(got, expected):
            wrong.append(f"{dtype} {op} {how}: {got[:4]} != {expected[:4]}")
        if not math.isclose(float(b), work, rel_tol=1e-5):
            wrong.append(f"{dtype} {op} {how}: work {b} != {work}")

    with _compat.enable_x64(True):
        for dtype, allowed in common.OPS_BY_DTYPE.items():
            # Per op: this rank's input, the MPI op, and mpi4py's reduction of it.
            cases = {}
            for op in allowed:
                x, mpi_op = values(dtype, op, comm.rank), getattr(MPI, op)
                cases[op] = x, mpi_op, reduced(comm, x, mpi_op)

            # Jitted: one program per dtype, each op's start, work and wait in turn
            # (one compilation per dtype rather than per dtype and op).
            def every_op(xs, w, cases=cases):
                return {op: overlapped(xs[op], cases[op][1], w) for op in cases}

            try:
                found = jax.jit(every_op)({op: c[0] for op, c in cases.items()}, w)
            except Exception as e:  # report; do not leave the others waiting
                wrong.append(f"{dtype} jit: {type(e).__name__}: {e}")
                found = {}
            for op, (got, b) in found.items():
                check(dtype, op, "jit", got, b, cases[op][2])
            for op, (x, mpi_op, expected) in cases.items():
                if op in eager_ops:
                    continue
                eager_ops.add(op)
                try:
                    got, b = overlapped(x, mpi_op, w)
                except Exception as e:
                    wrong.append(f"{dtype} {op} eager: {type(e).__name__}: {e}")
                    continue
                check(dtype, op, "eager", got, b, expected)
    all_ranks(not wrong, wrong)


@mpi
def test_eager_jit_loops_and_vmap(world):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    x = jnp.arange(6, dtype=jnp.float32) + rank
    total = np.arange(6, dtype=np.float32) * size + size * (size - 1) / 2
    three = total + size  # three steps of c -> allreduce(c + 1)
    for _ in range(2):
        three = size * (three + 1)

    def step(c, w):
        req = mpi4jax_dist.iallreduce(c + 1)
        req, w = req.overlap(lambda v: v * 0.5 + 1.0, w)
        req = req.test()
        return req.wait(), w

    def fori(a):
        return lax.fori_loop(0, 3, lambda i, s: step(*s), (a, jnp.ones(100)))[0]

    def while_three(a):
        def body(s):
            return (s[0] + 1, *step(s[1], s[2]))

        return lax.while_loop(lambda s: s[0] < 3, body, (0, a, jnp.ones(100)))[1]

    def scan_three(a):
        return lax.scan(lambda s, _: (step(*s), None), (a, jnp.ones(8)), length=3)[0][0]

    def start_wait(a):
        return mpi4jax_dist.iallreduce(a).wait()

    stacked = jnp.stack([x, 2 * x, 3 * x])
    by_row = np.stack([total, 2 * total, 3 * total])
    cases = {
        "eager": (lambda: start_wait(x), total),
        "eager scalar": (lambda: start_wait(1.5), 1.5 * size),
        "eager overlapped": (lambda: step(x - 1, jnp.ones(4))[0], total),
        "jit": (lambda: jax.jit(start_wait)(x), total),
        "jit overlapped": (lambda: jax.jit(step)(x - 1, jnp.ones(4))[0], total),
        "fori_loop": (lambda: jax.jit(fori)(x), three),
        "while_loop": (lambda: jax.jit(while_three)(x), three),
        "scan": (lambda: jax.jit(scan_three)(x), three),
        "vmap": (lambda: jax.vmap(start_wait)(stacked), by_row),
        "jit of vmap": (lambda: jax.jit(jax.vmap(start_wait))(stacked), by_row),
        "vmap axis 1": (
            lambda: jax.vmap(start_wait, in_axes=1, out_axes=1)(stacked),
            by_row,
        ),
        "empty": (lambda: jax.jit(start_wait)(jnp.zeros(0)), np.zeros(0)),
    }
    ext = extension()
    ext.reset_stats()
    wrong = []
    for name, (run, expected) in cases.items():
        try:
            got = np.asarray(run())
            if got.shape != np.shape(expected) or not np.array_equal(got, expected):
                wrong.append(f"{name}: {got} != {expected}")
        except Exception as e:  # report, do not leave the other ranks waiting
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    stats = ext.stats()
    if stats["iallreduce_starts"] != stats["iallreduce_waits"]:
        wrong.append(f"starts and waits differ: {stats}")
    if ext.pending_requests():
        wrong.append(f"left pending: {ext.pending_requests()}")
    all_ranks(not wrong, wrong)


@mpi
def test_derivatives_flow_through_the_overlapped_work(world):
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    c = jnp.arange(3.0) + MPI.COMM_WORLD.rank

    def f(w):
        req = mpi4jax_dist.iallreduce(c)
        req, y = req.overlap(jnp.sin, w)
        return jnp.sum(req.wait() * y)

    w = jnp.linspace(0.0, 1.0, 3)
    total = np.arange(3.0) * MPI.COMM_WORLD.size + sum(range(MPI.COMM_WORLD.size))
    problems = []
    for name, grad in (("grad", jax.grad(f)), ("jit(grad)", jax.jit(jax.grad(f)))):
        got = np.asarray(grad(w))
        if not np.allclose(got, total * np.cos(np.asarray(w))):
            problems.append(f"{name}: {got}")

    def through(x):
        return jnp.sum(mpi4jax_dist.iallreduce(x).wait())

    problem = outcome(lambda: jax.grad(through)(w), NotImplementedError, "allreduce")
    if problem:
        problems.append(f"grad through the reduction: {problem}")
    all_ranks(not problems, problems)


@mpi
@util.more_ranks  # in place while more than a pair's rounds are in flight
def test_donated_buffer_is_reduced_in_place(world):
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = 1 << 16

    def f(a):
        return mpi4jax_dist.iallreduce(a).wait()

    ours = jax.jit(f, donate_argnums=0)
    x = jnp.arange(n, dtype=jnp.float32) + comm.rank
    before = x.unsafe_buffer_pointer()
    y = ours(x)
    expected = np.arange(n, dtype=np.float32) * comm.size + sum(range(comm.size))
    problems = []
    if y.unsafe_buffer_pointer() != before or not x.is_deleted():
        problems.append("the donated buffer was not the result's")
    if not np.array_equal(np.asarray(y), expected):
        problems.append("wrong sum")
    temp = (
        ours.lower(jax.ShapeDtypeStruct((n,), jnp.float32))
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
    )
    if temp >= 4 * n:
        problems.append(f"{temp} temp bytes planned: a second buffer")
    all_ranks(not problems, problems)


@mpi
@util.more_ranks  # halves of two ranks each (of one at -n 2)
def test_any_intracommunicator(world):
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    halves = comm.Split(comm.rank % 2, comm.rank)
    problems = []
    try:
        for name, c in (("COMM_WORLD", comm), ("Split", halves)):
            x = np.arange(5, dtype=np.int32) * (comm.rank + 1)
            expected = reduced(c, x, MPI.SUM)

            def f(a, c=c):
                return mpi4jax_dist.iallreduce(a, comm=c).wait()

            got = jax.jit(f)(jnp.asarray(x))
            if not np.array_equal(np.asarray(got), expected):
                problems.append(f"{name}: {got} != {expected}")
    finally:
        halves.Free()
    all_ranks(not problems, problems)


@mpi
@util.more_ranks  # left and right neighbours differ (are one at -n 2)
def test_ordered_with_mpi4jax_calls(world):
    """One token orders the start, mpi4jax's calls placed in the overlapped work
    (a halo exchange), and the wait: every rank makes them in program order."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def f(x, v):
        req = mpi4jax_dist.iallreduce(x)
        req, got = req.overlap(
            lambda v: mpi4jax.sendrecv(v, v, left, right, comm=comm)
            + mpi4jax.allreduce(v, op=MPI.MAX, comm=comm),
            v,
        )
        return req.wait(), got

    x = jnp.arange(4.0) + comm.rank
    v = jnp.full(3, float(comm.rank))
    g = jax.jit(f)
    problems = []
    for _ in range(10):
        y, got = g(x, v)
    if not np.array_equal(
        np.asarray(y), np.arange(4.0) * comm.size + 1.0 * sum(range(comm.size))
    ):
        problems.append(f"reduced {y}")
    if not np.array_equal(np.asarray(got), np.full(3, left + comm.size - 1.0)):
        problems.append(f"work {got}")
    all_ranks(not problems, problems)


# ---------------------------------------------------------------------------------
# With peers: what is caught


def outcome(call, exception, *words):
    """None if ``call()`` raises ``exception`` whose message holds ``words``, else
    what happened."""
    try:
        call()
        return "no error"
    except exception as err:
        missing = [w for w in words if w not in str(err)]
        return f"{missing} not in: {err}" if missing else None
    except Exception as err:
        return f"{type(err).__name__}: {err}"


@mpi
def test_start_without_wait_is_an_error_at_trace_time(world):
    import jax
    import jax.numpy as jnp
    from jax import lax

    ext = extension()
    x = jnp.arange(3.0)

    def dropped(a):
        mpi4jax_dist.iallreduce(a)  # the request is dropped here
        return a

    def dropped_after_overlap(a, w):
        req = mpi4jax_dist.iallreduce(a)
        req, w = req.overlap(jnp.sin, w)
        return w

    def dropped_in_loop(a):
        def body(i, c):
            mpi4jax_dist.iallreduce(c).test()
            return c + 1

        return lax.fori_loop(0, 2, body, a)

    ext.reset_stats()
    problems = [
        outcome(
            lambda f=f, args=args: jax.jit(f)(*args), RuntimeError, "never waited", site
        )
        for f, args, site in (
            (dropped, (x,), "in dropped"),
            (dropped_after_overlap, (x, x), "in dropped_after_overlap"),
            (dropped_in_loop, (x,), "in body"),
        )
    ]
    problems = [p for p in problems if p]
    if ext.stats()["iallreduce_starts"]:
        problems.append(f"a start ran: {ext.stats()}")
    all_ranks(not problems, problems)


@mpi
def test_misused_requests_are_refused(world):
    import jax
    import jax.numpy as jnp
    from jax import lax

    x = jnp.arange(3.0)

    def twice(a):
        req = mpi4jax_dist.iallreduce(a)
        y = req.wait()
        return y + req.wait()

    def after_successor(a):
        req = mpi4jax_dist.iallreduce(a)
        req.test()
        return req.wait()

    def wait_in_loop_body(a):
        req = mpi4jax_dist.iallreduce(a)
        return lax.fori_loop(0, 2, lambda i, c: c + req.wait(), a)

    def no_arrays(a):
        req = mpi4jax_dist.iallreduce(a)
        req, _ = req.overlap(lambda: a * 2)
        return req.wait()

    def returns_nothing(a):
        req = mpi4jax_dist.iallreduce(a)
        req, _ = req.overlap(lambda v: None, a)
        return req.wait()

    cases = [
        (twice, RuntimeError, "already used by req.wait()"),
        (after_successor, RuntimeError, "already used by req.test()"),
        (wait_in_loop_body, RuntimeError, "another function"),
        (no_arrays, TypeError, "args hold no JAX array"),
        (returns_nothing, TypeError, "fn returned no JAX array"),
    ]
    problems = []
    for f, exc, words in cases:
        # The refused requests are dropped: their starts must not run either.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = outcome(lambda f=f: jax.jit(f)(x), exc, words)
        if problem:
            problems.append(f"{f.__name__}: {problem}")
    for bad in (None, 3, jnp.ones(3), (x, 1)):
        problem = outcome(
            lambda b=bad: mpi4jax_dist.Request.wait(b), TypeError, "req must be the"
        )
        if problem:
            problems.append(f"Request.wait({type(bad).__name__}): {problem}")
    problem = outcome(
        lambda: mpi4jax_dist.Request.test("req"), TypeError, "Request.test"
    )
    if problem:
        problems.append(f"Request.test('req'): {problem}")
    all_ranks(not problems, problems)
    all_ranks(not extension().pending_requests(), extension().pending_requests())


@mpi
def test_eager_request_dropped_is_completed_with_a_warning(world):
    import jax.numpy as jnp

    ext = extension()
    x = jnp.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        req = mpi4jax_dist.iallreduce(x)
        site = req.site
        del req  # every rank drops it: each completes its own
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    ok = any(
        "dropped without" in m and site in m and "completed" in m for m in messages
    )
    all_ranks(ok, f"warnings: {messages}")
    all_ranks(not ext.pending_requests(), f"pending: {ext.pending_requests()}")


@mpi
def test_large_counts_refused_without_mpi_iallreduce_c(world, monkeypatch):
    """More than INT_MAX elements need MPI_Iallreduce_c: refused by name where the
    MPI has none (traced only: nothing is allocated or sent)."""
    import jax
    import jax.numpy as jnp

    ext = extension()
    if ext.LARGE_COUNT:  # pretend an MPI 3.1 (Open MPI 5)
        monkeypatch.setattr(ext, "LARGE_COUNT", False)

    def f(a):
        return mpi4jax_dist.iallreduce(a).wait()

    spec = jax.ShapeDtypeStruct((INT_MAX + 1,), jnp.int8)
    problem = outcome(
        lambda: jax.jit(f).lower(spec), ValueError, "MPI_Iallreduce_c", "chunks"
    )
    if problem is None:  # INT_MAX elements still fit one MPI_Iallreduce
        try:
            jax.jit(f).lower(jax.ShapeDtypeStruct((INT_MAX,), jnp.int8))
        except Exception as err:
            problem = f"INT_MAX refused: {type(err).__name__}: {err}"
    all_ranks(problem is None, problem)


LARGE = 2**31 + 16
LARGE_NEED = 6 << 30


# The counts above INT_MAX are the package's C and the MPI's (every_mpi); JAX hands
# the op the same buffer under every version: not run again on the oldest JAX.
@mpi
@util.same_under_every_jax
@pytest.mark.timeout(900)
def test_count_above_2_31(world):
    import jax
    import jax.numpy as jnp
    import psutil
    from jax import lax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ext = extension()
    if not ext.LARGE_COUNT:
        pytest.skip(f"{ext.HEADER_MPI} has no MPI_Iallreduce_c (refused, see above)")
    if comm.size != 2:
        pytest.skip("2**31 + 16 int8 per rank runs in the 2-rank job only")
    free = comm.allreduce(psutil.virtual_memory().available, op=MPI.MIN)
    if free < comm.size * LARGE_NEED:
        pytest.skip(
            f"needs {comm.size * LARGE_NEED >> 30} GiB free on the host, "
            f"{free / 2**30:.1f} GiB are"
        )
    rank = comm.rank

    @jax.jit
    def make():
        ends = jnp.arange(16, dtype=jnp.int8) + rank
        x = jnp.full((LARGE,), rank + 1, jnp.int8)
        x = lax.dynamic_update_slice(x, ends, (np.int64(0),))
        return lax.dynamic_update_slice(x, -ends, (np.int64(LARGE - 16),))

    @jax.jit
    def check(a):
        head, tail = lax.slice(a, (0,), (16,)), lax.slice(a, (LARGE - 16,), (LARGE,))
        return head, tail, jnp.all(lax.slice(a, (16,), (LARGE - 16,)) == 3)

    reduce = jax.jit(lambda a: mpi4jax_dist.iallreduce(a).wait(), donate_argnums=0)
    with _compat.enable_x64(True):
        x = make()
    ext.reset_stats()
    head, tail, middle = check(reduce(x))
    expected = 2 * np.arange(16, dtype=np.int8) + 1
    stats = ext.stats()
    problems = []
    if not (np.array_equal(head, expected) and np.array_equal(tail, -expected)):
        problems.append(f"ends {head} {tail}")
    if not bool(middle):
        problems.append("middle not all 3")
    if stats["iallreduce_large_count_starts"] != 1:
        problems.append(f"not one MPI_Iallreduce_c: {stats}")
    all_ranks(not problems, problems)


# ---------------------------------------------------------------------------------
# One process: the compiled order, the GPU refusal, the report at exit

CALL = re.compile(r"^\s+(?:ROOT\s+)?%(?P<name>[^\s=]+) = (?P<rest>.*)$")


def instructions(text: str, computation: str | None = None):
    """``[(name, rest of line)]`` of the entry computation (or ``computation``) of
    compiled HLO text, in schedule order."""
    lines, inside = [], False
    for line in text.splitlines():
        if not inside:
            header = (
                line.startswith("ENTRY")
                if computation is None
                else (
                    line.startswith(f"%{computation} ") or line.startswith(computation)
                )
            )
            inside = header and line.rstrip().endswith("{")
            continue
        if line.startswith("}"):
            break
        match = CALL.match(line)
        if match:
            lines.append((match["name"], match["rest"]))
    return lines


def operands(rest: str) -> list[str]:
    """The instructions an instruction's right-hand side reads."""
    args = rest.split("(", 1)[1] if "(" in rest else ""
    # Before the attributes: the operand list ends at the first "), " or ")".
    args = re.split(r"\)(?:,|$)", args, maxsplit=1)[0]
    return re.findall(r"%([\w.-]+)", args)


def reaches(graph: dict, src: str, dst: str) -> bool:
    """Whether ``dst`` reads ``src``, directly or through other instructions."""
    stack, seen = [dst], set()
    while stack:
        name = stack.pop()
        if name == src:
            return True
        if name not in seen:
            seen.add(name)
            stack.extend(graph.get(name, ()))
    return False


def order_of(text: str, computation: str | None = None, work: str = "overlapped"):
    """``(names in schedule order, graph, start, tie, work, wait)`` of a compiled
    program: the first start, tie and wait custom calls and the instructions whose
    op_name holds ``work``."""
    ins = instructions(text, computation)
    names = [n for n, _ in ins]
    graph = {n: operands(r) for n, r in ins}

    def calls(target):
        return [n for n, r in ins if f'custom_call_target="{target}"' in r]

    starts = calls("mpi4jax_dist_iallreduce_start")
    ties = calls("mpi4jax_dist_iallreduce_tie")
    waits = calls("mpi4jax_dist_iallreduce_wait")
    work_ops = [n for n, r in ins if f"/{work}/" in r and "custom_call_target" not in r]
    return names, graph, starts, ties, work_ops, waits


def self_comm_program(with_overlap=True):
    """``f(x, w)`` on COMM_SELF: start, the work (a named scope) overlapped or
    just placed after the start, wait."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    def work(v):
        with jax.named_scope("overlapped"):
            return jnp.sin(v) @ jnp.cos(v)

    def f(x, w):
        w = w * 3  # an intermediate: the tie passes it on in place, no copy
        req = mpi4jax_dist.iallreduce(x, comm=MPI.COMM_SELF)
        if with_overlap:
            req, y = req.overlap(work, w)
        else:
            y = work(w)
        return req.wait(), y

    return f


@pytest.mark.mpi_skip
def test_overlapped_work_runs_between_start_and_wait_in_the_compiled_program():
    import jax
    import jax.numpy as jnp

    x, w = jnp.arange(4.0), jnp.linspace(0, 1, 4096)
    f = self_comm_program()
    text = jax.jit(f).lower(x, w).compile().as_text()
    names, graph, starts, ties, work, waits = order_of(text)
    assert len(starts) == len(waits) == 1 and len(ties) == 2 and work, text
    (start,), (tie, tie_out), (wait,) = starts, ties, waits
    # In schedule order: start, tie, the work, the tie of its results, wait.
    at = names.index
    assert at(start) < at(tie) < min(map(at, work)) <= max(map(at, work))
    assert max(map(at, work)) < at(tie_out) < at(wait)
    # And by data: the work reads what the tie wrote after the start; the wait reads
    # the work's result, through the second tie.
    assert reaches(graph, start, tie)
    assert all(reaches(graph, tie, op) for op in work), (work, graph)
    assert any(reaches(graph, op, tie_out) for op in work)
    assert tie_out in graph[wait]
    # No copy of the work's input: it was an intermediate, passed on in place.
    assert "f32[4096]{0} copy(" not in text.split("ENTRY")[1], text
    # The check can fail: without overlap nothing ties the work to the start.
    plain = jax.jit(self_comm_program(False)).lower(x, w).compile().as_text()
    _, graph, (start,), _, work, (wait,) = order_of(plain)
    assert work and not any(reaches(graph, start, op) for op in work)
    assert not any(reaches(graph, op, wait) for op in work)
    # Eagerly the same program gives the same numbers.
    got = jax.jit(f)(x, w)
    eager = f(x, w)
    assert all(np.allclose(a, b) for a, b in zip(got, eager, strict=True))


@pytest.mark.mpi_skip
def test_overlapped_work_runs_once_when_its_result_is_used_after_the_wait():
    """Work whose result the caller uses after the wait: XLA could fuse its last
    step into both readers (the wait's operand and the caller's next step), so
    that it runs twice (seen: overlapped with the reduction, a 256 x 256 grid's
    matvec took 3.3 times as long as alone, on 2 ranks).
    The results pass through a second tie, so every reader of the work's input
    is work that the wait waits for."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    def work(v):  # a 5-point stencil on a 64 x 64 grid, zero outside
        with jax.named_scope("overlapped"):
            u = v.reshape(64, 64)
            zr, zc = jnp.zeros_like(u[:1]), jnp.zeros_like(u[:, :1])
            up = jnp.concatenate([zr, u[:-1]])
            down = jnp.concatenate([u[1:], zr])
            left = jnp.concatenate([zc, u[:, :-1]], axis=1)
            right = jnp.concatenate([u[:, 1:], zc], axis=1)
            return (4 * u - up - down - left - right).reshape(-1)

    def f(x, w):
        req = mpi4jax_dist.iallreduce(x, comm=MPI.COMM_SELF)
        req, y = req.overlap(work, w)
        return req.wait(), y * 1e-3  # used after the wait

    x, w = jnp.arange(4.0), jnp.linspace(0, 1, 4096)
    text = jax.jit(f).lower(x, w).compile().as_text()
    _, graph, _, ties, _, (wait,) = order_of(text)
    tie = ties[0]  # the one before the work
    readers = [n for n, ops in graph.items() if tie in ops]
    stray = [n for n in readers if not reaches(graph, n, wait)]
    assert readers and not stray, (stray, text)
    got = jax.jit(f)(x, w)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(f(x, w)[1]))


def loop_body(text: str, scope: str) -> str:
    """The name of the body computation of the while loop marked ``scope``."""
    _hlo = util.load_benchmark("_hlo")
    (loop,) = [
        ins for ins in _hlo._top_level_loops(_hlo.parse(text)) if ins.scope() == scope
    ]
    return loop.calls("body")[0]


@pytest.mark.mpi_skip
def test_cg_reduction_overlaps_the_matvec_in_the_compiled_loop():
    """pipelined_nb's loop body: its reduction's start, then the preconditioner and
    matvec, then its wait, in schedule order and by data; pipelined's matvec does
    not wait for its (blocking) reduction, nor does the reduction for the matvec,
    which is the freedom that the non-blocking form turns into an overlap."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    from mpi4jax_dist import cg
    from mpi4jax_dist.solvers.core import LOOP_SCOPE

    n = 4096
    d = 2.0 + jnp.arange(n) / n

    def matvec(v):
        with jax.named_scope("matvec"):
            return d * v + 0.1 * (jnp.roll(v, 1) + jnp.roll(v, -1))

    def compiled(variant, diag=d):
        solver = cg.make_solver(matvec, variant=variant, comm=MPI.COMM_SELF)
        args = (jnp.ones(n), None, diag, 1e-5, 100, 0, 0, 0)
        text = solver._solve._jitted.lower(*args).compile().as_text()
        return text, loop_body(text, LOOP_SCOPE)

    def vector_copies(variant):
        """Copies of whole vectors in the loop body, without a preconditioner
        (where the overlapped work returns w twice: as w and as M^-1 w = w)."""
        text, body = compiled(variant, None)
        return [m for m, r in instructions(text, body) if f"[{n}]{{0}} copy(" in r]

    # Overlapping costs no copy of a vector: the tie takes each array once.
    assert len(vector_copies("pipelined_nb")) <= len(vector_copies("pipelined"))

    text, body = compiled("pipelined_nb")
    names, graph, starts, ties, work, waits = order_of(text, body, "matvec")
    assert len(starts) == len(waits) == 1 and len(ties) == 2 and work, (starts, waits)
    (start,), (tie, _), (wait,) = starts, ties, waits
    at = names.index
    assert at(start) < at(tie) < min(map(at, work)) <= max(map(at, work)) < at(wait)
    assert all(reaches(graph, start, op) for op in work)
    assert any(reaches(graph, op, wait) for op in work)
    # The matvec runs once: every reader of its (tied) input is waited for.
    assert all(reaches(graph, m, wait) for m in graph if tie in graph[m])
    blocking = 'custom_call_target="mpi_allreduce_ffi"'
    assert not [n for n, r in instructions(text, body) if blocking in r]
    # The blocking variant: an allreduce, and no data path either way.
    text, body = compiled("pipelined")
    ins = instructions(text, body)
    graph = {name: operands(rest) for name, rest in ins}
    (reduce,) = [n for n, r in ins if blocking in r]
    work = [n for n, r in ins if "/matvec/" in r]
    assert work and not any(reaches(graph, reduce, op) for op in work)
    assert not any(reaches(graph, op, reduce) for op in work)


@pytest.mark.mpi_skip
def test_gpu_platforms_are_refused_by_name():
    import jax
    import jax.numpy as jnp

    def f(a):
        return mpi4jax_dist.iallreduce(a).wait()

    traced = jax.jit(f).trace(jnp.ones(3))
    for platform in ("cuda", "rocm", "oneapi"):
        try:
            traced.lower(lowering_platforms=(platform,))
        except NotImplementedError as err:
            said = str(err)
            assert f"no handler for the {platform} platform" in said, said
            assert "runs on CPU only" in said and "does not fall back" in said, said
        except Exception as err:  # e.g. that platform's lowering unknown here
            pytest.skip(f"cannot lower for {platform} here: {err}")
        else:
            raise AssertionError(f"lowered for {platform}")


@pytest.mark.mpi_skip
def test_request_kept_out_of_its_function_fails_the_next_run_and_exit_reports_it():
    """A start whose request escapes tracing passes lowering, and its first run
    posts it; the second run finds it still pending and fails, naming the start; at
    exit the ranks name it again, complete it and end the job non-zero (no hang).

    In a job of its own: after a failed run JAX's ordered-effect token can stay
    in error, failing a later call on one rank only."""
    code = textwrap.dedent("""
        import sys, jax, jax.numpy as jnp, mpi4jax_dist
        from mpi4jax_dist import _ffi
        def say(text):  # one write: the ranks' lines do not interleave
            sys.stdout.write(text + "\\n")
            sys.stdout.flush()
        kept = []
        def leaks(a):
            kept.append(mpi4jax_dist.iallreduce(a))
            return a + 1
        f = jax.jit(leaks)
        f(jnp.arange(3.0))
        jax.effects_barrier()  # the start has run
        say(f"pending {_ffi.load().pending_requests()}")
        try:
            f(jnp.arange(3.0)).block_until_ready()
            say("second run: no error")
        except Exception as err:
            say(f"second run: {err}")
        """)
    proc = util.run_mpi(["-c", code], 2, timeout=240, check=False)
    out = proc.stdout
    assert out.count("pending [(") == out.count("in leaks')]") == 2, out
    assert out.count("second run") == 2 and "no error" not in out, out
    assert out.count("runs again while its previous request is still pending") == 2
    # The first rank to end the job may cut the other's lines short.
    report = r"at exit, the request started at <string>:\d+ in leaks \(handle"
    assert re.search(report, proc.stderr), proc.stderr
    assert "1 request(s) left pending at exit (1 completed since" in proc.stderr
    assert proc.returncode == lifecycle.EXIT_STATUS, proc.stderr


@pytest.mark.mpi_skip
def test_work_that_returns_its_inputs():
    """fn may pass its inputs through (twice, even): nothing is tied again, and
    the wait still comes after the work."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    def f(x, w):
        req = mpi4jax_dist.iallreduce(x, comm=MPI.COMM_SELF)
        req, (a, b) = req.overlap(lambda v: (v, v), w * 2)
        return req.wait(), a + b

    x, w = jnp.arange(3.0), jnp.ones(5)
    text = jax.jit(f).lower(x, w).compile().as_text()
    assert len(order_of(text)[3]) == 1, text  # the input's tie only
    y, ab = jax.jit(f)(x, w)
    np.testing.assert_array_equal(np.asarray(y), np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(ab), np.full(5, 4.0))


@pytest.mark.mpi_skip
def test_the_4097th_pending_request_is_refused():
    """At most 4096 requests may be pending (none waited on): the next start is
    refused with the reason, and the ones pending complete."""
    import jax.numpy as jnp
    from mpi4py import MPI

    ext = extension()
    x = jnp.ones(2)
    held = [
        mpi4jax_dist.iallreduce(x, comm=MPI.COMM_SELF)
        for _ in range(len(ext.pending_requests()), 4096)
    ]
    try:
        with pytest.raises(Exception, match="4096 requests are pending"):
            mpi4jax_dist.iallreduce(x, comm=MPI.COMM_SELF)
    finally:
        got = [req.wait() for req in held]
    assert len(got) == len(held) and not ext.pending_requests()
    np.testing.assert_array_equal(np.asarray(got[-1]), np.ones(2))


def test_api_is_exported():
    assert {"iallreduce", "Request"} <= set(mpi4jax_dist.__all__)
    assert mpi4jax_dist.iallreduce is iallreduce_ops.iallreduce
    assert mpi4jax_dist.Request is iallreduce_ops.Request
    for name in ("overlap", "test", "wait"):
        assert callable(getattr(mpi4jax_dist.Request, name))
        assert getattr(mpi4jax_dist.Request, name).__doc__
