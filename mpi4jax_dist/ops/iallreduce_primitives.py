"""The primitives of :func:`mpi4jax_dist.iallreduce` and their rules, on the CPU
handlers: the start (``MPI_Iallreduce`` on a copy the extension owns), the test,
the wait, and the tie that orders :meth:`~mpi4jax_dist.Request.overlap`'s work
between start and wait by data dependencies. The start, test and wait carry
mpi4jax's ordered effect; what runs when and what is caught: docs/design.rst,
*The non-blocking allreduce*.

Imported by the first start, not with the package: importing this module imports
mpi4jax, whose ordered effect the primitives carry (:func:`.common.ordering`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _config, _ffi
from . import common, lifecycle

ordered_effect, abstract_token = common.ordering()

_START_TARGET, _TEST_TARGET, _WAIT_TARGET, _TIE_TARGET = _ffi.IALLREDUCE_TARGETS
# The request's handle: an int32 of the extension's table of pending requests.
_HANDLE = ShapedArray((), np.int32)

start_p = Primitive("mpi4jax_dist_iallreduce_start")
start_p.multiple_results = True
test_p = Primitive("mpi4jax_dist_iallreduce_test")
test_p.multiple_results = True
wait_p = Primitive("mpi4jax_dist_iallreduce_wait")
tie_p = Primitive("mpi4jax_dist_iallreduce_tie")
tie_p.multiple_results = True


def _like(aval):
    return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _token_after(ctx, value, aval) -> None:
    """Make the token the next ordered call waits for from ``value``, a result
    of this call."""
    (token,) = jax.ffi.ffi_lowering(_ffi.TOKEN_AFTER_TARGET)(
        ctx.replace(avals_in=(aval,), avals_out=(abstract_token,)), value
    )
    ctx.set_tokens_out(mlir.TokenSet({ordered_effect: token}))


# Derivatives flow through the overlapped work (the test's and wait's operands
# after the handle are only dependencies), never through the reduction: JAX calls
# the JVP rules only when some input carries a tangent.
def _no_derivative() -> NotImplementedError:
    return NotImplementedError(
        f"{lifecycle.WHO} does not differentiate the array it reduces; use "
        f"mpi4jax_dist.allreduce (MPI.SUM, differentiable) for that."
    )


# -- the start: the array in, the request's buffer and handle out -----------------


# Eagerly: one jitted call per (op, comm, site).
@functools.cache
def _start_jitted(op, comm, site):
    return jax.jit(lambda x: start_p.bind(x, op=op, comm=comm, uid=0, site=site))


def _start_impl(x, *, op, comm, uid, site):
    del uid  # eager starts are not checked at lowering
    return _start_jitted(op, comm, site)(x)


def _start_abstract_eval(x, *, op, comm, uid, site):
    return [_like(x), _HANDLE], {ordered_effect}


def _start_lowering(ctx, x, *, op, comm, uid, site):
    lifecycle.refuse_dropped(uid)
    ext = lifecycle.load_extension()
    lifecycle.check_count(int(np.prod(ctx.avals_in[0].shape)), ext)
    token = ctx.tokens_in.get(ordered_effect)
    buffer, handle = jax.ffi.ffi_lowering(
        _START_TARGET, operand_output_aliases={0: 0}, has_side_effect=True
    )(
        ctx.replace(avals_in=(*ctx.avals_in, abstract_token)),
        x,
        token,
        comm=np.int64(comm.key),
        op=np.int32(op),
        check=np.int32(_config.checks()),
        uid=np.int64(uid),
        site=np.int64(ext.register_site(*site)),
    )
    _token_after(ctx, handle, _HANDLE)
    return [buffer, handle]


def _start_batching(args, dims, **params):
    # Elementwise over ranks: the batch dimension stays; the handle is one.
    return start_p.bind(*args, **params), [dims[0], None]


def _start_jvp(primals, tangents, **params):
    raise _no_derivative()


# -- the test and the wait: buffer, handle and dependencies in --------------------


# Eagerly: the request's buffer is donated to the test and the wait, which write
# into it in place (no copy).
@functools.cache
def _donating(prim):
    return jax.jit(lambda b, h, *deps: prim.bind(b, h, *deps), donate_argnums=0)


def _test_impl(buffer, handle, *deps):
    return _donating(test_p)(buffer, handle, *deps)


def _wait_impl(buffer, handle, *deps):
    return _donating(wait_p)(buffer, handle, *deps)


def _test_abstract_eval(buffer, handle, *deps):
    return [_like(buffer), _HANDLE], {ordered_effect}


def _wait_abstract_eval(buffer, handle, *deps):
    return _like(buffer), {ordered_effect}


def _call_after_start(ctx, target, aliases, buffer, handle, deps):
    """The handler's call on the request (its token in after the handle)."""
    lifecycle.load_extension()
    token = ctx.tokens_in.get(ordered_effect)
    avals = ctx.avals_in
    return jax.ffi.ffi_lowering(
        target, operand_output_aliases=aliases, has_side_effect=True
    )(
        ctx.replace(avals_in=(*avals[:2], abstract_token, *avals[2:])),
        buffer,
        handle,
        token,
        *deps,
    )


