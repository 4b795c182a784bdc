#!/usr/bin/env bash
# A site's own MPI, installed as README.rst's "Installing on a cluster" says, with
# Debian's MPICH 4.0 or Open MPI 4.1 standing in for it (both installed, as on
# many clusters: Debian's plain mpicc, mpiexec and libmpi.so are then Open MPI's),
# then the package's runtime checked under that MPI's own mpiexec.
#
#   bash tools/site_mpi.sh mpich      # .venv-site-mpich: mpicc.mpich, mpiexec.mpich
#   bash tools/site_mpi.sh openmpi    # .venv-site-openmpi: ORTE's mpiexec.openmpi
#
# Installs Debian's libmpich-dev mpich libopenmpi-dev openmpi-bin first where they
# are missing (root only). Building mpi4py and mpi4jax from source takes about 6
# minutes on 2 cores, which is why CI does not run it (docs/developing.rst); a
# second run reuses the environment and only checks. Every MPI run has a time
# limit. Ends with one line per check and its seconds; exit status 1 if any failed.
set -euo pipefail

family=${1:-}
case "$family" in
    mpich|openmpi) ;;
    *) echo "usage: bash tools/site_mpi.sh mpich|openmpi" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$here/.venv-site-$family}
# shellcheck source=tools/find_python.sh
source "$here/tools/find_python.sh"

if ! command -v "mpicc.$family" >/dev/null || ! command -v "mpiexec.$family" >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "site_mpi.sh: no mpicc.$family: apt-get install libmpich-dev mpich" \
            "libopenmpi-dev openmpi-bin (as root)" >&2
        exit 2
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libmpich-dev mpich \
        libopenmpi-dev openmpi-bin >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
    python=$(find_python 3.12) || python=python3
    # README.rst's lines, with this family's wrapper named, as it says to where
    # two MPIs are installed.
    (
        set -x
        "$python" -m venv "$venv"
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
        MPICC=$(command -v "mpicc.$family")
        export MPICC
        # This machine's nvcc sits in /usr/local/bin, its headers in /usr/local/cuda
        # (README.rst: mpi4jax's build then needs CUDA_ROOT).
        if [ -z "${CUDA_ROOT:-}" ] && [ -d /usr/local/cuda/include ]; then
            export CUDA_ROOT=/usr/local/cuda
        fi
        pip install -q jax setuptools wheel nanobind
        pip install -q --no-binary=mpi4py --no-cache-dir mpi4py
        MPI4JAX_BUILD_MPICC=$MPICC pip install -q --no-build-isolation --no-cache-dir \
            mpi4jax
        # From a copy of the tree without its builds: what a fresh clone holds.
        copy=$(mktemp -d)
        tar -C "$here" --exclude='./.venv*' --exclude=./build --exclude='*.so' \
            --exclude=./.git --exclude='*.egg-info' -cf - . | tar -C "$copy" -xf -
        pip install -q --no-build-isolation --no-cache-dir "$copy[mpi4jax]"
        rm -rf "$copy"
        # What the checks below run with (not a user's step).
        pip install -q pytest pytest-mpi pytest-timeout scipy
    )
fi

# PYTHONSAFEPATH: the installed package, not the tree's (whose builds are for
# .venv's MPIs), also for python -m run from the tree.
export PATH="$venv/bin:$PATH" JAX_PLATFORMS=cpu PYTHONSAFEPATH=1
mpiexec=(timeout -k 10 300 "mpiexec.$family")
if [ "$family" = openmpi ]; then
    mpiexec+=(--oversubscribe)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
cd "$here"
results=()
status=0
check() {  # check NAME COMMAND...: run it, keep its line for the table
    local name=$1 start=$SECONDS
    shift
    echo "+ $*"
    if "$@"; then
        results+=("pass  $((SECONDS - start)) s  $name")
    else
        results+=("FAIL  $((SECONDS - start)) s  $name")
        status=1
    fi
}

python - <<'EOF'
import importlib.metadata as md, platform
from mpi4py import MPI
print(f"site_mpi.sh: Python {platform.python_version()}, jax {md.version('jax')}, "
      f"mpi4py {md.version('mpi4py')}, mpi4jax {md.version('mpi4jax')}, "
      f"{MPI.Get_library_version().splitlines()[0].strip()}")
EOF
check "--check at 2 ranks" "${mpiexec[@]}" -n 2 python -m mpi4jax_dist --check
check "--check --json at 4 ranks" "${mpiexec[@]}" -n 4 python -m mpi4jax_dist --check --json
# The MPI wrapper for JAX's CPU collectives must be built for the library mpi4py
# links, not for whatever libmpi.so is: env names it only then.
check "env names _mpiabi, built for $family" bash -c \
    "python -m mpi4jax_dist env | grep '/_mpiabi\.' >/dev/null && python -c 'import sys; \
from mpi4jax_dist import _ffi; sys.exit(list(_ffi.built(\"mpiabi\")) != [sys.argv[1]])' \
    $family"
check "psum over MPI (env)" bash -c "eval \"\$(python -m mpi4jax_dist env)\" && \
    ${mpiexec[*]} -n 2 python -m mpi4jax_dist --check"
# The launch, fail-fast, CPU-collective and thread-level tests under this mpiexec,
# then the in-place allreduce, iallreduce and the CG solvers with 2 ranks.
check "launch tests" env TEST_MPIEXEC="mpiexec.$family" timeout -k 10 900 python -m pytest \
    -q -p no:cacheprovider -m "not same_under_every_mpi" tests/jobs/test_launch.py \
    tests/jobs/test_bootstrap_faults.py tests/jobs/test_failfast.py tests/jobs/test_cpu_collectives.py \
    tests/jobs/test_thread_level.py
check "allreduce, iallreduce, cg (2 ranks)" "${mpiexec[@]}" -n 2 python -m pytest \
    --with-mpi -q -p no:cacheprovider tests/peers/test_inplace_allreduce.py \
    tests/peers/test_iallreduce.py tests/peers/test_cg_dropin.py
printf '%s\n' "site_mpi.sh: $family" "${results[@]}"
exit "$status"
