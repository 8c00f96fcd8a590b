#!/usr/bin/env bash
# One Slurm task = one training process: torch.distributed's variables from Slurm's, then exec the command
# (exec: the task *is* the Python process, so the signals srun forwards reach it).
set -euo pipefail
export RANK=$SLURM_PROCID
export WORLD_SIZE=$SLURM_NTASKS
export LOCAL_RANK=$SLURM_LOCALID
tasks_per_node=${SLURM_TASKS_PER_NODE%%[(,]*}  # "8", "8(x2)" or "8,4": this job's first node
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-$tasks_per_node}
export NODE_RANK=$SLURM_NODEID
exec "$@"
