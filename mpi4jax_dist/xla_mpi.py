"""JAX's own cross-process collectives on CPU over MPI, behind one switch
(``MPI4JAX_DIST_CPU_COLLECTIVES=mpi``): :func:`prepare`, before JAX is imported,
points jaxlib's MPItrampoline at this package's MPIABI wrapper; :func:`check`
refuses, saying what to do, where MPI collectives cannot work, rather than falling
back to gloo. Off by default. docs/design.rst, *JAX's CPU collectives over MPI*.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import _config, _ffi, _mpi

# The modules whose import loads libjax_common (and with it MPItrampoline): before
# and since jax 0.6.1. Not in _compat, which imports jax: this runs before it.
_JAXLIB_NATIVE = ("jaxlib._jax", "jaxlib.xla_extension")


def jaxlib_loaded() -> bool:
    """Return True once jaxlib's native library is loaded in this process."""
    return any(name in sys.modules for name in _JAXLIB_NATIVE)


def wrapper_loaded(library: str | None) -> bool:
    """Return True when this process has ``library`` mapped (MPItrampoline opened
    it when jaxlib loaded)."""
    if not library:
        return False
    try:
        wanted = os.path.realpath(library)
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith(wanted) for line in maps)
    except OSError:  # no /proc: trust the variable
        return True


def prepare() -> None:
    """Point MPItrampoline at our wrapper and JAX at MPI, if asked and not too late.

    Called before ``import jax``; never raises (:func:`check` says what is wrong).
    """
    try:
        choice = _config.cpu_collectives()
    except ValueError:
        return
    if choice != "mpi" or jaxlib_loaded():
        return
    env = _config.environ()
    if not _config.trampoline_lib():
        library = _ffi.mpiabi_library()
        if library is None:
            return
        env[_config.TRAMPOLINE_LIB] = str(library)
    env.setdefault(_config.JAX_CPU_COLLECTIVES, "mpi")


def env_lines() -> list[str]:
    """Return the shell lines a job script evaluates before Python starts.

    Raises:
        RuntimeError: the wrapper library was not built.
    """
    library = _ffi.mpiabi_library()
    if library is None:
        raise RuntimeError(_not_built())
    return [
        f"export {_config.CPU_COLLECTIVES}=mpi",
        f"export {_config.TRAMPOLINE_LIB}={library}",
        f"export {_config.JAX_CPU_COLLECTIVES}=mpi",
    ]


def check(choice: str | None = None) -> str | None:
    """Make JAX's CPU collectives what ``choice`` (default: the variable) asks, or
    raise saying why they cannot be; return the choice.

    Called where JAX initializes through this package, before the CPU backend.

    Raises:
        ValueError: ``MPI4JAX_DIST_CPU_COLLECTIVES`` (or ``choice``) is not mpi/gloo.
        RuntimeError: MPI was asked for and cannot work (docs/design.rst).
    """
    if choice is None:
        choice = _config.cpu_collectives()
    elif choice not in ("mpi", "gloo"):
        raise ValueError(
            f"cpu_collectives={choice!r}: expected 'mpi' or 'gloo' (or None for "
            f"{_config.CPU_COLLECTIVES}, else JAX's default)."
        )
    if choice is None:
        return None
    import jax

    from . import _compat

    if choice == "mpi":
        library = _config.trampoline_lib()
        if not library and _ffi.mpiabi_library() is None:
            raise RuntimeError(_not_built())
        if not wrapper_loaded(library):
            raise RuntimeError(
                f"{_config.CPU_COLLECTIVES}=mpi, but jaxlib was loaded without our "
                f"MPI wrapper ({_config.TRAMPOLINE_LIB}="
                f"{library or '(unset)'}): it must be set before jax is imported. "
                f"Import mpi4jax_dist before jax, or put "
                f'`eval "$(python -m mpi4jax_dist env)"` in the job script before '
                f"the mpiexec line."
            )
        devices = _compat.cpu_devices_per_process()
        if devices > 1:
            raise RuntimeError(
                f"{_config.CPU_COLLECTIVES}=mpi takes one CPU device per process "
                f"(XLA's MPI collectives), but this process is set for {devices} "
                f"(jax_num_cpu_devices or XLA_FLAGS' "
                f"--xla_force_host_platform_device_count). Use one device per MPI "
                f"rank, or {_config.CPU_COLLECTIVES}=gloo."
            )
    if _compat.backends_initialized():
        current = _compat.cpu_collectives()
        if current != choice:
            raise RuntimeError(
                f"{_config.CPU_COLLECTIVES}={choice}, but JAX's CPU backend already "
                f"exists with {current or 'its default'} collectives: initialize "
                f"(jax.distributed.initialize or mpi4jax_dist.initialize) before "
                f"anything touches jax.devices()."
            )
    jax.config.update("jax_cpu_collectives_implementation", choice)
    return choice


