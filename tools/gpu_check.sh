#!/usr/bin/env bash
# The CUDA allreduce on a real GPU, in one command: build, the GPU tests, one table.
#
# The CUDA path (mpi4jax_dist/_ffi/cuda.cc) has not yet run on a GPU; this is the
# check to run the first time one is at hand. Two steps:
#
#   bash tools/gpu_check.sh --fetch     # here, once: the wheels into .whl/ (PyPI)
#   bash tools/gpu_check.sh             # there, as one call of the device tool:
#       run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=570)
#
# Where it runs: one NVIDIA GPU (made for the H200 machine: 16 cores, no network,
# commands as root, python3 with jax and its CUDA 13 plugin (Python 3.12.3, jax
# 0.11.2 as last read there, 2026-11), mpi4py, numpy, pytest, pytest-timeout,
# cython and nanobind (mpi4jax's build needs both), setuptools, a C++ compiler,
# and CUDA 13 with nvcc in /usr/local/cuda). PYTHON= names another interpreter.
# What it needs beyond that, carried in .whl/ (about 14 MB): the mpich wheel
# (mpicc, mpiexec, libmpi: the image has no MPI), pytest-mpi, and mpi4jax's sdist
# (built there against that MPI and CUDA); none of them is bound to a Python
# version. JAX is the machine's own, whichever it is: step 1 prints it beside the
# newest that pip served --fetch (.whl/NEWEST_JAX). The newest JAX's CUDA wheels
# can come too, where a machine takes them (--fetch --with-jax, for Python
# DEVICE_PYTHON, default 3.12: jax, jaxlib, jax-cuda13-plugin and -pjrt, about 230
# MB, more than the device tool's 64 MiB carry); step 2 installs what .whl/jax/
# holds over the machine's JAX.
#
# What it does, each step timed, stopping at the first that fails:
#   1. the machine: GPU and driver, python, jax and its CUDA plugin, nvcc;
#   2. installs the wheels into python3's environment, builds mpi4jax (with its
#      CUDA part) and this package in place (pip install -e, with
#      MPI4JAX_DIST_BUILD_CUDA=1: no CUDA module is a failure); then loads the
#      CUDA module once (_ffi.load_cuda: the driver and plugin checks) and prints
#      its CUDA runtime, the driver's, and what MPI says of device memory;
#   3. 2 ranks sharing the GPU, staged through host memory
#      (MPI4JAX_DIST_CUDA_AWARE_MPI=0 where a case does not set it): first the GPU
#      tests, tests/gpu/test_inplace_allreduce_gpu.py under mpiexec -n 2 (every
#      dtype and op against mpi4py, 1 MiB staging in pieces with chunking on and
#      off, donation in place, order with mpi4jax, 2**31 + 16 int8), then the table,
#      python3 benchmarks/memory.py --gpu --sizes 256MiB --impls
#      mpi4jax_dist,mpi4jax_dist_tmp,mpi4jax, and again at --sizes 2147483664
#      --dtype int8: one fresh job per (implementation, size), 256 MiB float32 and
#      2**31 + 16 int8. The table runs after failed tests too, and the step then
#      fails.
# Everything printed also goes to $OUT/gpu_check.log, and the table's rows to
# $OUT/gpu_memory.json and $OUT/gpu_memory-int8.json, where the device tool gives
# an $OUT. About 3 to 5 minutes once the machine is up.
#
# Expected output, at the end:
#   N passed, M skipped in ...        (pytest's summary, from each rank; a skip:
#                                      the CUDA-aware test, where the MPI does not
#                                      say it reads device memory)
#   # peak memory of one allreduce (call), 2 ranks, float32, one fresh mpiexec ...
#   # columns: bytes (per rank), impl, rise (x msg, and MiB: peak_bytes_in_use
#   #   above bytes_in_use before the call), xla_temp, in_place, t_call (ms),
#   #   measure, compiles, check, mode, bound, pinned (host MiB), pieces
#   one row per (size, impl), then the same for int8. Pass, for every row of
#   mpi4jax_dist* (the script's verdict):
#   - check "ok" (the sums right on both ranks);
#   - mpi4jax_dist (staged, donated): rise 0.00 x msg (below 0.5), in_place yes,
#     pinned 64.0 host MiB (one staging buffer, whatever the message), pieces 8
#     at 256 MiB and 65 at 2**31 + 16 int8 (32 MiB halves), compiles 0;
#   - mpi4jax_dist_tmp (an intermediate in jit): rise about 1.00 (the result's
#     buffer);
#   - mpi4jax: reported, not judged (a rise of 1 or more; above 2**31 it is
#     expected to crash or be wrong: that is the point).
#   and last "gpu_check: PASS" (exit 0), or "gpu_check: FAIL at <step>" (exit 1).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
python=${PYTHON:-python3}
wheels=$here/.whl
# The versions .venv runs (tools/setup.sh): MPICH's wheel, the pytest-mpi that
# setup.cfg's test extra brings, and the mpi4jax release CI runs.
MPICH=mpich==5.0.2
PYTEST_MPI=pytest-mpi==0.6
MPI4JAX=mpi4jax==0.9.1.post2