def _test_lowering(ctx, buffer, handle, *deps):
    results = _call_after_start(ctx, _TEST_TARGET, {0: 0, 1: 1}, buffer, handle, deps)
    _token_after(ctx, results[1], _HANDLE)
    return results


def _wait_lowering(ctx, buffer, handle, *deps):
    results = _call_after_start(ctx, _WAIT_TARGET, {0: 0}, buffer, handle, deps)
    _token_after(ctx, results[0], ctx.avals_out[0])
    return results


def _test_batching(args, dims):
    return test_p.bind(*args), [dims[0], None]


def _wait_batching(args, dims):
    return wait_p.bind(*args), dims[0]


def _test_jvp(primals, tangents):
    if not isinstance(tangents[0], ad.Zero):
        raise _no_derivative()
    return test_p.bind(*primals), list(tangents[:2])


def _wait_jvp(primals, tangents):
    if not isinstance(tangents[0], ad.Zero):
        raise _no_derivative()
    return wait_p.bind(*primals), tangents[0]


# -- the tie of overlap: the handle and arrays in, the arrays out in place (a no-op
# call; see cpu.cc). Eagerly the identity: no call, no copy.


def _tie_impl(handle, *arrays):
    return list(arrays)


def _tie_abstract_eval(handle, *arrays):
    return list(arrays)


def _tie_lowering(ctx, handle, *arrays):
    lifecycle.load_extension()
    return jax.ffi.ffi_lowering(
        _TIE_TARGET,
        operand_output_aliases={i + 1: i for i in range(len(arrays))},
    )(ctx, handle, *arrays)


def _tie_batching(args, dims):
    return tie_p.bind(*args), list(dims[1:])


def _tie_jvp(primals, tangents):
    return tie_p.bind(*primals), list(tangents[1:])


start_p.def_impl(_start_impl)
start_p.def_effectful_abstract_eval(_start_abstract_eval)
mlir.register_lowering(start_p, _start_lowering, platform="cpu")
batching.primitive_batchers[start_p] = _start_batching
ad.primitive_jvps[start_p] = _start_jvp

test_p.def_impl(_test_impl)
test_p.def_effectful_abstract_eval(_test_abstract_eval)
mlir.register_lowering(test_p, _test_lowering, platform="cpu")
batching.primitive_batchers[test_p] = _test_batching
ad.primitive_jvps[test_p] = _test_jvp

wait_p.def_impl(_wait_impl)
wait_p.def_effectful_abstract_eval(_wait_abstract_eval)
mlir.register_lowering(wait_p, _wait_lowering, platform="cpu")
batching.primitive_batchers[wait_p] = _wait_batching
ad.primitive_jvps[wait_p] = _wait_jvp

tie_p.def_impl(_tie_impl)
tie_p.def_abstract_eval(_tie_abstract_eval)
mlir.register_lowering(tie_p, _tie_lowering, platform="cpu")
batching.primitive_batchers[tie_p] = _tie_batching
ad.primitive_jvps[tie_p] = _tie_jvp

# Every other platform (cuda, rocm, oneapi, ...): a clear error when lowered.
_refuse = common.unsupported_lowering(
    f"{lifecycle.WHO} (and Request.test and Request.wait)", ("cpu",)
)
for _prim in (start_p, test_p, wait_p, tie_p):
    mlir.register_lowering(_prim, _refuse)