_settled: list[str | None] = []  # the choice, once check() has run in this process


def settle(choice: str | None = None) -> str | None:
    """:func:`check` once per process: the first caller's ``choice`` holds (an
    explicit ``mpi4jax_dist.initialize(cpu_collectives=...)`` comes first)."""
    if not _settled:
        _settled.append(check(choice))
    return _settled[0]


def use_private_world(duplicate_world) -> bool:
    """Give XLA's MPI collectives a private duplicate of the world, which
    ``duplicate_world()`` makes (None where the job's communicator is not the
    world); return whether it was given.

    XLA makes its communicators with ``MPI_Comm_split(MPI_COMM_WORLD)`` from its
    worker threads, whenever a program first runs a collective, while the main
    thread may be in a collective of its own on ``MPI_COMM_WORLD`` (mpi4py's,
    mpi4jax's): MPI forbids both, concurrent collectives on one communicator and
    an order that differs between ranks. Our wrapper passes the duplicate wherever
    XLA passes ``MPI_COMM_WORLD`` (``mpi4jax_dist_mpiabi_set_world`` in mpiabi.c).
    Called right after the bootstrap (the duplicate is a collective), when MPI
    collectives were settled on; a no-op otherwise, or where ``MPITRAMPOLINE_LIB``
    names another wrapper (one without that function).
    """
    if _settled != ["mpi"] or _given:
        return bool(_given)
    import ctypes

    from mpi4py import MPI

    set_world = _wrapper_function(
        "mpi4jax_dist_mpiabi_set_world", ctypes.c_int, [ctypes.c_size_t]
    )
    if set_world is None:
        return False
    world = duplicate_world()
    if world is None:
        return False
    library = _config.trampoline_lib()
    rc = set_world(MPI._handleof(world))
    if rc != MPI.SUCCESS:
        raise RuntimeError(
            f"mpi4jax_dist: the MPI wrapper {library} refused the communicator "
            f"it should hand XLA (MPI error {rc}): it was given one already, or "
            f"MPITRAMPOLINE_LIB names another build of it. Unset MPITRAMPOLINE_LIB "
            f"and let MPI4JAX_DIST_CPU_COLLECTIVES=mpi set it."
        )
    _given.append(world)
    return True


_given: list = []  # the duplicate given to the wrapper, once


