#!/bin/bash
# Slurm: one task per GPU, started by srun.
#
#   sbatch examples/slurm.sh                        # runs examples/hello.py
#   sbatch examples/slurm.sh python my_script.py
#
# Submit from the repository's root (or put your own program's path below). The
# program needs one line before jax.distributed.initialize(), as hello.py has:
#
#     import mpi4jax_dist  # registers the MPI cluster env with JAX; starts nothing
#
# <...> marks what you must fill in for your site.
#SBATCH --job-name=mpi4jax_dist
#SBATCH --account=<project>
#SBATCH --partition=<partition>
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=00:10:00
set -euo pipefail

# Your environment: modules, then the venv with jax, mpi4py and mpi4jax_dist.
# module load <modules>
# source <venv>/bin/activate

# One task per GPU: --ntasks-per-node above is the GPUs per node.
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-4}
NNODES=${SLURM_NNODES:?not in a Slurm job: submit with sbatch}
NTASKS=$((NNODES * TASKS_PER_NODE))
export GPUS_PER_NODE=$TASKS_PER_NODE  # read by set_affinity_gpu.sh

# srun and its flags. --mpi= must match the MPI that mpi4py uses: pmix for Open MPI
# 5 and PMIx builds of MPICH, pmi2 for MPICH/Cray MPICH/Intel MPI built with PMI-2
# (srun --mpi=list shows your site's). tests/jobs/test_job_scripts.py sets these two to
# the local MPICH mpiexec and its pretend nodes, to run this script as it is.
SRUN=${SRUN:-srun}
SRUN_FLAGS=${SRUN_FLAGS:---mpi=pmix --cpu-bind=cores}

PROGRAM=("$@")
if [ $# -eq 0 ]; then
    PROGRAM=(python examples/hello.py)
fi
echo "$NNODES nodes, $TASKS_PER_NODE tasks per node, $NTASKS tasks: ${PROGRAM[*]}"

# Diagnostics first, as the program will run: launcher, ranks per node, coordinator,
# then JAX's devices and one allreduce. Exit status 1 when anything looks wrong.
# set_affinity_gpu.sh gives each task the GPU of its local rank (or let Slurm bind
# them: --gpus-per-task=1 in SRUN_FLAGS and no wrapper).
# shellcheck disable=SC2086  # the flags are several words
if ! $SRUN -n "$NTASKS" $SRUN_FLAGS \
    examples/set_affinity_gpu.sh python -m mpi4jax_dist --check; then
    echo "slurm.sh: the diagnostics failed (above); not starting the program" >&2
    exit 1
fi

# shellcheck disable=SC2086
$SRUN -n "$NTASKS" $SRUN_FLAGS examples/set_affinity_gpu.sh "${PROGRAM[@]}"
