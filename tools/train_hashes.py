"""SHA-256 of the weights that a short demo training run ends with, per backbone and objective (flow, DDPM, MeanFlow).

A refactor of the training path must leave every line unchanged (same seed, the CPU, one thread):

    OMP_NUM_THREADS=1 python tools/train_hashes.py > before.txt   # (on the old commit)
    OMP_NUM_THREADS=1 python tools/train_hashes.py | diff before.txt -
    python tools/train_hashes.py --steps 10                      # shorter runs (other hashes)

Each run is ``python train.py`` (the demo config) with the overrides below, in a temporary folder; the
digest covers the final checkpoint's model and EMA tensors, key by key, in sorted order.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
#: run name -> the overrides on top of the demo config
RUNS = {
    "vit5": ["--config", "demo"],
    "sit": ["--config", "demo", "model.name=SiT-S/2"],
    "dit": ["--config", "demo-dit"],
    "meanflow": ["--config", "demo-meanflow"],  # ViT-5, the JVP along the model's own velocity
    # SiT with MeanFlow's own tangent: the digits study's MeanFlow arms (PROTOCOL.md, 2026-12-06)
    "meanflow-sit": ["--config", "demo-meanflow", "model.name=SiT-S/2", "transport.meanflow_tangent=conditional"],
}


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of every tensor, keys in sorted order (16 hex digits)."""
    sha = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().cpu().contiguous()
        sha.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        sha.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return sha.hexdigest()[:16]


def train_digest(name: str, steps: int, tmp: Path) -> str:
    out = tmp / name
    cmd = [sys.executable, str(ROOT / "train.py"), *RUNS[name], f"train.steps={steps}", f"train.out_dir={out}",
           "train.sample_every=0", "train.milestone_every=0", f"train.ckpt_every={steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
    ckpt = torch.load(out / "checkpoints" / f"{steps:07d}.pt", map_location="cpu", weights_only=True)
    return f"model {state_digest(ckpt['model'])} ema {state_digest(ckpt['ema'])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per run (default 50)")
    parser.add_argument("runs", nargs="*", metavar="RUN", help=f"which runs, of {list(RUNS)} (default all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs or list(RUNS):
            if name not in RUNS:
                sys.exit(f"train_hashes: unknown run {name!r}; choose from {list(RUNS)}")
            print(f"{name} steps={args.steps} {train_digest(name, args.steps, Path(tmp))}", flush=True)


if __name__ == "__main__":
    main()
