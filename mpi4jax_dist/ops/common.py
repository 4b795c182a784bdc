"""What the compiled ops share: the ops and dtypes MPI reduces, the checks made
before any MPI call, the communicator as a primitive parameter, the extension
loaded and configured, and the lowering for platforms without a handler.
Importing it imports neither mpi4py.MPI nor mpi4jax nor the extension."""

from __future__ import annotations

import functools
import os
import sys
import weakref
from typing import NamedTuple

import numpy as np

from .. import _config
from ..faults import hangs

# Ops by the code the handler knows them by (OpFromCode in _ffi/op_dtype.h).
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

    got = repr(op)
    if isinstance(op, MPI.Op):
        for name in OPS:
            if op == getattr(MPI, name):
                return name
        for name in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP"):
            if op == getattr(MPI, name, None):
                got = f"MPI.{name}"
    names = ", ".join(f"MPI.{o}" for o in OPS)
    raise TypeError(
        f"{who}: op must be one of {names}; got {got}. "
        f"User-defined ops and MPI.MAXLOC/MINLOC/REPLACE/NO_OP are not supported."
    )


@functools.cache
def check_mpi(who: str = "mpi4jax_dist.allreduce") -> None:
    """Raise unless MPI is up with at least ``MPI_THREAD_SERIALIZED`` (checked
    once per ``who``, the function the message names).

    XLA runs the handlers on its worker threads, so MPI must let any thread call
    it: ``MPI_THREAD_MULTIPLE``, or ``MPI_THREAD_SERIALIZED``, where the extension
    makes its MPI calls under one lock (``MpiGuard`` in ``_ffi/mpi_guard.h``).
    """
    from mpi4py import MPI

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


def ordering():
    """Return ``(ordered_effect, abstract_token)`` of mpi4jax (an effect not ours:
    one token orders its calls and ours), with the runtime token of such programs
    handed on as it is (:func:`mpi4jax_dist._compat.reuse_runtime_tokens`,
    ``MPI4JAX_DIST_TOKEN_REUSE``); each op's primitives call it once."""
    from .. import _compat

    _compat.reuse_runtime_tokens(_config.token_reuse())
    _compat.tokens_in_program(_config.tokens_in_program())
    return _compat.mpi4jax_ordering()


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


# The communicator objects calls were given while live (weak references: mpi4py's
# are not hashable): one given again once it is MPI.COMM_NULL was freed since.
_seen: list = []


def _seen_live(comm) -> bool:
    """Whether ``comm`` (this very object) was given to a call before."""
    _seen[:] = [ref for ref in _seen if ref() is not None]
    return any(ref() is comm for ref in _seen)


def communicator(comm, who: str = "mpi4jax_dist.allreduce"):
    """Return ``comm`` (``MPI.COMM_WORLD`` for None), checked; ``who`` is the
    function an error names. The calls never run on it itself: the extension
    makes a private duplicate of it on the first call (``comm_registry.h``)."""
    from mpi4py import MPI

    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        if _seen_live(comm):
            raise ValueError(
                f"{who}: comm has been freed (comm.Free()) since an earlier call "
                f"was given it: it is MPI.COMM_NULL now. Call with a live "
                f"communicator."
            )
        raise ValueError(
            f"{who}: comm is MPI.COMM_NULL: a communicator freed (comm.Free()), "
            f"or a Split of which this rank is in no group. Call with a live "
            f"communicator (after a Split, on the group's members only)."
        )
    if isinstance(comm, MPI.Comm) and not _seen_live(comm):
        _seen.append(weakref.ref(comm))
    if isinstance(comm, MPI.Intercomm) or not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"{who}: comm must be an mpi4py intracommunicator "
            f"(MPI.Intracomm, such as MPI.COMM_WORLD or a Split of it); got "
            f"{type(comm).__name__}."
        )
    return comm


# Frames of these files are not the user's: a call's site is the first frame
# outside them (and outside JAX, which traces the user's function).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_USERS = (_PACKAGE + os.sep, os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep)


def caller_site() -> str:
    """Where the user made the call being made now: ``file:line in function`` of
    the innermost frame outside this package and JAX (``<unknown>`` if none)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_NOT_USERS[0])
        or any(part in frame.f_code.co_filename for part in _NOT_USERS[1:])
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    code = frame.f_code
    name = os.path.basename(code.co_filename)
    return f"{name}:{frame.f_lineno} in {code.co_name}"


class Site(NamedTuple):
    """Where a call was made, as its primitive carries it: ``text`` for the
    reports (``a.py:12 in f``, followed by `` (site 'halo')`` where the call was
    given a name) and ``compared``, what the ranks compare of it (the line's text,
    or the name), which the extension keeps as a key (``Record::RegisterSite``)."""

    text: str
    compared: str


def call_site(name=None, who: str = "mpi4jax_dist.allreduce") -> Site:
    """Return the :class:`Site` of the call being made now: where the user made it
    (:func:`caller_site`), compared by that line or, given ``name`` (the ``site=``
    argument), by the name; ``who`` is the function an error names.

    Pure: touches neither MPI nor JAX.

    Raises:
        TypeError: ``name`` is neither None nor a str.
        ValueError: ``name`` is empty (or only white space).
    """
    line = caller_site()
    if name is None:
        return Site(line, line)
    if not isinstance(name, str):
        raise TypeError(
            f"{who}: site must be a str, a name the ranks compare in place of the "
            f"call's source line (the same on every rank for the calls meant to "
            f"match), or None; got {type(name).__name__}."
        )
    if not name.strip():
        raise ValueError(
            f"{who}: site must be a non-empty name; got {name!r}. Give the calls "
            f"meant to match one name on every rank, or leave site out to compare "
            f"the source line."
        )
    # Apart from every line's text ("a.py:12 in f"): a name never matches a line.
    return Site(f"{line} (site {name!r})", f"site={name}")


def extension(platform: str = "cpu"):
    """Return the compiled ops' extension module for ``platform`` (``"cpu"`` or
    ``"cuda"``), loaded on first use and given the collective timeout
    (:func:`mpi4jax_dist.faults.hangs.configure`)."""
    from .. import _ffi

    module = _ffi.load_cuda() if platform == "cuda" else _ffi.load()
    hangs.configure(module)
    return module


class Comm:
    """A communicator as a primitive parameter: hashable, equal by its
    registration in the extension (``register_comm``), not by its handle.

    Compiled code names the communicator by that registration's id: MPI gives a
    freed communicator's handle to the next one made, and a call compiled for the
    freed one would reduce over the new one. The extension marks the id freed when
    the communicator goes (an MPI attribute's delete callback), and the compiled
    call then fails; a new communicator gets a new id, so that JAX compiles its
    calls anew. Made after MPI is initialized (:func:`check_mpi`).
    """

    __slots__ = ("comm", "handle", "key")

    def __init__(self, comm):
        self.comm = comm
        # The Fortran handle: one integer, the same for MPICH's int handles and
        # Open MPI's pointers; MPI_Comm_f2c turns it back in the extension.
        self.handle = int(comm.py2f())
        # The id every extension compiles (the CPU and CUDA modules read the one
        # registry of the core, _core), registered once and then kept: a lowering
        # after the communicator was freed compiles the dead id, which fails,
        # never a handle's new owner.
        self.key = extension().register_comm(self.handle)
        hangs.note_comm(self)  # for a collective timeout's report

    def __hash__(self):
        return hash(("mpi4jax_dist.Comm", self.key))

    def __eq__(self, other):
        return isinstance(other, Comm) and other.key == self.key

    def __repr__(self):
        return f"Comm(f2c={self.handle}, id={self.key})"
