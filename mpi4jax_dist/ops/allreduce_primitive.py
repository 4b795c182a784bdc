"""The primitive of :func:`mpi4jax_dist.allreduce` and its rules: evaluation, the
lowering to the CPU and CUDA handlers (operand aliased to result: reduced in
place), batching and differentiation (docs/design.rst, *The in-place allreduce*).

Imported by the first call of the allreduce, not with the package: the primitive
carries mpi4jax's ordered effect (:func:`.common.ordering`), so importing this
module imports mpi4jax.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _config, _ffi
from .common import OPS, extension, ordering, unsupported_lowering

_WHO = "mpi4jax_dist.allreduce"

ordered_effect, abstract_token = ordering()

allreduce_p = Primitive("mpi4jax_dist_allreduce")


# Eagerly: one jitted call per parameters.
@functools.cache
def _jitted(op, comm, transpose, site):
    return jax.jit(
        lambda x: allreduce_p.bind(x, op=op, comm=comm, transpose=transpose, site=site)
    )


def _impl(x, *, op, comm, transpose, site):
    return _jitted(op, comm, transpose, site)(x)


def _abstract_eval(x, *, op, comm, transpose, site):
    out = ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
    # The transposed allreduce is the identity (as in mpi4jax): no MPI call,
    # nothing to order.
    return out, (set() if transpose else {ordered_effect})


def _cuda_aware(module) -> bool:
    """Return whether the CUDA handler hands MPI device memory (see
    :func:`mpi4jax_dist._config.cuda_aware_mpi`): only when asked, and only to an
    MPI that says it reads device memory, or that cannot say and is trusted by
    name (``force``).

    Raises:
        RuntimeError: CUDA-aware MPI asked for, and the MPI says it cannot read
            device memory, or cannot say and the setting is not ``force``.
    """
    setting = _config.cuda_aware_mpi()
    if setting == "off":
        return False
    support = module.mpi_cuda_support()
    if support is True or (support is None and setting == "force"):
        return True
    from mpi4py import MPI

    library = " ".join(MPI.Get_library_version().split()[:4])
    asked = _config.cuda_aware_source()
    if support is False:
        raise RuntimeError(
            f"{_WHO} was told that MPI reads device memory "
            f"({asked}), but this MPI ({library}) says it cannot "
            f"(MPIX_Query_cuda_support() is 0); it would crash on a device "
            f"pointer. Unset {_config.CUDA_AWARE_MPI} and "
            f"{_config.MPI4JAX_CUDA_AWARE_MPI}, or set {_config.CUDA_AWARE_MPI}=0, "
            f"to stage through host memory, or use an MPI built with CUDA support."
        )
    raise RuntimeError(
        f"{_WHO} was told that MPI reads device memory ({asked}), "
        f"but this MPI ({library}) cannot say whether it does (no "
        f"MPIX_Query_cuda_support: Open MPI without its CUDA extension, Intel MPI, "
        f"MPICH before 4.1), and an MPI without CUDA support crashes or reads "
        f"garbage on a device pointer. Set {_config.CUDA_AWARE_MPI}=force if you "
        f"know this MPI was built with CUDA support, or "
        f"{_config.CUDA_AWARE_MPI}=0 to stage through host memory (works with "
        f"every MPI)."
    )


def _lowering(ctx, x, *, op, comm, transpose, site, platform="cpu"):
    if transpose:
        return [x]
    module = extension(platform)
    attributes = {
        "comm": np.int64(comm.key),
        "op": np.int32(op),
        "chunk_bytes": np.int64(_config.allreduce_chunk_bytes()),
        "check": np.int32(_config.checks()),
        "site": np.int64(module.register_site(*site)),
    }
    if platform == "cuda":
        attributes["cuda_aware"] = np.int32(_cuda_aware(module))
    token = ctx.tokens_in.get(ordered_effect)
    (result,) = jax.ffi.ffi_lowering(
        _ffi.ALLREDUCE_TARGET,
        operand_output_aliases={0: 0},
        has_side_effect=True,
    )(ctx.replace(avals_in=(*ctx.avals_in, abstract_token)), x, token, **attributes)
    # The next MPI call waits for a token made from the result, not for a second
    # result of the allreduce: an (array, token) result is a tuple, whose index
    # table XLA allocates as temp memory.
    (token,) = jax.ffi.ffi_lowering(_ffi.TOKEN_AFTER_TARGET)(
        ctx.replace(avals_in=ctx.avals_out, avals_out=(abstract_token,)),
        result,
    )
    ctx.set_tokens_out(mlir.TokenSet({ordered_effect: token}))
    return [result]


_refuse = unsupported_lowering(_WHO, ("cpu", "cuda"))


def _other_lowering(ctx, x, *, op, comm, transpose, site):
    if transpose:  # the transpose of the allreduce is the identity
        return [x]
    return _refuse(ctx)


def _batching(args, dims, **params):
    # Elementwise over ranks: the batch dimension stays where it is.
    return allreduce_p.bind(args[0], **params), dims[0]


def _jvp(primals, tangents, *, op, comm, transpose, site):
    if OPS[op] != "SUM":
        raise NotImplementedError(
            f"{_WHO} is differentiable for MPI.SUM only; got MPI.{OPS[op]}."
        )
    (x,), (t,) = primals, tangents
    params = dict(op=op, comm=comm, transpose=transpose, site=site)
    return allreduce_p.bind(x, **params), allreduce_p.bind(t, **params)


def _transpose(cotangent, x, *, op, comm, transpose, site):
    if OPS[op] != "SUM":
        raise NotImplementedError(
            f"the transpose of {_WHO} is defined for MPI.SUM only; got "
            f"MPI.{OPS[op]}."
        )
    cotangent = ad.instantiate_zeros(cotangent)
    return (
        allreduce_p.bind(
            cotangent, op=op, comm=comm, transpose=not transpose, site=site
        ),
    )


allreduce_p.def_impl(_impl)
allreduce_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(allreduce_p, _lowering, platform="cpu")
try:
    mlir.register_lowering(
        allreduce_p, functools.partial(_lowering, platform="cuda"), platform="cuda"
    )
except NotImplementedError:  # JAX's CUDA plugin is not installed
    pass
# Every other platform (rocm, oneapi, tpu, ...): a clear error when lowered, never
# a CPU fallback.
mlir.register_lowering(allreduce_p, _other_lowering)
batching.primitive_batchers[allreduce_p] = _batching
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
