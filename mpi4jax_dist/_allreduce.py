"""``mpi4jax_dist.allreduce``: an in-place, large-count allreduce for JAX.

The primitive lowers to the XLA FFI handler in ``_ffi/cpu.cc`` with its operand
aliased to its result: under ``jax.jit(..., donate_argnums=...)``, or on an
intermediate inside a ``jit``, XLA hands the handler one buffer, which it reduces
in place (``MPI_IN_PLACE``). Element counts above ``INT_MAX`` go to
``MPI_Allreduce_c`` where the MPI has MPI-4's large-count calls, and in chunks
otherwise (also under Intel MPI 2021, whose ``MPI_Allreduce_c`` returns without
reducing above ``INT_MAX``); ``MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES`` bounds what
one call reduces, and with it MPI's scratch memory.

On CUDA GPUs it lowers to ``_ffi/cuda.cc`` (built where ``pip install`` found a
CUDA toolkit), aliased the same way, so that device memory holds one message.
With ``MPI4JAX_DIST_CUDA_AWARE_MPI=1`` (or mpi4jax's ``MPI4JAX_USE_CUDA_MPI=1``)
MPI reduces the device buffer itself, where the MPI says it can (``force`` where
it cannot say); by default the message goes through a pinned host buffer of
``MPI4JAX_DIST_STAGING_BYTES`` (64 MiB) in two halves, one copied while MPI
reduces the other, which works with any MPI (mpi4jax instead copies the whole
message to the host, twice).

Ordering: the primitive carries mpi4jax's ordered effect, so XLA threads one
token through it and every mpi4jax call of the program; XLA:CPU cannot reorder
them or run two at once (it runs thunks concurrently, ordered only by data).

mpi4jax is the ``mpi4jax`` extra: without it, a call raises an ImportError that
names the extra (:mod:`mpi4jax_dist._extras`). Importing this module imports
neither mpi4py.MPI nor mpi4jax nor the extension: the primitive is made on the
first call.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _config, _extras, _hangs

# Ops by the code the handler knows them by (OpFromCode in _ffi/mpi_helpers.h).
OPS = ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")

_ARITHMETIC = ("SUM", "PROD")
_ORDER = ("MIN", "MAX")
_LOGICAL = ("LAND", "LOR", "LXOR")
_BITWISE = ("BAND", "BOR", "BXOR")
_INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")

# Which predefined op MPI applies to which type (MPI 4.1, section 6.9.2): floats
# take arithmetic and order, complex numbers arithmetic, C integers everything,
# C bool the logical ops. float16 and bfloat16 have no standard MPI type.
OPS_BY_DTYPE = {
    "float32": _ARITHMETIC + _ORDER,
    "float64": _ARITHMETIC + _ORDER,
    "complex64": _ARITHMETIC,
    "complex128": _ARITHMETIC,
    **{name: OPS for name in _INTEGERS},
    "bool": _LOGICAL,
}


def check_supported(
    dtype, op_name: str | None = None, who: str = "mpi4jax_dist.allreduce"
) -> None:
    """Raise ``TypeError`` unless MPI can reduce ``dtype`` with ``MPI.<op_name>``
    (with some op, when ``op_name`` is None); ``who`` is the function the message
    names.

    Pure: touches neither MPI nor JAX, so a refused call makes no MPI call.

    Raises:
        TypeError: naming the dtype or op and what is supported.
    """
    name = np.dtype(dtype).name
    if name not in OPS_BY_DTYPE:
        supported = ", ".join(OPS_BY_DTYPE)
        raise TypeError(
            f"{who} cannot reduce {name} arrays: MPI has no "
            f"standard {name} type. Supported dtypes: {supported} (bool with "
            f"MPI.LAND, MPI.LOR and MPI.LXOR only). Cast first, for example "
            f"x.astype(jnp.float32)."
        )
    allowed = OPS_BY_DTYPE[name]
    if op_name is not None and op_name not in allowed:
        hint = " (or cast to an integer type)" if name == "bool" else ""
        raise TypeError(
            f"{who} cannot reduce {name} with MPI.{op_name}: "
            f"MPI reduces {name} with "
            f"{', '.join('MPI.' + o for o in allowed)} only{hint}."
        )


def op_name(op, who: str = "mpi4jax_dist.allreduce") -> str:
    """Return ``"SUM"`` for ``MPI.SUM`` (and for None), and so on for each op;
    ``who`` is the function an error names.

    Raises:
        TypeError: ``op`` is not one of MPI's predefined reduction ops.
    """
    if op is None:
        return "SUM"
    from mpi4py import MPI  # already imported: op is an MPI.Op

    if isinstance(op, MPI.Op):
        for name in OPS:
            if op == getattr(MPI, name):
                return name
    names = ", ".join(f"MPI.{o}" for o in OPS)
    raise TypeError(
        f"{who}: op must be one of {names}; got {op!r}. "
        f"User-defined ops and MPI.MAXLOC/MINLOC/REPLACE/NO_OP are not supported."
    )


@functools.cache
def _check_mpi(who: str = "mpi4jax_dist.allreduce") -> None:
    """Raise unless MPI is up with at least ``MPI_THREAD_SERIALIZED`` (checked
    once per ``who``, the function the message names).

    XLA runs the handlers on its worker threads, so MPI must let any thread call
    it: ``MPI_THREAD_MULTIPLE``, or ``MPI_THREAD_SERIALIZED``, where the extension
    makes its MPI calls under one lock (``MpiGuard`` in ``_ffi/mpi_helpers.h``).
    """
    from mpi4py import MPI

    from . import _config

    if not MPI.Is_initialized() or MPI.Is_finalized():
        raise RuntimeError(
            f"{who} needs MPI initialized (and not finalized): "
            "import mpi4py.MPI with mpi4py.rc.initialize left True, or call "
            "MPI.Init_thread(MPI.THREAD_MULTIPLE) first."
        )
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        level = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED"}
        settings = _config.thread_level_settings()
        said = ", ".join(f"{k}={v}" for k, v in settings.items()) or "neither set"
        raise RuntimeError(
            f"{who} needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE, but MPI "
            f"provides MPI_THREAD_{level.get(provided, provided)}: XLA runs the "
            f"call on its worker threads. On Cray MPICH set "
            f"MPICH_MAX_THREAD_SAFETY=serialized (or multiple) in the job script, "
            f"and leave mpi4py.rc.thread_level (MPI4PY_RC_THREAD_LEVEL) at its "
            f"default 'multiple' (here: {said})."
        )


# What runs where the compiled ops have no handler, by JAX's platform name (Intel
# GPUs are "oneapi" to jax-oneapi-plugin, "xpu" or "sycl" to Intel's extensions).
_INTEL = (
    "On Intel GPUs use mpi4jax.allreduce (MPI4JAX_USE_SYCL_MPI=1, with a "
    "GPU-aware MPI such as Aurora's), or lax.psum inside shard_map."
)
_ELSEWHERE = {
    "cuda": "On CUDA GPUs use the blocking mpi4jax_dist.allreduce.",
    "rocm": "On AMD GPUs use mpi4jax.allreduce, or lax.psum inside shard_map.",
    "oneapi": _INTEL,
    "xpu": _INTEL,
    "sycl": _INTEL,
}
_OTHER = "There use mpi4jax.allreduce, or lax.psum inside shard_map."


def unsupported_lowering(who: str, supported: tuple[str, ...]):
    """Return a lowering rule for the platforms without a handler: it raises
    ``NotImplementedError`` naming them and what runs there instead (at lowering,
    when the jitted function is first called or lowered; nothing falls back to the
    CPU)."""

    def rule(ctx, *args, **params):
        platforms = [p for p in ctx.module_context.platforms if p not in supported]
        names = ", ".join(platforms) or "this platform"
        there = " ".join(dict.fromkeys(_ELSEWHERE.get(p, _OTHER) for p in platforms))
        raise NotImplementedError(
            f"{who} runs on {' and '.join(p.upper() for p in supported)} only: it "
            f"has no handler for the {names} platform, and does not fall back to "
            f"the CPU. {there or _OTHER}"
        )

    return rule


def _communicator(comm, who: str = "mpi4jax_dist.allreduce"):
    """Return ``comm`` (mpi4jax's clone of COMM_WORLD for None), checked; ``who``
    is the function an error names."""
    from mpi4py import MPI

    if comm is None:
        # mpi4jax's own default: its calls and ours then share one communicator.
        from mpi4jax._src.utils import get_default_comm

        return get_default_comm()
    if isinstance(comm, MPI.Intercomm) or not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"{who}: comm must be an mpi4py intracommunicator "
            f"(MPI.Intracomm, such as MPI.COMM_WORLD or a Split of it); got "
            f"{type(comm).__name__}."
        )
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{who}: comm is MPI.COMM_NULL.")
    return comm


def extension(platform: str = "cpu"):
    """Return the compiled ops' extension module for ``platform`` (``"cpu"`` or
    ``"cuda"``), loaded on first use and given the collective timeout
    (:func:`mpi4jax_dist._hangs.configure`)."""
    from . import _ffi

    module = _ffi.load_cuda() if platform == "cuda" else _ffi.load()
    _hangs.configure(module)
    return module


class _Comm:
    """A communicator as a primitive parameter: hashable, equal by its
    registration in the extension (``register_comm``), not by its handle.

    Compiled code names the communicator by that registration's id: MPI gives a
    freed communicator's handle to the next one made, and a call compiled for the
    freed one would reduce over the new one. The extension marks the id freed when
    the communicator goes (an MPI attribute's delete callback), and the compiled
    call then fails; a new communicator gets a new id, so that JAX compiles its
    calls anew. Made after MPI is initialized (:func:`_check_mpi`).
    """

    __slots__ = ("comm", "handle", "key", "_ids")

    def __init__(self, comm):
        self.comm = comm
        # The Fortran handle: one integer, the same for MPICH's int handles and
        # Open MPI's pointers; MPI_Comm_f2c turns it back in the extension.
        self.handle = int(comm.py2f())
        cpu = extension()
        self.key = cpu.register_comm(self.handle)
        # The id in each platform's extension (its own registry), by module name.
        self._ids = {cpu.__name__: self.key}
        _hangs.note_comm(self)  # for a collective timeout's report

    def id_in(self, module) -> int:
        """The communicator's id in ``module`` (the CPU or CUDA extension),
        registered on first use and then kept: a lowering after the communicator
        was freed compiles the dead id, which fails, never a handle's new owner."""
        if module.__name__ not in self._ids:
            self._ids[module.__name__] = module.register_comm(self.handle)
        return self._ids[module.__name__]

    def __hash__(self):
        return hash(("mpi4jax_dist._Comm", self.key))

    def __eq__(self, other):
        return isinstance(other, _Comm) and other.key == self.key

    def __repr__(self):
        return f"Comm(f2c={self.handle}, id={self.key})"


def allreduce(x, op=None, *, comm=None):
    """Reduce ``x`` over the ranks of ``comm``, in place where XLA allows it.

    Where ``mpi4jax.allreduce`` returns a new buffer, this one's operand and
    result alias: under ``jax.jit(f, donate_argnums=...)``, or on an intermediate
    inside a ``jit``, XLA gives the handler one buffer and MPI reduces it in place
    (``MPI_IN_PLACE``), so a message of N bytes needs N bytes, not 2N. Without
    donation (eagerly, or on a jit argument still alive) XLA first copies the
    input into the result's buffer, as it would for any op, and MPI reduces that
    in place; were XLA ever to hand over two buffers, the handler would copy and
    reduce in place just the same (MPI asks for ``MPI_IN_PLACE`` on all ranks or
    none).

    On a CUDA GPU the device buffer is reduced where it is: by a CUDA-aware MPI
    (``MPI4JAX_DIST_CUDA_AWARE_MPI=1``, see
    :func:`mpi4jax_dist._config.cuda_aware_mpi`), or by default through a pinned
    host buffer (``MPI4JAX_DIST_STAGING_BYTES``, default 64 MiB, see
    :func:`mpi4jax_dist._config.staging_bytes`), so that device memory holds one
    message and host memory that buffer.

    Any element count works, above 2**31 included. The reduction runs in chunks
    of ``MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES`` (default 64 MiB; 0 for one call,
    see :func:`mpi4jax_dist._config.allreduce_chunk_bytes`), which bounds MPI's
    scratch memory.

    Calls keep program order on every rank: they share mpi4jax's ordered effect,
    so mpi4jax's calls and these are ordered together. Usable eagerly, in
    ``jit``, ``lax.fori_loop``/``while_loop``/``scan``, under ``vmap``, and under
    ``grad``/``jvp`` for ``MPI.SUM`` with mpi4jax's rules (the transpose of the
    allreduce is the identity). MPI must let any thread call it: XLA calls the
    handler from its worker threads. ``MPI_THREAD_MULTIPLE`` (mpi4py's default)
    or ``MPI_THREAD_SERIALIZED`` (Cray MPICH's where ``MPICH_MAX_THREAD_SAFETY``
    is unset), where the extension's MPI calls hold one process-wide lock: your
    own mpi4py calls must then not overlap a running jitted program.

    Args:
        x: array or scalar: float32/64, complex64/128, (u)int8/16/32/64, or bool
            for the logical ops.
        op: an ``mpi4py.MPI.Op``: ``MPI.SUM`` (the default, also for None),
            ``PROD``, ``MIN``, ``MAX``, ``LAND``, ``LOR``, ``LXOR``, ``BAND``,
            ``BOR`` or ``BXOR``, where MPI defines it for the dtype.
        comm: an mpi4py intracommunicator; default: mpi4jax's clone of
            ``MPI.COMM_WORLD``.

    Returns:
        The reduced array, of the shape and dtype of ``x``.

    Raises:
        TypeError: a dtype, op or communicator MPI cannot reduce with, before any
            MPI call.
        RuntimeError: MPI is not initialized, or provides less than
            ``MPI_THREAD_SERIALIZED`` (the message names
            ``MPICH_MAX_THREAD_SAFETY``).
        ImportError: mpi4jax is not installed (a ``ModuleNotFoundError`` naming
            the ``mpi4jax`` extra), or the extension was built against another
            MPI than mpi4py's, or (on a CUDA GPU, when compiled) without CUDA,
            or against a CUDA that this node's driver or JAX's CUDA plugin does
            not match.
        RuntimeError: (on a CUDA GPU, when compiled) CUDA-aware MPI asked for
            from an MPI that says it cannot read device memory, or cannot say
            (unless ``MPI4JAX_DIST_CUDA_AWARE_MPI=force``).
    """
    import jax.numpy as jnp

    # Its ordered effect and default communicator are mpi4jax's.
    _extras.require_mpi4jax("mpi4jax_dist.allreduce")
    x = jnp.asarray(x)
    check_supported(x.dtype)  # before op_name, which may import mpi4py.MPI
    name = op_name(op)
    check_supported(x.dtype, name)
    _check_mpi()
    comm = _Comm(_communicator(comm))
    return _primitive().bind(x, op=OPS.index(name), comm=comm, transpose=False)


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
            f"mpi4jax_dist.allreduce was told that MPI reads device memory "
            f"({asked}), but this MPI ({library}) says it cannot "
            f"(MPIX_Query_cuda_support() is 0); it would crash on a device "
            f"pointer. Unset {_config.CUDA_AWARE_MPI} and "
            f"{_config.MPI4JAX_CUDA_AWARE_MPI}, or set {_config.CUDA_AWARE_MPI}=0, "
            f"to stage through host memory, or use an MPI built with CUDA support."
        )
    raise RuntimeError(
        f"mpi4jax_dist.allreduce was told that MPI reads device memory ({asked}), "
        f"but this MPI ({library}) cannot say whether it does (no "
        f"MPIX_Query_cuda_support: Open MPI without its CUDA extension, Intel MPI, "
        f"MPICH before 4.1), and an MPI without CUDA support crashes or reads "
        f"garbage on a device pointer. Set {_config.CUDA_AWARE_MPI}=force if you "
        f"know this MPI was built with CUDA support, or "
        f"{_config.CUDA_AWARE_MPI}=0 to stage through host memory (works with "
        f"every MPI)."
    )


