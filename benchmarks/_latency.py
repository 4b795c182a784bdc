"""A large machine's reduction latency for the benchmarks: the PMPI interposer
``pmpi_latency.c``, built with the MPI's compiler wrapper; :func:`preload`, called
before MPI starts, runs the process again (``exec``, under the same launcher) with
it in ``LD_PRELOAD``; :func:`set_us` sets the delay between measurements. The
package itself knows nothing of it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "pmpi_latency.c"
# In the environment of a process that was preloaded: the library's path.
MARK = "MPI4JAX_DIST_BENCH_PMPI_LATENCY"


def _mpicc() -> str:
    """The MPI compiler wrapper of this environment's MPI: ``$MPICC``, the one
    beside this Python, or ``mpicc`` on ``PATH``."""
    named = os.environ.get("MPICC")
    beside = Path(sys.executable).parent / "mpicc"
    found = named or (str(beside) if beside.exists() else shutil.which("mpicc"))
    if not found:
        raise RuntimeError(
            "the latency interposer is built with the MPI's compiler wrapper, and "
            "no mpicc was found (set MPICC to it)"
        )
    return found


def build() -> Path:
    """Compile the interposer (once per source and compiler wrapper) and return
    its path."""
    mpicc = _mpicc()
    key = hashlib.sha256(SOURCE.read_bytes() + mpicc.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"mpi4jax_dist-pmpi-{key}"
    library = folder / "libpmpi_latency.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Ranks of one job build at once: each into a file of its own, then renamed.
    partial = folder / f".libpmpi_latency.{os.getpid()}.so"
    subprocess.run(
        [mpicc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE)],
        check=True,
        timeout=120,
    )
    partial.replace(library)
    return library


def preloaded() -> bool:
    """Whether the interposer is loaded in this process."""
    return hasattr(ctypes.CDLL(None), "pmpi_latency_set_us")


def preload() -> None:
    """Run this process again with the interposer preloaded, unless it is.

    Call before MPI is initialized (before ``from mpi4py import MPI``).
    """
    if preloaded():
        return
    if os.environ.get(MARK):
        raise RuntimeError(
            f"{os.environ[MARK]} was preloaded but its symbols are not in the "
            f"process: another LD_PRELOAD or a static MPI?"
        )
    library = str(build())
    env = dict(os.environ)
    env[MARK] = library
    env["LD_PRELOAD"] = ":".join(filter(None, [library, env.get("LD_PRELOAD")]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def set_us(us: float) -> None:
    """Hold every reduction posted from now on ``us`` µs after its post;
    ``RuntimeError`` where the interposer is not loaded."""
    if not preloaded():
        raise RuntimeError(
            "a reduction latency needs the PMPI interposer preloaded: run the "
            "benchmark as a script under mpiexec (it preloads it itself)"
        )
    function = ctypes.CDLL(None).pmpi_latency_set_us
    function.argtypes = [ctypes.c_double]
    function.restype = None
    function(float(us))
