#!/bin/bash
# One GPU (or one tile) per rank: run as   mpiexec ... examples/set_affinity_gpu.sh python prog.py
#
# Each rank sees only the GPU of its local rank (its index among the ranks on its
# node), as PBS/PALS sites (Polaris's set_affinity_gpu_polaris.sh, Aurora's
# gpu_tile_compact.sh) and many Slurm sites do. mpi4jax_dist's device rule then
# gives each JAX process local_device_ids [0]: its one visible device.
#
#   GPU_VENDOR     nvidia (default): CUDA_VISIBLE_DEVICES=<gpu>
#                  amd: ROCR_VISIBLE_DEVICES=<gpu>
#                  intel: ZE_AFFINITY_MASK, one tile per rank (Aurora: 6 GPUs of 2
#                  tiles, 12 ranks a node). Under ZE_FLAT_DEVICE_HIERARCHY=FLAT (the
#                  default) each tile is a device of its own, numbered across the
#                  node: <gpu * TILES_PER_GPU + tile>; under COMPOSITE a tile is
#                  named <gpu>.<tile>.
#   GPUS_PER_NODE  GPUs on a node (default 4)
#   TILES_PER_GPU  intel only: tiles of each GPU, one rank each (default 1: a
#                  whole GPU per rank, ZE_AFFINITY_MASK=<gpu>; on GPUs of two tiles
#                  that is one GPU under COMPOSITE, one tile under FLAT)
#
# The local rank comes from the launcher that started this rank: PALS, MPICH/Intel
# MPI Hydra, Open MPI, then srun. SLURM_LOCALID is asked last, since an mpiexec
# inside a Slurm allocation inherits the batch step's.
GPU_VENDOR=${GPU_VENDOR:-nvidia}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
TILES_PER_GPU=${TILES_PER_GPU:-1}
local_rank=${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-}}}}
if [ -z "$local_rank" ]; then
    echo "set_affinity_gpu.sh: no local rank (PALS_LOCAL_RANKID, MPI_LOCALRANKID," \
        "OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID): run me under a launcher" >&2
    exit 1
fi
case "$GPU_VENDOR" in
    nvidia) export CUDA_VISIBLE_DEVICES=$((local_rank % GPUS_PER_NODE)) ;;
    amd) export ROCR_VISIBLE_DEVICES=$((local_rank % GPUS_PER_NODE)) ;;
    intel)
        tile=$((local_rank % (GPUS_PER_NODE * TILES_PER_GPU)))
        gpu=$((tile / TILES_PER_GPU))
        if [ "$TILES_PER_GPU" -eq 1 ]; then
            export ZE_AFFINITY_MASK=$gpu
        elif [ "$(tr '[:lower:]' '[:upper:]' <<<"${ZE_FLAT_DEVICE_HIERARCHY:-FLAT}")" = FLAT ]; then
            export ZE_AFFINITY_MASK=$tile
        else
            export ZE_AFFINITY_MASK=$gpu.$((tile % TILES_PER_GPU))
        fi
        ;;
    *)
        echo "set_affinity_gpu.sh: GPU_VENDOR=$GPU_VENDOR is not nvidia, amd or" \
            "intel" >&2
        exit 1
        ;;
esac
exec "$@"
