#!/usr/bin/env bash
# Issue 55's reruns of the few-step study: five sample seeds (0-4) for every reference row and every
# row a verdict reads, in priority order (results/nfe/README.md, addition of 2026-12-06). Resumable:
# each (row, seed) is written as it completes and a rerun skips it; a checkpoint that exists is not
# retrained. Run from the repository root, one core:
#   OMP_NUM_THREADS=1 nohup setsid bash results/nfe/rerun-2026-12-06.sh > nfe-rerun.log 2>&1 &
set -euo pipefail
PY=${PY:-python}
OUT=${OUT:-results/nfe/sample-seeds}  # new files: the checkpoints are retrained (see the README)
SEEDS="0 1 2 3 4"
nfe() { $PY -m sit_vit5.experiments nfe "$@" --out "$OUT" --sample-seeds $SEEDS; }

# a checkpoint the study samples, trained when missing: the demo configs, or a digits-study run
# with the overrides its committed record names (results/digits/runs/<dataset>/<arm>-seed<N>.json)
train_demo() {  # $1: config name, $2: run folder
  [ -f "$2/checkpoints/0002000.pt" ] || $PY train.py --config "$1" train.out_dir="$2"
}
train_digits() {  # $1: dataset, $2: arm, $3: training seed
  local ckpt="runs/digits-proxy/$1/$2/seed$3/checkpoints/0002000.pt"
  [ -f "$ckpt" ] && return 0
  mapfile -t over < <($PY -c "import json,sys; print('\n'.join(json.load(open(sys.argv[1]))['identity']['overrides']))" \
    "results/digits/runs/$1/$2-seed$3.json")
  # a run stopped part-way (a session ended) continues bit-identically from its last checkpoint
  local resume=()
  [ -f "runs/digits-proxy/$1/$2/seed$3/checkpoints/latest.json" ] && resume=(--resume latest)
  $PY train.py --config configs/digits/repro.yaml "${over[@]}" "${resume[@]}"
}

# 1. the demo (SiT objective): reference, the verdict rows, the ODE limit (dopri5)
train_demo demo runs/demo
D=runs/demo/checkpoints/0002000.pt
nfe $D --solvers sde-euler-mean --nfe 250
nfe $D --solvers unipc --nfe 8 16
nfe $D --solvers ode-dopri5
nfe $D --solvers unipc --nfe 8 --labels random  # the harness against sample.py bulk's labels
# 2. the DiT-objective demo: DDPM 250 (reference), the recommended DPM-Solver++ 2M SDE at 8 / 12,
#    the best ODE rows at <= 20 NFE (DDIM 16, ddim-unipc 12, ddim-dpm++2m 12)
train_demo demo-dit runs/demo-dit
T=runs/demo-dit/checkpoints/0002000.pt
nfe $T --solvers ddpm --nfe 250
nfe $T --solvers ddpm-dpm++2m-sde --nfe 8 12
nfe $T --solvers ddim --nfe 16
nfe $T --solvers ddim-unipc ddim-dpm++2m --nfe 12
# 3. the 6 digits8 checkpoints, no CFG
for dataset in digits8; do
  for seed in 12 13 14; do
    for arm in sit vit-5-g-1; do
      train_digits $dataset $arm $seed
      c=runs/digits-proxy/$dataset/$arm/seed$seed/checkpoints/0002000.pt
      nfe $c --solvers sde-euler-mean --nfe 250
      nfe $c --solvers unipc --nfe 8 16
    done
  done
done
nfe $D --solvers sde-euler-mean --nfe 250 --labels random
# 4. the demo with CFG 1.5
nfe $D --solvers sde-euler-mean --nfe 250 --cfg-scales 1.5
nfe $D --solvers unipc --nfe 8 16 --cfg-scales 1.5
# 5. the 6 digits16 checkpoints, no CFG (about 4x digits8's cost per row)
for dataset in digits16; do
  for seed in 12 13 14; do
    for arm in sit vit-5-g-1; do
      train_digits $dataset $arm $seed
      c=runs/digits-proxy/$dataset/$arm/seed$seed/checkpoints/0002000.pt
      nfe $c --solvers sde-euler-mean --nfe 250
      nfe $c --solvers unipc --nfe 8 16
    done
  done
done
# 6. the digits checkpoints with CFG 1.5
for dataset in digits8 digits16; do
  for seed in 12 13 14; do
    for arm in sit vit-5-g-1; do
      c=runs/digits-proxy/$dataset/$arm/seed$seed/checkpoints/0002000.pt
      nfe $c --solvers sde-euler-mean --nfe 250 --cfg-scales 1.5
      nfe $c --solvers unipc --nfe 8 16 --cfg-scales 1.5
    done
  done
done
# 7. added 08:45, before its rows ran: the converged-ODE reference the 12-04 text reads on digits8
#    (dopri5, seed 12 of both arms), its three tolerances
for arm in sit vit-5-g-1; do
  nfe runs/digits-proxy/digits8/$arm/seed12/checkpoints/0002000.pt --solvers ode-dopri5
done
$PY -m sit_vit5.experiments nfe-summary --out "$OUT"
