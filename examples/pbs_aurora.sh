#!/bin/bash
# PBS Pro + HPE Cray PALS on Intel GPUs (Aurora-style): one MPI rank per GPU tile,
# 12 a node (6 GPUs of 2 tiles).
#
#   qsub examples/pbs_aurora.sh                       # runs examples/hello.py
#   qsub -v PROGRAM="python my_script.py" examples/pbs_aurora.sh
#   bash examples/pbs_aurora.sh python my_script.py   # (in an interactive job)
#
# Submit from the repository's root (or put your own program's path below). The
# program needs one line before jax.distributed.initialize(), as hello.py has:
#
#     import mpi4jax_dist  # registers the MPI cluster env with JAX; starts nothing
#
# JAX on Intel GPUs is the jax-oneapi-plugin package (Python >= 3.12). Each rank
# sees one tile (ZE_AFFINITY_MASK, set by set_affinity_gpu.sh); mpi4jax_dist's
# device rule gives JAX local_device_ids [0] and sets jax_oneapi_visible_devices.
# The in-place mpi4jax_dist.allreduce has no Intel GPU lowering (it says so when
# traced): use mpi4jax (MPI4JAX_USE_SYCL_MPI=1 with a GPU-aware MPI) or psum there.
#
# <...> marks what you must fill in for your site.
#PBS -N mpi4jax_dist
#PBS -A <project>
#PBS -q <queue>
#PBS -l select=2
#PBS -l place=scatter
#PBS -l walltime=00:10:00
#PBS -l filesystems=home
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Your environment: modules, then the venv with jax, mpi4py and mpi4jax_dist.
# module load frameworks   # or: module load <modules>
# source <venv>/bin/activate

# Read by set_affinity_gpu.sh: one tile per rank.
export GPU_VENDOR=intel
export GPUS_PER_NODE=${GPUS_PER_NODE:-6}
export TILES_PER_GPU=${TILES_PER_GPU:-2}
export ZE_FLAT_DEVICE_HIERARCHY=${ZE_FLAT_DEVICE_HIERARCHY:-FLAT}  # a tile is a device
NNODES=$(sort -u "${PBS_NODEFILE:?not in a PBS job: submit with qsub}" | wc -l)
RANKS_PER_NODE=$((GPUS_PER_NODE * TILES_PER_GPU))
NTOTRANKS=$((NNODES * RANKS_PER_NODE))
# Eight cores for each of the 12 ranks, leaving out cores 0 and 52 (one per socket,
# for the operating system), as Aurora's documentation does.
CPU_BIND=${CPU_BIND:-list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100}

# The launcher and its PALS-only flags. tests/jobs/test_job_scripts.py sets these two to
# the local MPICH mpiexec and its pretend nodes, to run this script as it is.
MPIEXEC=${MPIEXEC:-mpiexec}
MPIEXEC_FLAGS=${MPIEXEC_FLAGS:---cpu-bind $CPU_BIND}

if [ $# -gt 0 ]; then
    PROGRAM=("$@")
else
    read -r -a PROGRAM <<<"${PROGRAM:-python examples/hello.py}"
fi
echo "$NNODES nodes, $RANKS_PER_NODE ranks per node, $NTOTRANKS ranks: ${PROGRAM[*]}"

# Diagnostics first, as the program will run: launcher, ranks per node, coordinator,
# each rank's devices, then JAX's devices and one allreduce. Exit status 1 when
# anything looks wrong.
# shellcheck disable=SC2086  # the flags are several words
if ! $MPIEXEC -n "$NTOTRANKS" --ppn "$RANKS_PER_NODE" $MPIEXEC_FLAGS \
    examples/set_affinity_gpu.sh python -m mpi4jax_dist --check; then
    echo "pbs_aurora.sh: the diagnostics failed (above); not starting the program" >&2
    exit 1
fi

# shellcheck disable=SC2086
$MPIEXEC -n "$NTOTRANKS" --ppn "$RANKS_PER_NODE" $MPIEXEC_FLAGS \
    examples/set_affinity_gpu.sh "${PROGRAM[@]}"
