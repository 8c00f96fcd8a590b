#!/usr/bin/env bash
# One GPU session's measurements: bench.suite stage by stage, each stage's JSON tarred as soon as it ends,
# so a run stopped at its time limit still returns every finished stage.
#   tools/gpu_session.sh OUT_DIR [STAGE ...]     (default: every stage of bench.suite, in its order)
# e.g. tools/gpu_session.sh OUT sample_fewstep: SiT-XL/2's 250-step SDE against UniPC at 8 / 16 NFE, and as a DiT-objective model DDPM 250 against DPM-Solver++ 2M SDE at 12.
# With TAR_TO=DIR the tarball (OUT_DIR/h200.tgz) is also copied there after every stage.
# Wheels missing on the GPU machine (diffusers, torch-fidelity) may be put in .whl/ and are installed first.
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT_DIR [STAGE ...]}
shift
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then
  mapfile -t stages < <(python3 -c "from bench.suite import STAGES; print('\n'.join(STAGES))")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee -a "$out/gpu.txt"
for stage in "${stages[@]}"; do
  start=$(date +%s)
  python3 -m bench.suite --out "$out/json" --stages "$stage" 2>&1 | tee -a "$out/suite.log"
  echo "stage $stage: $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
  tar czf "$out/h200.tgz.tmp" -C "$out" json gpu.txt suite.log && mv "$out/h200.tgz.tmp" "$out/h200.tgz"
  if [ -n "${TAR_TO:-}" ]; then cp "$out/h200.tgz" "$TAR_TO/"; fi
done