def _wrapper_function(name: str, restype, argtypes=()):
    """The function ``name`` of the MPI wrapper MPItrampoline loaded (dlopen of
    ``MPITRAMPOLINE_LIB`` gives back the same library), typed; None where that
    variable names another wrapper, one without it."""
    import ctypes

    try:
        function = getattr(ctypes.CDLL(_config.trampoline_lib()), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.restype, function.argtypes = restype, list(argtypes)
    return function


def record():
    """XLA's calls into MPI as the wrapper records them, for the hang reports:
    ``(in_flight, reader)``, where ``in_flight()`` returns the calls this process
    is in (``XLA's MPI_Allreduce #3 SUM float32[4] on 2 ranks``, several joined
    by ``; ``, "" for none) and ``reader`` is the address of the C function that
    writes that text without Python (``mpi4jax_dist_mpiabi_in_flight`` in
    mpiabi.c), for ``_stacks``'s thread. None unless XLA's collectives go
    through our wrapper (:func:`use_private_world` gave it the world)."""
    if not _given:
        return None
    import ctypes

    reader = _wrapper_function(
        "mpi4jax_dist_mpiabi_in_flight",
        ctypes.c_size_t,
        [ctypes.c_char_p, ctypes.c_size_t],
    )
    if reader is None:
        return None

    def in_flight() -> str:
        text = ctypes.create_string_buffer(4096)  # one per call: any thread
        size = reader(text, len(text))
        return text.raw[:size].decode(errors="replace")

    return in_flight, ctypes.cast(reader, ctypes.c_void_p).value


def time_calls() -> bool:
    """Have the wrapper time XLA's collectives into the timeline whenever one is
    written (:mod:`mpi4jax_dist.timing.timeline`): it is handed the core's
    timeline functions once, and while none is written pays one call a
    collective that reads a flag. False unless XLA's collectives go through our
    wrapper (:func:`use_private_world` gave it the world)."""
    import ctypes

    if not _given:
        return False
    hand_over = _wrapper_function(
        "mpi4jax_dist_mpiabi_time_calls", None, [ctypes.c_void_p, ctypes.c_void_p]
    )
    if hand_over is None:
        return False
    from . import _ffi

    hand_over(*_ffi.load().timeline_hooks())
    return True


def report() -> dict:
    """What the diagnostics print: the switch, JAX's setting and the wrapper."""
    from . import _compat

    try:
        requested = _config.cpu_collectives()
    except ValueError as err:
        requested = f"invalid: {err}"
    library = _config.trampoline_lib()
    return {
        "requested": requested,
        "jax": _compat.cpu_collectives(),
        "wrapper": library,
        "wrapper_loaded": wrapper_loaded(library) if library else False,
        "wrapper_built": str(_ffi.mpiabi_library() or "") or None,
        # The world the wrapper hands XLA, read back from it: a private duplicate
        # of MPI_COMM_WORLD (another handle, congruent); None where no duplicate
        # was given.
        "xla_world": _world_held() if _given else None,
        # How often XLA passed MPI_COMM_WORLD and got the private duplicate
        # (None where no duplicate was given).
        "xla_world_redirects": _world_redirects() if _given else None,
    }


def _world_held() -> dict | None:
    import ctypes

    from mpi4py import MPI

    world = _wrapper_function("mpi4jax_dist_mpiabi_world", ctypes.c_size_t)
    if world is None:
        return None
    held = MPI.Comm.fromhandle(world())
    return {
        "private": MPI._handleof(held) != MPI._handleof(MPI.COMM_WORLD),
        "congruent": MPI.Comm.Compare(MPI.COMM_WORLD, held) == MPI.CONGRUENT,
    }


def _world_redirects() -> int | None:
    import ctypes

    count = _wrapper_function("mpi4jax_dist_mpiabi_world_redirects", ctypes.c_ulonglong)
    return None if count is None else int(count())


def _not_built() -> str:
    version = _ffi._mpi4py_library_version()
    wanted = _mpi.family(version) if version else None
    found = _ffi._first_line(version or "MPI (none found)")
    mpi = f"{wanted or 'an unknown MPI'}, mpi4py's {found}"
    there = ", ".join(sorted(_ffi.built("mpiabi"))) or "none"
    return (
        f"{_config.CPU_COLLECTIVES}=mpi needs mpi4jax_dist's MPI wrapper library "
        f"(_ffi/_mpiabi) built for {mpi}, which is not in "
        f"{Path(_ffi.__file__).parent} (built there for: {there}). Rebuild "
        f"mpi4jax_dist with this MPI's mpicc first on PATH: pip install "
        f"--no-build-isolation --no-cache-dir --force-reinstall --no-deps <path to "
        f"mpi4jax_dist>."
    )
