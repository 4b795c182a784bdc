"""Find the CUDA runtime to build the CUDA module (``_cuda``) against.

``cuda.cc`` is plain C++ over the CUDA runtime API (no kernels, no nvcc), compiled
by the host compiler and linked with the static runtime (``libcudart_static.a``),
or else with ``libcudart.so[.N]`` and an rpath. A runtime holds
``include/cuda_runtime_api.h``, ``crt/host_defines.h`` (which the nvidia wheels keep
in ``cuda_nvcc`` or ``nvidia-cuda-crt``) and the library in ``lib64`` or ``lib``.

Where JAX's CUDA plugin is installed (``jax_cuda12_plugin``, ...), only a runtime
of its major will do: JAX's and ours share the process and the driver. Looked at
in order: ``$CUDA_HOME`` (or ``$CUDA_PATH``; without a plugin, only that when
set); else the toolkit around ``nvcc`` on ``PATH``, ``/usr/local/cuda``, and,
with a plugin, ``/usr/local/cuda-<major>*`` and the plugin's
``nvidia-cuda-runtime`` wheel (``nvidia/cu13`` for CUDA 13, ``cuda_runtime``
before). ``MPI4JAX_DIST_BUILD_CUDA``: unset or ``auto``, build where a runtime is
found; ``0``, never; ``1``, fail the build when none is found. Stdlib only.
"""

from __future__ import annotations

import os
import pkgutil
import re
import shutil
import sys
from pathlib import Path

# The build's switch; read here, not in mpi4jax_dist/_config/, which holds the
# variables the installed package reads.
BUILD_CUDA = "MPI4JAX_DIST_BUILD_CUDA"

_CUDA_PLUGIN = re.compile(r"jax_cuda(\d+)_plugin")


def cuda_plugin_majors(paths: list[str] | None = None) -> list[int]:
    """Return the CUDA majors of the JAX CUDA plugins on ``paths`` (default
    ``sys.path``): ``[12]`` for ``jax_cuda12_plugin``. Nothing imported."""
    found = set()
    for info in pkgutil.iter_modules(paths):
        match = _CUDA_PLUGIN.fullmatch(info.name)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


def cuda_runtime_at(root: Path, more_includes=()) -> dict | None:
    """Return the CUDA runtime at ``root``, or None where it lacks headers or a
    library: ``{"root", "version" (CUDART_VERSION), "include": [dirs], "static"
    or "shared": library}``. ``more_includes`` may hold ``crt/host_defines.h``."""
    include = root / "include"
    try:
        header = (include / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    version = re.search(r"#\s*define\s+CUDART_VERSION\s+(\d+)", header)
    crt = [d for d in (include, *more_includes) if (d / "crt/host_defines.h").is_file()]
    if version is None or not crt:
        return None
    found = {"root": root, "version": int(version.group(1)), "include": [str(include)]}
    if crt[0] != include:
        found["include"].append(str(crt[0]))
    for libdir in (root / "lib64", root / "lib"):
        if (libdir / "libcudart_static.a").is_file():
            return {**found, "static": libdir / "libcudart_static.a"}
        # The shortest name: the nvidia wheels ship only libcudart.so.N.
        shared = sorted(libdir.glob("libcudart.so*"), key=lambda p: len(p.name))
        if shared:
            return {**found, "shared": shared[0]}
    return None


def _text(runtime: dict | None) -> str:
    """``"CUDA 13.0"`` for CUDART_VERSION 13000, or ``"no runtime"``."""
    if runtime is None:
        return "no runtime"
    return f"CUDA {runtime['version'] // 1000}.{runtime['version'] % 1000 // 10}"


def find_cuda(
    env=None, paths: list[str] | None = None, toolkits: list[Path] | None = None
) -> tuple[dict | None, str]:
    """Return the CUDA runtime to build against (:func:`cuda_runtime_at`'s dict)
    or None, and why, for the build's log.

    Args:
        env: the environment (default ``os.environ``).
        paths: where Python packages are (default ``sys.path``): the plugins and
            the nvidia wheels.
        toolkits: the toolkits to try after ``$CUDA_HOME`` (default: around
            ``nvcc`` on ``PATH``, ``/usr/local/cuda``, with a plugin
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
    roots = [(Path(explicit), ())] if explicit else []
    if not explicit or majors:
        if toolkits is None:
            nvcc = shutil.which("nvcc", path=env.get("PATH"))
            toolkits = [Path(nvcc).resolve().parent.parent] if nvcc else []
            toolkits.append(Path("/usr/local/cuda"))
            for major in majors:
                toolkits += sorted(Path("/usr/local").glob(f"cuda-{major}*"))
        roots += [(root, ()) for root in toolkits]
    for major in majors:
        name = f"cu{major}" if major >= 13 else "cuda_runtime"
        for entry in sys.path if paths is None else paths:
            root = Path(entry or ".") / "nvidia" / name
            if root.is_dir():
                # Before CUDA 13 the wheels keep crt/ apart (nvidia/cuda_nvcc).
                roots.append((root, sorted(root.parent.glob("*/include"))))
    seen = {}
    for root, crt in roots:
        if root in seen:
            continue
        runtime = seen[root] = cuda_runtime_at(root, crt)
        if runtime is None or (majors and runtime["version"] // 1000 not in majors):
            continue
        why = f"{_text(runtime)} in {root}"
        if majors:
            why += f" (JAX's CUDA plugin: CUDA {' and '.join(map(str, majors))})"
        if explicit and root != Path(explicit):
            why += f"; not CUDA_HOME/CUDA_PATH={explicit}: {_text(seen[roots[0][0]])}"
        return runtime, why
    looked = ", ".join(f"{root} ({_text(runtime)})" for root, runtime in seen.items())
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
