#!/bin/bash
# One GPU per rank: run as   mpiexec ... examples/set_affinity_gpu.sh python prog.py
#
# Each rank sees only the GPU of its local rank (its index among the ranks on its
# node), as PBS/PALS sites (Polaris's set_affinity_gpu_polaris.sh) and many Slurm
# sites do. mpi4jax_dist's device rule then gives each JAX process local_device_ids
# [0]: its one visible GPU. The local rank comes from the launcher that started
# this rank: PALS, MPICH/Intel MPI Hydra, Open MPI, then srun. SLURM_LOCALID is
# asked last, since an mpiexec inside a Slurm allocation inherits the batch step's.
# (On Intel GPUs, Aurora: export ZE_AFFINITY_MASK instead.)
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
local_rank=${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-}}}}
if [ -z "$local_rank" ]; then
    echo "set_affinity_gpu.sh: no local rank (PALS_LOCAL_RANKID, MPI_LOCALRANKID," \
        "OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID): run me under a launcher" >&2
    exit 1
fi
export CUDA_VISIBLE_DEVICES=$((local_rank % GPUS_PER_NODE))
exec "$@"
