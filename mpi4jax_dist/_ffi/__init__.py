"""The compiled XLA FFI handlers, built by ``pip install`` against one MPI.

The build (``conf/builder.py``) compiles ``cpu.cc`` into ``_cpu``, against the MPI
of the compiler wrapper it finds (``$MPICC``, the virtual environment's own
``mpicc``, mpi4py's, the one on ``PATH``, Cray's ``cc``); where it finds CUDA,
``cuda.cc`` into ``_cuda``; the core both link (the communicator registry, the
record, the timeout, the counts: one a process) into the library ``_core`` beside
them; and ``mpiabi.c``, a plain C library and not a module, into ``_mpiabi``: the
MPIABI wrapper through which XLA's MPI collectives on CPU reach that MPI
(jaxlib's MPItrampoline loads the library named by ``MPITRAMPOLINE_LIB``).
Beside them it writes a record of the build
(``_build.cpython-312-x86_64-linux-gnu.json``: this Python's, named as its modules
are), which names the MPI family they call. One build per install: each
environment installs its own copy.

:func:`load` checks that the build calls the library mpi4py has loaded and
registers its handlers with JAX; :func:`load_cuda` does the same for the CUDA
platform under the same target names; :func:`mpiabi_library` says which library
to name. Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.machinery
import importlib.util
import json
import os
import pkgutil
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import _config, _mpi

# The names XLA knows the handlers by, on every platform.
ALLREDUCE_TARGET = "mpi4jax_dist_allreduce"
TOKEN_AFTER_TARGET = "mpi4jax_dist_token_after"
# The non-blocking allreduce's start, test and wait, and overlap's tie
# (mpi4jax_dist.ops.iallreduce): on the CPU only.
IALLREDUCE_TARGETS = (
    "mpi4jax_dist_iallreduce_start",
    "mpi4jax_dist_iallreduce_test",
    "mpi4jax_dist_iallreduce_wait",
    "mpi4jax_dist_iallreduce_tie",
)

_HERE = Path(__file__).resolve().parent
# The build's record (conf/builder.py), named for this Python as its modules are:
# _build.cpython-312-x86_64-linux-gnu.json.
_SUFFIX = os.path.splitext(importlib.machinery.EXTENSION_SUFFIXES[0])[0]
_RECORD = _HERE / f"_build{_SUFFIX}.json"


def built(kind: str = "cpu") -> dict[str, Path]:
    """Return this install's build of ``kind``: ``{family: path}``, the MPI family
    it was built against (``mpich``, ``openmpi``, ``impi``) and its file, or ``{}``
    where there is none.

    Args:
        kind: ``"cpu"`` or ``"cuda"``, the platform of the handlers,
            ``"core"``, the library both link, ``"stacks"``, or ``"mpiabi"``,
            the MPIABI wrapper library.
    """
    try:
        record = json.loads(_RECORD.read_text())
        path = _HERE / record["modules"][kind]
        family = record["family"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # not built, or not this way (the record is the build's list)
    return {family: path} if path.is_file() else {}


def mpiabi_library(family: str | None = None) -> Path | None:
    """Return the MPIABI wrapper library to name in ``MPITRAMPOLINE_LIB``, or None.

    The wrapper must be built for the MPI that mpi4py will load: both then share
    one MPI library in the process. This is called before ``import jax``
    (MPItrampoline opens the library when jaxlib loads), so it imports neither jax
    nor ``mpi4py.MPI`` and initializes no MPI. The rule:

    1. ``family`` given (``mpich``, ``openmpi``, ``impi``): the build if it is for
       that family, else None.
    2. Else the family of the MPI library mpi4py loads, by its
       ``MPI_Get_library_version`` (:func:`~mpi4jax_dist._mpi.family`; MPI lets
       that be called before ``MPI_Init``): mpi4py's own if ``mpi4py.MPI`` is
       already imported, else the library mpi4py's loader picks
       (``MPI4PY_LIBMPI``, then this environment's ``lib``, then the system's),
       opened with ``ctypes``. The build if it is for that family, else None: a
       wrapper for another MPI would load a second MPI library into the process.
    3. Where no MPI library is found, or it is none we can name: the build.

    Returns:
        The path of ``_mpiabi.<ext>`` in this directory, or None.
    """
    builds = built("mpiabi")
    if not builds:
        return None
    ((built_for, path),) = builds.items()
    if family is None:
        version = _mpi4py_library_version()
        family = _mpi.family(version) if version else None
    return path if family in (None, built_for) else None


def _mpi4py_library_version() -> str | None:
    """``MPI_Get_library_version`` of the MPI library mpi4py loads (or has loaded),
    without importing ``mpi4py.MPI`` or initializing MPI; None if none is found."""
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        return module.Get_library_version()
    lib = _linked_by_mpi4py()
    if lib is not None:
        return _library_version(lib)
    try:  # mpi4py's own choice of library (a private helper of mpi4py >= 4)
        from mpi4py import _mpiabi

        lib = _mpiabi._dlopen_libmpi(_config.environ().get("MPI4PY_LIBMPI"))
    except Exception:  # no mpi4py, another version of it, or no library
        pass
    if lib is None:  # mpi4py's order, in short: this environment, then the system
        names = ("libmpi.so", "libmpi.so.12", "libmpi.so.40")
        prefixed = [os.path.join(sys.prefix, "lib", name) for name in names]
        for candidate in [*prefixed, *names]:
            try:
                lib = ctypes.CDLL(candidate, os.RTLD_LOCAL)
                break
            except OSError:
                continue
    return _library_version(lib) if lib else None


def _linked_by_mpi4py():
    """The MPI library mpi4py built from source links, or None.

    A source build of mpi4py (``--no-binary mpi4py``, the way to a site's MPI)
    links its MPI by name (``libmpich.so.12``); opening ``libmpi.so`` instead finds
    whatever MPI the system's default is (Debian's with both installed: Open MPI's).
    Opening mpi4py's module with ``ctypes`` loads what it links, as its import will,
    and runs none of it. The PyPI wheel links no MPI (it chooses one when
    imported): None, and the caller asks mpi4py's own loader.
    """
    try:
        spec = importlib.util.find_spec("mpi4py.MPI")
        module = ctypes.CDLL(spec.origin, os.RTLD_LOCAL)
    except Exception:  # no mpi4py, or a module that does not open on its own
        return None
    # dlsym on the module's handle: the module and the libraries it links only.
    return module if hasattr(module, "MPI_Get_library_version") else None


def _library_version(lib) -> str | None:
    """``MPI_Get_library_version`` of an opened MPI library, or None."""
    get = getattr(lib, "MPI_Get_library_version", None)
    if get is None:  # not an MPI
        return None
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    buffer = ctypes.create_string_buffer(8192)  # MPICH's maximum, the largest
    length = ctypes.c_int(0)
    if get(buffer, ctypes.byref(length)) != 0:
        return None
    return buffer.value.decode(errors="replace")


def _first_line(text: str) -> str:
    """The first line of a library version, spaces folded (MPICH's has tabs)."""
    lines = text.strip().splitlines() or ["(empty)"]
    return " ".join(lines[0].split())


def mismatch(ours: str, header: str, theirs: str, path) -> str | None:
    """Return why the extension at ``path`` cannot run beside mpi4py, or None.

    Args:
        ours: ``MPI_Get_library_version`` as the extension calls it.
        header: the MPI whose headers the extension was compiled against.
        theirs: ``MPI.Get_library_version()`` as mpi4py calls it.
        path: the extension's file, for the message.
    """
    if ours == theirs and _mpi.family(header) in (None, _mpi.family(theirs)):
        return None
    return (
        f"mpi4jax_dist's extension {path} was built against {header} and calls "
        f"'{_first_line(ours)}', but mpi4py uses '{_first_line(theirs)}'. Rebuild "
        f"mpi4jax_dist with this MPI's mpicc first on PATH: "
        f"MPICC=<that MPI's mpicc> pip install --no-build-isolation "
        f"--force-reinstall --no-deps --no-cache-dir <path to mpi4jax_dist>."
    )


@functools.cache
def load():
    """Import the extension matching mpi4py's MPI and register its handler.

    Returns:
        The extension module (``allreduce_handler``, ``token_after_handler``,
        ``library_version``, ``stats``, ``reset_stats``, ``HEADER_MPI``,
        ``MPI_STANDARD``, ``LARGE_COUNT``; and for the non-blocking allreduce
        ``iallreduce_handlers``, ``pending_requests``, ``complete_pending``).

    Raises:
        ImportError: no build, or one for another MPI than mpi4py's, or one
            that calls another MPI library than mpi4py does; the message names
            both.
    """
    return _load("cpu", "cpu", built())


@functools.cache
def load_cuda():
    """Import the CUDA extension matching mpi4py's MPI, check that it can run here,
    set its staging buffer's size, and register its handlers for the CUDA
    platform; free its pinned staging buffers at exit.

    Returns:
        The extension module: what :func:`load`'s has, and ``mpi_cuda_support``,
        ``driver_version``, ``set_staging_bytes``, ``staging_bytes``,
        ``release_pinned`` and ``CUDART_VERSION``; its ``stats`` also count
        CUDA-aware and staged calls, staged pieces and pinned host bytes.

    Raises:
        ImportError: mpi4jax_dist was installed without its CUDA handler (no CUDA
            toolkit where it was built), or for another MPI than mpi4py's, or
            against a CUDA that this node's driver cannot run or that JAX's CUDA
            plugin does not use (:func:`cuda_mismatch`).
        ValueError: ``MPI4JAX_DIST_STAGING_BYTES`` is not a size.
    """
    import atexit

    builds = built("cuda")
    if not builds:
        raise ImportError(
            f"mpi4jax_dist has no CUDA handler: no _cuda module in {_HERE}, so "
            f"no CUDA toolkit was found when it was installed (setup.py looks at "
            f"$CUDA_HOME, nvcc on PATH, /usr/local/cuda, and the nvidia-cuda-runtime "
            f"wheel of JAX's CUDA plugin). Reinstall where CUDA's headers are, for "
            f"example CUDA_HOME=/usr/local/cuda MPI4JAX_DIST_BUILD_CUDA=1 pip "
            f"install --no-build-isolation --force-reinstall --no-deps <path to "
            f"mpi4jax_dist>, or run on the CPU (JAX_PLATFORMS=cpu)."
        )

    def prepare(module, path):
        problem = cuda_mismatch(
            module.CUDART_VERSION, module.driver_version(), cuda_plugin_majors(), path
        )
        if problem:
            raise ImportError(problem)
        module.set_staging_bytes(_config.staging_bytes())

    module = _load("cuda", "CUDA", builds, prepare)
    atexit.register(module.release_pinned)
    return module


# JAX's CUDA plugins, one per CUDA major: jax_cuda12_plugin, jax_cuda13_plugin.
_CUDA_PLUGIN = re.compile(r"jax_cuda(\d+)_plugin")


def cuda_plugin_majors() -> list[int]:
    """Return the CUDA majors of the JAX CUDA plugins installed (``[12]`` for
    ``jax_cuda12_plugin``), found on ``sys.path`` without importing them."""
    found = set()
    for info in pkgutil.iter_modules():
        match = _CUDA_PLUGIN.fullmatch(info.name)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


def _cuda_text(version: int) -> str:
    """``13000`` (CUDART_VERSION, cudaDriverGetVersion) as ``"13.0"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def cuda_mismatch(
    runtime: int, driver: int, plugins: Sequence[int], path
) -> str | None:
    """Return why the CUDA extension at ``path`` cannot run here, or None.

    The extension carries its own CUDA runtime (linked statically, or the
    ``libcudart.so`` of its major). It runs on a driver of that major or newer
    (CUDA's minor version compatibility: the handler has no kernels), beside the
    runtime that JAX's CUDA plugin loads only if both are of one major.

    Args:
        runtime: ``CUDART_VERSION`` the extension was compiled against (13000
            for CUDA 13.0).
        driver: ``cudaDriverGetVersion()`` here: the newest CUDA the driver runs
            (12080 for 12.8), or 0 where no driver is installed (nothing can run
            on a GPU then, and the lowering can still be compiled and checked).
        plugins: the CUDA majors of the JAX CUDA plugins installed
            (:func:`cuda_plugin_majors`); empty where there is none.
        path: the extension's file, for the message.
    """
    major = runtime // 1000
    rebuild = (
        "Rebuild mpi4jax_dist in this environment, and setup.py builds against "
        "the CUDA major of JAX's CUDA plugin (from the plugin's "
        "nvidia-cuda-runtime wheel, or a toolkit of that major in CUDA_HOME): "
        "pip install --no-build-isolation --force-reinstall --no-deps <path to "
        "mpi4jax_dist>"
    )
    if plugins and major not in plugins:
        names = ", ".join(f"jax_cuda{m}_plugin" for m in plugins)
        wanted = " or ".join(str(m) for m in plugins)
        return (
            f"mpi4jax_dist's CUDA extension {path} was built against CUDA "
            f"{_cuda_text(runtime)}, but JAX's CUDA plugin here is for CUDA "
            f"{wanted} ({names}): two CUDA runtimes of different majors would "
            f"share JAX's buffers and streams, on a driver chosen for JAX's. "
            f"{rebuild}."
        )
    if driver and driver // 1000 < major:
        return (
            f"mpi4jax_dist's CUDA extension {path} was built against CUDA "
            f"{_cuda_text(runtime)}, but this node's NVIDIA driver runs CUDA "
            f"{_cuda_text(driver)} at most (cudaDriverGetVersion), so every call "
            f"would fail with cudaErrorInsufficientDriver. {rebuild}, with a JAX "
            f"CUDA plugin (or CUDA_HOME) for CUDA {driver // 1000}; or update the "
            f"driver to one for CUDA {major}."
        )
    return None


def loaded_extensions() -> list:
    """The extension modules loaded so far (the CPU one, the CUDA one), without
    loading any."""
    loaded = []
    for loader in (load, load_cuda):
        if loader.cache_info().currsize:  # a load that raised is not cached
            loaded.append(loader())
    return loaded


@functools.cache
def load_stacks():
    """Import ``_stacks`` (the thread that writes a rank's stacks without Python's
    GIL, ``stacks.c``) if it was built for mpi4py's MPI and calls its library; it
    registers nothing with JAX.

    Raises:
        ImportError: as :func:`load` does.
    """
    return _import("stacks", built("stacks"))[0]


def _import(kind: str, builds: dict[str, Path]):
    """Import ``_{kind}`` if it was built for mpi4py's MPI and check that it calls
    mpi4py's library; return the module and its file."""
    from mpi4py import MPI

    theirs = MPI.Get_library_version()
    wanted = _mpi.family(theirs)
    if wanted is None and len(builds) == 1:
        # An MPI we cannot name: try the build; the check below still holds.
        wanted = next(iter(builds))
    if wanted not in builds:
        have = ", ".join(f"{k} ({v.name})" for k, v in sorted(builds.items()))
        raise ImportError(
            f"mpi4py uses '{_first_line(theirs)}' ({wanted or 'an unknown MPI'}), "
            f"but mpi4jax_dist's {kind.upper()} extension was built only against "
            f"{have or 'no MPI at all'} in {_HERE}. Rebuild mpi4jax_dist with "
            f"this MPI's mpicc first on PATH: pip install --no-build-isolation "
            f"--force-reinstall --no-deps <path to mpi4jax_dist>."
        )
    module = importlib.import_module(f"._{kind}", __name__)
    problem = mismatch(
        module.library_version(), module.HEADER_MPI, theirs, builds[wanted]
    )
    if problem:
        raise ImportError(problem)
    return module, builds[wanted]


def _load(kind: str, platform: str, builds: dict[str, Path], prepare=None):
    """Import ``_{kind}`` (:func:`_import`), call ``prepare(module, path)`` (which
    may raise), and then register its handlers with JAX for ``platform``."""
    import jax

    module, path = _import(kind, builds)
    if prepare is not None:
        prepare(module, path)
    jax.ffi.register_ffi_target(
        ALLREDUCE_TARGET, module.allreduce_handler(), platform=platform
    )
    jax.ffi.register_ffi_target(
        TOKEN_AFTER_TARGET, module.token_after_handler(), platform=platform
    )
    # The non-blocking allreduce's handlers, where the module has them (the CPU
    # module).
    if hasattr(module, "iallreduce_handlers"):
        for target, handler in zip(
            IALLREDUCE_TARGETS, module.iallreduce_handlers(), strict=True
        ):
            jax.ffi.register_ffi_target(target, handler, platform=platform)
    return module
