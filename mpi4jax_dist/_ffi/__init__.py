"""The compiled XLA FFI handlers, built by ``pip install`` once per MPI family.

``setup.py`` compiles ``cpu.cc`` against the MPI found first (the virtual
environment's own ``mpicc``, else mpi4py's, else the one on ``PATH``) into
``_cpu_mpich``, ``_cpu_openmpi`` or ``_cpu_impi``: one source tree can serve
virtual environments with MPICH, Open MPI and Intel MPI (editable installs build
in place). :func:`load` picks the build that matches the MPI mpi4py has loaded,
checks that both call the same library, and registers the handler with JAX.
Where ``setup.py`` found CUDA it also built ``cuda.cc`` into ``_cuda_mpich`` or
``_cuda_openmpi``, which :func:`load_cuda` registers for the CUDA platform under
the same target names. Nothing here runs at import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
from pathlib import Path

# The names XLA knows the handlers by, on every platform.
ALLREDUCE_TARGET = "mpi4jax_dist_allreduce"
TOKEN_AFTER_TARGET = "mpi4jax_dist_token_after"

_HERE = Path(__file__).resolve().parent


def family(library_version: str) -> str | None:
    """Return the ABI family of an ``MPI_Get_library_version`` string.

    ``openmpi``, ``impi`` (Intel MPI: MPICH's ABI, but its own library, built
    apart), ``mpich`` (MPICH and the derivatives that share its ABI: MVAPICH, Cray
    MPICH), or None for an MPI we do not know.
    """
    text = library_version.lower()
    if "open mpi" in text:
        return "openmpi"
    if "intel(r) mpi" in text:
        return "impi"
    if any(name in text for name in ("mpich", "mvapich")):
        return "mpich"
    return None


def built(kind: str = "cpu") -> dict[str, Path]:
    """Return the extension builds present, ``{family: path}``.

    Args:
        kind: ``"cpu"`` or ``"cuda"``, the platform of the handlers.
    """
    found = {}
    prefix = f"_{kind}_"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in _HERE.glob(f"{prefix}*{suffix}"):
            # "_cpu_mpich.cpython-311-x86_64-linux-gnu.so" also ends in ".so":
            # the family is the name up to the first dot, whichever suffix matched.
            family = path.name[len(prefix) :].split(".")[0]
            found.setdefault(family, path)
    return found


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
    if ours == theirs and family(header) in (None, family(theirs)):
        return None
    return (
        f"mpi4jax_dist's extension {path} was built against {header} and calls "
        f"'{_first_line(ours)}', but mpi4py uses '{_first_line(theirs)}'. Rebuild "
        f"mpi4jax_dist with this MPI's mpicc first on PATH: "
        f"pip install --no-build-isolation --force-reinstall --no-deps <path to "
        f"mpi4jax_dist> (tools/setup.sh does this)."
    )


@functools.cache
def load():
    """Import the extension matching mpi4py's MPI and register its handler.

    Returns:
        The extension module (``allreduce_handler``, ``token_after_handler``,
        ``library_version``, ``stats``, ``reset_stats``, ``HEADER_MPI``,
        ``MPI_STANDARD``, ``LARGE_COUNT``).

    Raises:
        ImportError: no build for mpi4py's MPI, or a build that calls another
            MPI library than mpi4py does; the message names both.
    """
    return _load("cpu", "cpu", built())


@functools.cache
def load_cuda():
    """Import the CUDA extension matching mpi4py's MPI and register its handlers
    for the CUDA platform; free its pinned staging buffers at exit.

    Returns:
        The extension module: what :func:`load`'s has, and ``mpi_cuda_support``,
        ``release_pinned`` and ``CUDART_VERSION``; its ``stats`` also count
        CUDA-aware and staged calls, staged chunks and pinned host bytes.

    Raises:
        ImportError: mpi4jax_dist was installed without its CUDA handler (no CUDA
            toolkit where it was built), or for another MPI than mpi4py's.
    """
    import atexit

    builds = built("cuda")
    if not builds:
        raise ImportError(
            f"mpi4jax_dist has no CUDA handler: no _cuda_* module in {_HERE}, so "
            f"no CUDA toolkit was found when it was installed (setup.py looks at "
            f"$CUDA_HOME, nvcc on PATH, /usr/local/cuda). Reinstall where CUDA's "
            f"headers are, for example CUDA_HOME=/usr/local/cuda "
            f"MPI4JAX_DIST_BUILD_CUDA=1 pip install --no-build-isolation "
            f"--force-reinstall --no-deps <path to mpi4jax_dist>, or run on the "
            f"CPU (JAX_PLATFORMS=cpu)."
        )
    module = _load("cuda", "CUDA", builds)
    atexit.register(module.release_pinned)
    return module


def _load(kind: str, platform: str, builds: dict[str, Path]):
    """Import ``_{kind}_{family}`` for mpi4py's MPI, check that it calls mpi4py's
    library, and register its handlers with JAX for ``platform``."""
    import jax
    from mpi4py import MPI

    theirs = MPI.Get_library_version()
    wanted = family(theirs)
    if wanted is None and len(builds) == 1:
        # An MPI we cannot name: try the one build; the check below still holds.
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
    module = importlib.import_module(f"._{kind}_{wanted}", __name__)
    problem = mismatch(
        module.library_version(), module.HEADER_MPI, theirs, builds[wanted]
    )
    if problem:
        raise ImportError(problem)
    jax.ffi.register_ffi_target(
        ALLREDUCE_TARGET, module.allreduce_handler(), platform=platform
    )
    jax.ffi.register_ffi_target(
        TOKEN_AFTER_TARGET, module.token_after_handler(), platform=platform
    )
    return module
