"""Serial: the CUDA allreduce's device-side path on the CPU, over a fake CUDA
runtime (tests/cuda_fake/staging_module.cc), under ``mpiexec -n 2``.

No GPU here: the staging through pinned host memory (two halves taking turns,
events, the buffer allocated once), the device switch and its restoring, and the
report of a kernel that failed before the call, run against a runtime whose
"device" is host memory and whose stream is a thread that runs each copy after
a random delay. What it cannot show: the real runtime's and driver's behaviour,
and the speed (tools/gpu_check.sh runs on a GPU).

The module (with ``_ffi/cuda_staging.cc``) is compiled here with the compiler and
flags the build uses (conf/'s functions: the MPI's mpicc, the CUDA headers it
would build against), in about 6 s, and linked to the install's core (``_core``,
the host reductions and the counts), as ``_cuda`` is; the test skips where there
are no CUDA headers.
"""

from __future__ import annotations

import importlib.machinery
import os
import shlex
import subprocess
import sysconfig

import jax.ffi
import pytest
import util

from mpi4jax_dist import _ffi

pytestmark = util.skip_in_mpi_job

FAKE = util.HERE / "cuda_fake" / "staging_module.cc"
FFI = util.ROOT / "mpi4jax_dist" / "_ffi"


@pytest.fixture(scope="module")
def fake_module(tmp_path_factory) -> str:
    """Build ``_cuda_fake`` into a folder of its own; return the folder."""
    cudaconfig, mpiconfig = util.load_conf("cudaconfig"), util.load_conf("mpiconfig")
    # The headers only: the fake runtime stands in for the library.
    cuda, why = cudaconfig.find_cuda({k: v for k, v in os.environ.items()})
    if cuda is None:
        pytest.skip(f"no CUDA headers to compile cuda.cc against: {why}")
    cores = list(_ffi.built("core").values())
    if not cores:
        pytest.skip(f"no _core built in {_ffi._HERE} to link the fake module to")
    (core,) = cores
    flags = mpiconfig.mpicc_flags(mpiconfig.find_mpicc())
    compile_args, link_args = mpiconfig.split_flags(flags)
    out = tmp_path_factory.mktemp("cuda_fake")
    target = out / f"_cuda_fake{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    cmd = [
        *shlex.split(os.environ.get("CXX", "c++")),
        "-std=c++17",
        "-O1",
        "-shared",
        "-fPIC",
        "-pthread",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-DMPICH_SKIP_MPICXX=1",
        "-DOMPI_SKIP_MPICXX=1",
        f"-I{FFI}",
        "-isystem",
        jax.ffi.include_dir(),
        *[flag for d in cuda["include"] for flag in ("-isystem", d)],
        f"-I{sysconfig.get_paths()['include']}",
        *compile_args,
        str(FAKE),
        str(FFI / "cuda_staging.cc"),
        "-o",
        str(target),
        str(core),
        f"-Wl,-rpath,{core.parent}",
        *link_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return str(out)


def test_staged_allreduce_over_fake_cuda(fake_module):
    proc = util.run_mpi("cuda_fake_job.py", 2, fake_module, timeout=240)
    results = util.result_lines(proc, 2, "rank")
    problems = {r["rank"]: r["problems"] for r in results if r["problems"]}
    assert not problems, problems
