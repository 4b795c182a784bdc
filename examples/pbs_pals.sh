#!/bin/bash
# PBS Pro + HPE Cray PALS (Polaris-style): one MPI rank per GPU.
#
#   qsub examples/pbs_pals.sh                       # runs examples/hello.py
#   qsub -v PROGRAM="python my_script.py" examples/pbs_pals.sh
#   bash examples/pbs_pals.sh python my_script.py   # (in an interactive job)
#
# Submit from the repository's root (or put your own program's path below). The
# program needs one line before jax.distributed.initialize(), as hello.py has:
#
#     import mpi4jax_dist  # registers the MPI cluster env with JAX; starts nothing
#
# <...> marks what you must fill in for your site.
#PBS -N mpi4jax_dist
#PBS -A <project>
#PBS -q <queue>
#PBS -l select=2:ncpus=64:ngpus=4
#PBS -l place=scatter
#PBS -l walltime=00:10:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Your environment: modules, then the venv with jax, mpi4py and mpi4jax_dist.
# module load <modules>
# source <venv>/bin/activate

GPUS_PER_NODE=${GPUS_PER_NODE:-4}  # ngpus above
export GPUS_PER_NODE                # read by set_affinity_gpu.sh
NNODES=$(sort -u "${PBS_NODEFILE:?not in a PBS job: submit with qsub}" | wc -l)
RANKS_PER_NODE=$GPUS_PER_NODE
NTOTRANKS=$((NNODES * RANKS_PER_NODE))
DEPTH=${DEPTH:-16}                  # CPU cores per rank: ncpus / RANKS_PER_NODE

# The launcher and its PALS-only flags. tests/jobs/test_job_scripts.py sets these two to
# the local MPICH mpiexec and its pretend nodes, to run this script as it is.
MPIEXEC=${MPIEXEC:-mpiexec}
MPIEXEC_FLAGS=${MPIEXEC_FLAGS:---depth=$DEPTH --cpu-bind depth}

if [ $# -gt 0 ]; then
    PROGRAM=("$@")
else
    read -r -a PROGRAM <<<"${PROGRAM:-python examples/hello.py}"
fi
echo "$NNODES nodes, $RANKS_PER_NODE ranks per node, $NTOTRANKS ranks: ${PROGRAM[*]}"

# Diagnostics first, as the program will run: launcher, ranks per node, coordinator,
# then JAX's devices and one allreduce. Exit status 1 when anything looks wrong.
# shellcheck disable=SC2086  # the flags are several words
if ! $MPIEXEC -n "$NTOTRANKS" --ppn "$RANKS_PER_NODE" $MPIEXEC_FLAGS \
    examples/set_affinity_gpu.sh python -m mpi4jax_dist --check; then
    echo "pbs_pals.sh: the diagnostics failed (above); not starting the program" >&2
    exit 1
fi

# shellcheck disable=SC2086
$MPIEXEC -n "$NTOTRANKS" --ppn "$RANKS_PER_NODE" $MPIEXEC_FLAGS \
    examples/set_affinity_gpu.sh "${PROGRAM[@]}"