@functools.cache
def _primitive():
    """Make the primitive and its rules (first call only: imports mpi4jax)."""
    import jax
    from jax.core import ShapedArray
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    # mpi4jax's effect, not one of ours: one token then orders mpi4jax's calls
    # and ours, and mpi4jax has registered it as allowed in loops and
    # custom_vjp. Its abstract_token follows JAX's moves (private in 0.10).
    from mpi4jax._src.jax_compat import abstract_token
    from mpi4jax._src.utils import ordered_effect

    from . import _ffi

    prim = Primitive("mpi4jax_dist_allreduce")

    @functools.cache
    def jitted(op, comm, transpose):
        return jax.jit(lambda x: prim.bind(x, op=op, comm=comm, transpose=transpose))

    def impl(x, *, op, comm, transpose):
        return jitted(op, comm, transpose)(x)

    def abstract_eval(x, *, op, comm, transpose):
        out = ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
        # The transposed allreduce is the identity (as in mpi4jax): no MPI call,
        # nothing to order.
        return out, (set() if transpose else {ordered_effect})

    def lowering(ctx, x, *, op, comm, transpose, platform="cpu"):
        if transpose:
            return [x]
        module = extension(platform)
        attributes = {
            "comm": np.int64(comm.id_in(module)),
            "op": np.int32(op),
            "chunk_bytes": np.int64(_config.allreduce_chunk_bytes()),
            "check": np.int32(_config.debug_checks()),
        }
        if platform == "cuda":
            attributes["cuda_aware"] = np.int32(_cuda_aware(module))
        token = ctx.tokens_in.get(ordered_effect)
        (result,) = jax.ffi.ffi_lowering(
            _ffi.ALLREDUCE_TARGET,
            operand_output_aliases={0: 0},
            has_side_effect=True,
        )(ctx.replace(avals_in=(*ctx.avals_in, abstract_token)), x, token, **attributes)
        # The next MPI call waits for a token made from the result, not for a
        # second result of the allreduce: an (array, token) result is a tuple,
        # whose index table XLA allocates as temp memory.
        (token,) = jax.ffi.ffi_lowering(_ffi.TOKEN_AFTER_TARGET)(
            ctx.replace(avals_in=ctx.avals_out, avals_out=(abstract_token,)),
            result,
        )
        ctx.set_tokens_out(mlir.TokenSet({ordered_effect: token}))
        return [result]

    refuse = unsupported_lowering("mpi4jax_dist.allreduce", ("cpu", "cuda"))

    def other_lowering(ctx, x, *, op, comm, transpose):
        if transpose:  # the transpose of the allreduce is the identity
            return [x]
        return refuse(ctx)

    def batching_rule(args, dims, *, op, comm, transpose):
        # Elementwise over ranks: the batch dimension stays where it is.
        return prim.bind(args[0], op=op, comm=comm, transpose=transpose), dims[0]

    def jvp(primals, tangents, *, op, comm, transpose):
        if OPS[op] != "SUM":
            raise NotImplementedError(
                f"mpi4jax_dist.allreduce is differentiable for MPI.SUM only; got "
                f"MPI.{OPS[op]}."
            )
        (x,), (t,) = primals, tangents
        value = prim.bind(x, op=op, comm=comm, transpose=transpose)
        return value, prim.bind(t, op=op, comm=comm, transpose=transpose)

    def transpose_rule(cotangent, x, *, op, comm, transpose):
        if OPS[op] != "SUM":
            raise NotImplementedError(
                f"the transpose of mpi4jax_dist.allreduce is defined for MPI.SUM "
                f"only; got MPI.{OPS[op]}."
            )
        cotangent = ad.instantiate_zeros(cotangent)
        return (prim.bind(cotangent, op=op, comm=comm, transpose=not transpose),)

    prim.def_impl(impl)
    prim.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lowering, platform="cpu")
    try:
        mlir.register_lowering(
            prim, functools.partial(lowering, platform="cuda"), platform="cuda"
        )
    except NotImplementedError:  # JAX's CUDA plugin is not installed
        pass
    # Every other platform (rocm, oneapi, tpu, ...): a clear error when lowered,
    # never a CPU fallback.
    mlir.register_lowering(prim, other_lowering)
    batching.primitive_batchers[prim] = batching_rule
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose_rule
    return prim
