#!/usr/bin/env bash
# Multi-node training with torchrun's c10d rendezvous (no Slurm). Run the same command on every node:
#
#   HEAD=node01 NNODES=2 examples/torchrun_multinode.sh                  # on node01, node02, ...
#   HEAD=node01 NNODES=2 CONFIG=configs/imagenet/sit-xl-2.yaml examples/torchrun_multinode.sh train.steps=400000
#
# c10d rendezvous: the first node to arrive hosts the store on $HEAD:$PORT, node ranks are assigned as the
# nodes join (no --node-rank), and the job starts when all $NNODES have joined. Extra arguments are config
# overrides. Rerunning the same command after a crash resumes from the newest checkpoint (--resume latest).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${HEAD:?set HEAD to the host name or address of one of the nodes (the rendezvous host)}"
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PORT=${PORT:-29500}
CONFIG=${CONFIG:-configs/imagenet/vit5-xl-2.yaml}
OUT_DIR=${OUT_DIR:-runs/imagenet/$(basename "$CONFIG" .yaml)}
RUN_ID=${RUN_ID:-$(basename "$OUT_DIR")}  # the same on every node: it names the rendezvous

RESUME=()
if compgen -G "$OUT_DIR/checkpoints/*.pt" > /dev/null; then
    RESUME=(--resume latest)
fi

exec torchrun \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$RUN_ID" \
    --max-restarts 0 \
    train.py --config "$CONFIG" "${RESUME[@]}" "train.out_dir=$OUT_DIR" "$@"
