"""The benchmarks' HLO reader (benchmarks/_hlo.py), which counts a loop's
reductions in compiled programs: python -m pytest tests/unit/test_hlo.py.

Small programs compiled here (one process; mpi4jax on COMM_SELF, which its custom
calls keep in the program) and HLO text fixtures for the forms this machine's XLA
does not print (asynchronous pairs, true/false conditionals). Nothing here runs a
collective: the programs are only compiled.
"""

import subprocess
import sys
import textwrap

import pytest
import util

_hlo = util.load_benchmark("_hlo")

# One process each (compiling, or a fresh interpreter): the serial session's.
pytestmark = util.serial_only


@pytest.fixture(scope="module")
def mpi():
    """``(jax, jnp, lax, allreduce, sendrecv)`` with mpi4jax on COMM_SELF."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from jax import lax
    from mpi4py import MPI

    def allreduce(x):
        return mpi4jax.allreduce(x, op=MPI.SUM, comm=MPI.COMM_SELF)

    def sendrecv(x):
        return mpi4jax.sendrecv(x, x, 0, 0, comm=MPI.COMM_SELF)

    return jax, jnp, lax, allreduce, sendrecv


def hlo(jax, f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def marked_loop(jax, lax, body, name="loop"):
    """``f(x, n)``: ``n`` iterations of ``body(k, x)``, the loop marked ``name``."""

    def f(x, n):
        with jax.named_scope(name):
            return lax.while_loop(
                lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (0, x)
            )

    return f


def test_counts_reductions_not_halo_exchanges(mpi):
    jax, jnp, lax, allreduce, sendrecv = mpi

    def body(k, x):
        x = sendrecv(x)  # moves data: not a reduction
        return allreduce(allreduce(x) * 0.5) * 0.5

    text = hlo(jax, marked_loop(jax, lax, body), jnp.ones(4), 3)
    found = _hlo.loop_reductions(text, "loop")
    assert (found.body, found.branch, found.condition) == (2, 0, 0), found
    assert found.exact and found.total(10) == 20
    assert "mpi_sendrecv_ffi" in text  # it is there, and was not counted


def test_counts_this_packages_reductions_once_each(mpi):
    """mpi4jax_dist.allreduce is one reduction; so is a non-blocking one, counted at
    its start: its tie, test and wait complete the same reduction."""
    jax, jnp, lax, _, _ = mpi
    from mpi4py import MPI

    import mpi4jax_dist

    def body(k, x):
        req = mpi4jax_dist.iallreduce(x, comm=MPI.COMM_SELF)
        req, y = req.overlap(lambda v: v * 2, x)
        req = req.test()
        return req.wait() + mpi4jax_dist.allreduce(y, comm=MPI.COMM_SELF)

    text = hlo(jax, marked_loop(jax, lax, body), jnp.ones(4), 3)
    found = _hlo.loop_reductions(text, "loop")
    assert (found.body, found.branch, found.condition) == (2, 0, 0), found
    for name in ("allreduce", "iallreduce_start", "iallreduce_tie", "iallreduce_wait"):
        assert f'custom_call_target="mpi4jax_dist_{name}"' in text, name
    assert 'custom_call_target="mpi4jax_dist_iallreduce_test"' in text


def test_inner_loop_with_known_trip_count_multiplies(mpi):
    jax, jnp, lax, allreduce, _ = mpi

    def body(k, x):
        return lax.fori_loop(0, 3, lambda i, v: allreduce(v) * 0.5, x)

    found = _hlo.loop_reductions(hlo(jax, marked_loop(jax, lax, body), jnp.ones(4), 3))
    assert (found.body, found.exact) == (3, True), found


def test_inner_loop_without_trip_count_is_doubted(mpi):
    jax, jnp, lax, allreduce, _ = mpi

    def body(k, x):
        return lax.while_loop(lambda v: v[0] > 1, lambda v: allreduce(v) * 0.5, x)

    found = _hlo.loop_reductions(hlo(jax, marked_loop(jax, lax, body), jnp.ones(4), 3))
    assert not found.exact and "known trip count" in found.doubts[0], found


def test_marked_branch_is_counted_apart(mpi):
    jax, jnp, lax, allreduce, _ = mpi

    def body(k, x):
        with jax.named_scope("replace"):
            x = lax.cond(k % 5 == 0, lambda v: allreduce(allreduce(v)), lambda v: v, x)
        return allreduce(x) * 0.25

    text = hlo(jax, marked_loop(jax, lax, body), jnp.ones(4), 3)
    found = _hlo.loop_reductions(text, "loop", "replace")
    assert (found.body, found.branch, found.exact) == (1, 2, True), found
    assert found.total(10, branch_runs=2) == 14
    # Unmarked, the same conditional makes the count depend on the data.
    unmarked = _hlo.loop_reductions(text, "loop")
    assert not unmarked.exact and "reduce differently" in unmarked.doubts[0]


def test_conditional_whose_branches_reduce_alike_counts_once(mpi):
    jax, jnp, lax, allreduce, _ = mpi

    def body(k, x):
        return lax.cond(k > 2, lambda v: allreduce(v) * 2, lambda v: allreduce(-v), x)

    found = _hlo.loop_reductions(hlo(jax, marked_loop(jax, lax, body), jnp.ones(4), 3))
    assert (found.body, found.exact) == (1, True), found


def test_reduction_in_the_loop_condition_is_found(mpi):
    jax, jnp, lax, allreduce, _ = mpi

    def f(x):
        return lax.while_loop(lambda v: allreduce(v)[0] < 100, lambda v: v * 2, x)

    found = _hlo.loop_reductions(hlo(jax, f, jnp.ones(4)))
    # XLA may rotate the loop (the reduction then ends the body, and one more runs
    # before the loop): either way one per iteration is found.
    assert found.body + found.condition == 1 and found.exact, found


def test_loop_is_found_by_its_marker_and_not_inside_another(mpi):
    jax, jnp, lax, allreduce, _ = mpi
    inner = marked_loop(jax, lax, lambda k, x: allreduce(x) * 0.5, name="cg")

    def f(x, n):
        x = lax.while_loop(lambda v: v[0] > 1, lambda v: v * 0.5, x)  # unmarked
        # A marked loop nested in the marked loop's body (a solve in a matvec).
        return marked_loop(jax, lax, lambda k, v: inner(v, n)[1], name="cg")(x, n)

    text = hlo(jax, f, jnp.ones(4), 3)
    found = _hlo.loop_reductions(text, "cg")
    # The outer marked loop was taken: the inner one, which reduces, has no known
    # trip count.
    assert not found.exact and "cg/while/body/cg/while" in found.doubts[0], found
    with pytest.raises(LookupError, match="found loops: "):
        _hlo.loop_reductions(text)
    with pytest.raises(LookupError, match="marked 'nowhere'.*none"):
        _hlo.loop_reductions(text, "nowhere")


def test_jax_scipy_cg_has_one_loop(mpi):
    """The benchmark's references: jax.scipy's cg, one top-level while loop."""
    jax, jnp, lax, allreduce, _ = mpi
    import jax.scipy.sparse.linalg as jspl

    def f(b):
        return jspl.cg(lambda v: allreduce(v) * 0.5 + v, b, maxiter=10)[0]

    found = _hlo.loop_reductions(hlo(jax, f, jnp.ones(8)))
    assert (found.body, found.condition, found.exact) == (1, 0, True), found


def test_not_hlo_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        _hlo.parse("this is not HLO")


# Forms this machine's XLA does not print for the programs above: asynchronous
# collectives (GPU), true/false conditionals, quoted text that looks like an
# attribute. The loop body: 1 all-reduce-start (its -done not counted again), 1
# all-reduce behind async-start (async-done names the same computation), 1
# reduce-scatter in a fusion, 2 in a call x trip count 2, and a conditional whose
# branches both make 1; collective-permute, all-gather and a sendrecv make none.
FIXTURE = textwrap.dedent("""\
    HloModule fixture, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

    FileNames
    1 "fixture.py"

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(%a, %b)
    }

    %wrapped_all_reduce (p: f32[4]) -> f32[4] {
      %p = f32[4]{0} parameter(0)
      ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
    }

    %fused (p.1: f32[4]) -> f32[2] {
      %p.1 = f32[4]{0} parameter(0)
      ROOT %rs = f32[2]{0} reduce-scatter(%p.1), dimensions={0}, to_apply=%add
    }

    %called (p.2: f32[4]) -> f32[4] {
      %p.2 = f32[4]{0} parameter(0)
      %ar.1 = f32[4]{0} all-reduce(%p.2), to_apply=%add
      ROOT %ar.2 = f32[4]{0} all-reduce(%ar.1), to_apply=%add
    }

    %inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
      %t = (s32[], f32[4]{0}) parameter(0)
      %v = f32[4]{0} get-tuple-element(%t), index=1
      %c = f32[4]{0} call(%v), to_apply=%called
      %i = s32[] get-tuple-element(%t), index=0
      ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)
    }

    %inner_cond (t.1: (s32[], f32[4])) -> pred[] {
      %t.1 = (s32[], f32[4]{0}) parameter(0)
      ROOT %k = pred[] constant(true)
    }

    %yes (y: f32[4]) -> f32[4] {
      %y = f32[4]{0} parameter(0)
      ROOT %ar.3 = f32[4]{0} all-reduce(%y), to_apply=%add
    }

    %no (n: f32[4]) -> f32[4] {
      %n = f32[4]{0} parameter(0)
      %s = (f32[4]{0}, token[]) custom-call(%n), custom_call_target="mpi_sendrecv_ffi"
      ROOT %ar.4 = (f32[4]{0}, token[]) custom-call(%n), custom_call_target="mpi_allreduce_ffi"
    }

    %body (x: (s32[], f32[4])) -> (s32[], f32[4]) {
      %x = (s32[], f32[4]{0}) parameter(0)
      %x1 = f32[4]{0} get-tuple-element(%x), index=1
      %start = f32[4]{0} all-reduce-start(%x1), to_apply=%add, metadata={op_name="jit(f)/loop/while/body=%called/psum"}
      %done = f32[4]{0} all-reduce-done(%start)
      %as = ((f32[4]{0}), f32[4]{0}) async-start(%done), calls=%wrapped_all_reduce
      %ad = f32[4]{0} async-done(%as), calls=%wrapped_all_reduce
      %f = f32[2]{0} fusion(%ad), kind=kLoop, calls=%fused
      %cp = f32[4]{0} collective-permute(%ad), source_target_pairs={{0,1}}
      %ag = f32[8]{0} all-gather(%ad), dimensions={0}
      %t0 = (s32[], f32[4]{0}) tuple(%x0, %cp)
      %w = (s32[], f32[4]{0}) while(%t0), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
      %wv = f32[4]{0} get-tuple-element(%w), index=1
      %p0 = pred[] constant(true)
      %cnd = f32[4]{0} conditional(%p0, %wv, %wv), true_computation=%yes, false_computation=%no
      %x0 = s32[] get-tuple-element(%x), index=0
      ROOT %out = (s32[], f32[4]{0}) tuple(%x0, %cnd)
    }

    %cond (x.1: (s32[], f32[4])) -> pred[] {
      %x.1 = (s32[], f32[4]{0}) parameter(0)
      ROOT %go = pred[] constant(false)
    }

    ENTRY %main (arg: f32[4]) -> f32[4] {
      %arg = f32[4]{0} parameter(0)
      %zero = s32[] constant(0)
      %init = (s32[], f32[4]{0}) tuple(%zero, %arg)
      %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/loop/while"}
      ROOT %res = f32[4]{0} get-tuple-element(%loop), index=1
    }
    """)  # noqa: E501


def test_fixture_forms():
    module = _hlo.parse(FIXTURE)
    assert module.entry == "main" and "wrapped_all_reduce" in module.computations
    start = next(i for i in module.computations["body"] if i.name == "start")
    assert start.calls() == ["add"]  # not "called", which is quoted in its op_name
    found = _hlo.loop_reductions(FIXTURE, "loop")
    assert (found.body, found.condition, found.exact) == (1 + 1 + 1 + 4 + 1, 0, True)


def test_fixture_reduction_in_the_condition_counts_once_more():
    text = FIXTURE.replace(
        "ROOT %go = pred[] constant(false)",
        "%r = f32[4]{0} all-reduce(%x.1), to_apply=%add\n"
        "      ROOT %go = pred[] constant(false)",
    )
    found = _hlo.loop_reductions(text, "loop")
    assert (found.body, found.condition) == (8, 1), found
    assert found.total(3) == 3 * 8 + 4  # the condition runs once more


def test_fixture_branch_that_reduces_differently_is_doubted():
    text = FIXTURE.replace(
        'custom_call_target="mpi_allreduce_ffi"', 'custom_call_target="mpi_bcast_ffi"'
    )
    found = _hlo.loop_reductions(text, "loop")
    assert not found.exact and "cnd" in found.doubts[0], found


PSUM_PROGRAM = """
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
import sys
sys.path.insert(0, "benchmarks")
import _hlo
from mpi4jax_dist import _compat

mesh = Mesh(jax.devices(), ("i",))

def local(x, n):
    def body(c):
        k, v = c
        v = lax.ppermute(v, "i", [(0, 1), (1, 0)])  # halo-like: not a reduction
        return k + 1, v * lax.psum(jnp.vdot(v, v), "i")

    with jax.named_scope("loop"):
        return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

f = jax.jit(_compat.shard_map(
    local, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"), check=False))
text = f.lower(jnp.ones(8), 3).compile().as_text()
assert " all-reduce(" in text and "collective-permute" in text, text
found = _hlo.loop_reductions(text, "loop")
print("RESULT", found.body, found.branch, found.condition, found.exact)
"""


@util.skip_in_mpi_job
def test_psum_in_shard_map_is_an_all_reduce():
    """psum inside shard_map on two CPU devices of one process: XLA's all-reduce."""
    proc = subprocess.run(
        [sys.executable, "-c", PSUM_PROGRAM],
        env=util.clean_env(JAX_NUM_CPU_DEVICES=2),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=util.ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT 1 0 0 True" in proc.stdout, proc.stdout + proc.stderr