if [ "${1:-}" = --fetch ]; then
    mkdir -p "$wheels"
    # The newest JAX that pip serves a Python >= 3.12, for step 1 to compare with.
    device_python=${DEVICE_PYTHON:-3.12}
    newest=$("$python" -m pip download --no-deps --only-binary=:all: \
        --python-version "$device_python" --implementation cp \
        --platform manylinux_2_27_x86_64 -d "$(mktemp -d)" jax 2>/dev/null \
        | sed -n 's/.*jax-\([0-9.]*\)-py3.*/\1/p' | head -n 1)
    echo "${newest:-unknown}" >"$wheels/NEWEST_JAX"
    echo "gpu_check: the newest JAX for Python $device_python: ${newest:-unknown}"
    if [ "${2:-}" = --with-jax ] && [ -n "$newest" ]; then
        mkdir -p "$wheels/jax"
        "$python" -m pip download --no-deps --only-binary=:all: \
            --python-version "$device_python" --implementation cp \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            -d "$wheels/jax" "jax==$newest" "jaxlib==$newest" \
            "jax-cuda13-plugin==$newest" "jax-cuda13-pjrt==$newest" || exit 1
    fi
    # The device's python3 is 3.12 on x86-64; the mpich wheel is for any Python.
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$wheels" "$MPICH" "$PYTEST_MPI" || exit 1
    # An sdist: pip prepares its metadata, which needs mpi4py and an mpicc here
    # (.venv has both), without build isolation (no jaxlib downloaded for it).
    venv=${VENV:-$here/.venv}
    PATH="$venv/bin:$PATH" "$venv/bin/python" -m pip download --no-deps \
        --no-binary=:all: --no-build-isolation -d "$wheels" "$MPI4JAX" || exit 1
    ls -l "$wheels"
    exit 0
fi

export PYTHONUNBUFFERED=1 MPI4JAX_NO_WARN_JAX_VERSION=1

step_name=
step() {
    step_name=$1
    echo "== gpu_check: $step_name ($(date -u +%H:%M:%S), ${SECONDS} s in)"
}
fail() {
    echo "gpu_check: FAIL at $step_name${1:+: $1}"
    exit 1
}

# The steps, run in a pipeline into tee so that the log is complete when the
# script ends (fail's exit ends the pipeline's subshell). Not indented: the
# Python here-documents in it must start at column 0.
check() {
step "the machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    || fail "no nvidia-smi"
"$python" - <<'EOF' || fail "python3 without jax"
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.prefix)
for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "mpi4py",
             "numpy", "pytest", "pytest-timeout", "cython", "nanobind", "setuptools",
             "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} -")
EOF
echo "  the newest JAX when .whl was fetched: $(cat "$wheels/NEWEST_JAX" 2>/dev/null \
    || echo unknown)$([ -d "$wheels/jax" ] && echo ', carried in .whl/jax: installed next')"
nvcc --version | tail -1 || echo "no nvcc on PATH"
ls /usr/local | grep -i cuda || true
[ -d "$wheels" ] \
    || fail "no .whl/: run bash tools/gpu_check.sh --fetch here, and carry .whl"

