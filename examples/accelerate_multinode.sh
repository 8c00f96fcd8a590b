#!/usr/bin/env bash
# Multi-node training with `accelerate launch` (examples/accelerate_multinode.yaml). On every node:
#
#   HEAD=node01 NODE_RANK=0 examples/accelerate_multinode.sh      # on node01
#   HEAD=node01 NODE_RANK=1 examples/accelerate_multinode.sh      # on node02
#
# This starts the same torchrun c10d launch as examples/torchrun_multinode.sh (the rendezvous id is
# accelerate's default, so run one job per HEAD:port at a time). Extra arguments are config overrides;
# rerunning resumes from the newest checkpoint (--resume latest).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${HEAD:?set HEAD to the host name or address of the rank-0 node}"
: "${NODE_RANK:?set NODE_RANK to the index of this node (0 on HEAD)}"
CONFIG=${CONFIG:-configs/imagenet/vit5-xl-2.yaml}
OUT_DIR=${OUT_DIR:-runs/imagenet/$(basename "$CONFIG" .yaml)}

RESUME=()
if compgen -G "$OUT_DIR/checkpoints/*.pt" > /dev/null; then
    RESUME=(--resume latest)
fi

exec accelerate launch --config_file examples/accelerate_multinode.yaml \
    --machine_rank "$NODE_RANK" --main_process_ip "$HEAD" --rdzv_backend c10d \
    train.py --config "$CONFIG" "${RESUME[@]}" "train.out_dir=$OUT_DIR" "$@"