step "installing MPICH and pytest-mpi, building mpi4jax and mpi4jax_dist"
prefix=$("$python" -c 'import sys; print(sys.prefix)')
if [ -d "$wheels/jax" ]; then
    "$python" -m pip install -q --no-index --no-deps --upgrade \
        --disable-pip-version-check "$wheels"/jax/*.whl || fail "pip install of .whl/jax"
    "$python" -c 'import jax; print("jax", jax.__version__, "from .whl/jax")' \
        || fail "the carried JAX does not import"
fi
"$python" -m pip install -q --no-index --no-deps --disable-pip-version-check \
    "$wheels"/mpich-*.whl "$wheels"/pytest_mpi-*.whl || fail "pip install of the wheels"
export PATH="$prefix/bin:$PATH"
command -v mpicc mpiexec || fail "no mpicc/mpiexec after installing the mpich wheel"
"$python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().split("\n")[0])' \
    || fail "mpi4py does not load the MPICH just installed"
cuda_root=/usr/local/cuda
MPI4JAX_BUILD_MPICC=$(command -v mpicc) CUDA_ROOT=$cuda_root timeout 300 \
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation \
    --disable-pip-version-check "$wheels"/mpi4jax-*.tar.gz || fail "building mpi4jax"
MPI4JAX_DIST_BUILD_CUDA=1 timeout 300 "$python" -m pip install -q --no-index \
    --no-deps --no-build-isolation --disable-pip-version-check -e . \
    || fail "building mpi4jax_dist with its CUDA module"
ls mpi4jax_dist/_ffi/*.so

step "the CUDA module, and JAX's GPU"
JAX_PLATFORMS=cuda timeout 120 "$python" - <<'EOF' || fail
import jax
from mpi4py import MPI
from mpi4jax_dist import _ffi

# The driver and plugin checks: an ImportError naming both versions.
module = _ffi.load_cuda()
print("CUDA module", module.__name__, "runtime", module.CUDART_VERSION,
      "driver", module.driver_version(), "plugins", _ffi.cuda_plugin_majors(),
      "staging", module.staging_bytes(), "MPI reads device memory:",
      module.mpi_cuda_support())
print("devices", jax.devices())
assert any(d.platform == "gpu" for d in jax.devices()), "JAX sees no GPU"
EOF

step "the GPU tests and the table (2 ranks sharing the GPU, staged)"
# 480 s in all: the tests at most 360 of them, the table the rest.
start=$SECONDS
aware=${MPI4JAX_DIST_CUDA_AWARE_MPI:-0}
tests=tests/gpu/test_inplace_allreduce_gpu.py
JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} \
    XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false} \
    MPI4JAX_DIST_CUDA_AWARE_MPI=$aware timeout 360 \
    mpiexec -n 2 "$python" -m pytest --with-mpi -q -rs -p no:cacheprovider "$tests"
tests_status=$?
json=() json8=()
[ -n "${OUT:-}" ] && json=(--json "$OUT/gpu_memory.json") \
    && json8=(--json "$OUT/gpu_memory-int8.json")
table() {  # in what is left of the step's 480 s
    local left=$((480 - (SECONDS - start)))
    MPI4JAX_DIST_CUDA_AWARE_MPI=$aware timeout $((left > 1 ? left : 1)) \
        "$python" benchmarks/memory.py --gpu --timeout 120 \
        --impls mpi4jax_dist,mpi4jax_dist_tmp,mpi4jax "$@"
}
table --sizes 256MiB "${json[@]}" || fail "benchmarks/memory.py --gpu (exit $?)"
table --sizes 2147483664 --dtype int8 "${json8[@]}" \
    || fail "benchmarks/memory.py --gpu --dtype int8 (exit $?)"
[ "$tests_status" = 0 ] || fail "$tests (exit $tests_status)"
echo "gpu_check: PASS (${SECONDS} s)"
}

log=/dev/null
[ -n "${OUT:-}" ] && log=$OUT/gpu_check.log
check 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
