"""The GPU measurements, one JSON file per stage (the first five stages took 10 minutes on an H200:
``tools/gpu_session.sh`` runs them stage by stage, returning what finished).

    python -m bench.suite --out results/bench/h200            # all stages
    python -m bench.suite --out results/bench/h200 --stages xl_eager sample
    python -m bench.suite --out /tmp/dry --device cpu          # dry run: every stage, tiny, depth 1 (seconds)

Stages (each catches its own failure, so one error does not lose the others):
  attention_tiles  first, ~20 s: SDPA forward + backward at XL/2's attention shape (batch 32, 16 x 72, bf16) over
               256-512 tokens, ViT-5's 260 among them, the cost model's tile-priced ratio and ms beside each row
               (issue 56: the largest term of ViT-5's predicted excess, and the rate of SiT's attention), and
               the opt-in tail attention at 260 beside SDPA at 256, and SDPA held to cuDNN's and the
               memory-efficient kernels (a faster attention is SiT's largest lever after fused AdamW)
  vit5_ablate  then, ~3 min: XL/2 bf16 (4 blocks), batch 32, eager and compiled: ViT5 with each component off
               in turn against SiT, and (eager) with the fused Triton QK-norm + RoPE, bench.cost_model's
               predicted ratio beside each row (issue 56)
  correctness  first, ~30 s: SiT and ViT5 at XL/2 (full 2C outputs), CUDA forward (fp32 with TF32, and
               bf16 with SDPA held to flash attention) against the CPU fp32 forward; odeint and SDE steps on CUDA
  xl_eager     XL/2 bf16 eager, batch 32 and 64: SiT, ViT5, timm-SiT: img/s, MFU, peak memory (and
               bench.plan's prediction of it)
  xl_loop      XL/2 bf16 eager, batch 32: each model's plain step beside training/loop.py's (clipping, the loss
               and grad-norm reads, EMA): what the reads cost (predicted in docs/gpu-cost-model.md)
  xl_compile   XL/2 bf16 torch.compile, batch 32: SiT, ViT5 (compilation takes a minute or two each)
  small        S/2 and B/2, fp32 and bf16, eager, batch 32: the ViT5/SiT and SiT/timm ratios
  vit5_overhead  ViT5/SiT step ratio per FLOP ratio, S/2 and B/2 at latents 32 and 16, fp32 and bf16, batch 32
  fsdp         XL/2 bf16 eager, batch 32, FSDP2-sharded in a 1-process group: SiT, ViT5
  sample       XL/2 bf16, 250-step Euler-Maruyama SDE with CFG 4.0, 32 images: img/s
  sample_compile  the same with the model's forward compiled (sample.py --compile)
  sample_nocfg the same without guidance (one model call per step instead of a doubled batch)
  sample_fewstep  SiT-XL/2 bf16, CFG 4.0, 32 images: SiT's 250-step SDE against the few-step settings of
               results/nfe (UniPC at 8 and 16 NFE), side by side: img/s and the speedup (issue 39)
  pipeline     SiTPipeline (ViT5-XL/2 + the SD-VAE architecture) in fp32, bf16 and fp16: img/s and the
               pixel error against fp32
  data_path    SD-VAE architecture (random weights: no download) vs latent cache, yardstick SiT-XL/2 bf16
  meanflow     a MeanFlow step (JVP, SDPA math kernel) against a flow-matching step, same model and batch:
               S/2, B/2 and XL/2, bf16, batch 32, both JVP tangents: the ratio (issue 53)
``--device cpu`` (or ``--smoke``) shrinks every stage to seconds on a CPU, at ``--depth`` blocks (default 1):
the dry run that proves the suite end to end before a GPU session spends its minutes on it.
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

from bench import (
    attention_tiles,
    correctness,
    data_path,
    meanflow_step,
    pipeline_speed,
    sample_speed,
    train_step,
    vit5_overhead,
)

TIMING = "--warmup 2 --steps 4 --rounds 3"
STAGES = {
    # first (issue 56): the tile term of the cost model and its attention rate, measured in seconds
    "attention_tiles": (attention_tiles.main, "--batch-size 32 --precision bf16 --warmup 3 --steps 10 --rounds 5"),
    # first (issue 56): every ViT-5 component off in turn, eager and compiled, the cost model's ratio beside each
    # row; 4 blocks so that 16 compilations fit in ~3 minutes (the per-block costs are XL/2's)
    "vit5_ablate": (vit5_overhead.main, "--ablate --predict --settings XL:32:bf16 --modes eager compile --depth 4 "
                                        "--batch-size 32 --warmup 2 --steps 3 --rounds 3"),
    "correctness": (correctness.main, "--size XL --batch-size 4 --num-steps 4"),
    "xl_eager": (train_step.main, f"--sizes XL --precisions bf16 --batch-size 32 64 {TIMING}"),
    # the training loop's step (clipping, its two host reads, EMA) beside the plain one: what the reads cost;
    # before xl_compile: cheap, and it splits host from device time (the cost model's least certain constant)
    "xl_loop": (train_step.main, f"--sizes XL --precisions bf16 --models SiT ViT5 --batch-size 32 --loop {TIMING}"),
    "xl_compile": (train_step.main, f"--sizes XL --precisions bf16 --modes compile --models SiT ViT5 "
                                    f"--batch-size 32 {TIMING}"),
    "small": (train_step.main, f"--sizes S B --precisions fp32 bf16 --batch-size 32 {TIMING}"),
    "vit5_overhead": (vit5_overhead.main, "--batch-size 32 --warmup 2 --steps 5 --rounds 5"),
    "fsdp": (train_step.main, f"--sizes XL --precisions bf16 --models SiT ViT5 --fsdp --batch-size 32 {TIMING}"),
    "sample": (sample_speed.main, "--sizes XL --precisions bf16 --samplers sde --num-steps 250 --cfg-scale 4.0 "
                            "--batch-size 32 --rounds 2"),
    # the sampler's ratio with a compiled forward (the cost model: 1.06, eager 1.45); one compile per model
    "sample_compile": (sample_speed.main, "--sizes XL --precisions bf16 --samplers sde --num-steps 250 "
                                          "--cfg-scale 4.0 --batch-size 32 --rounds 2 --modes compile"),
    "sample_nocfg": (sample_speed.main, "--sizes XL --precisions bf16 --samplers sde --num-steps 250 --cfg-scale 1.0 "
                                  "--batch-size 32 --rounds 2"),
    "sample_fewstep": (sample_speed.main, "--models SiT --sizes XL --precisions bf16 --cfg-scale 4.0 --batch-size 32 "
                                          "--rounds 2 --settings " + " ".join(sample_speed.FEW_STEP_SETTINGS)),
    "pipeline": (pipeline_speed.main, "--size XL --precisions fp32 bf16 fp16 --num-images 16 --num-steps 50 "
                                      "--rounds 2"),
    "data_path": (data_path.main, "--model SiT-XL/2 --precision bf16 --batch-size 32 --num-images 128"),
    "meanflow": (meanflow_step.main, f"--sizes S B XL --precisions bf16 --batch-size 32 "
                                     f"--tangents conditional predicted {TIMING}"),
}
#: --smoke: appended to every stage of that script (argparse keeps the last value given).
TINY = "--device cpu --depth 1 --batch-size 2 --warmup 1 --steps 1 --rounds 1"
SMOKE = {
    "attention_tiles": "--device cpu --batch-size 2 --heads 2 --warmup 1 --steps 1 --rounds 1 --tokens 256 260",
    "correctness": "--device cpu --size S --input-size 8 --batch-size 2 --num-steps 3",
    "vit5_overhead": f"{TINY} --settings S:8:fp32 S:8:bf16 --modes eager",
    "train_step": f"{TINY} --sizes S --input-size 8 --precisions fp32 --modes eager",
    "sample_speed": f"{TINY} --sizes S --input-size 8 --precisions fp32 --num-steps 3 --modes eager",
    "data_path": f"{TINY} --vae tiny --image-size 32 --num-images 4 --model SiT-S/2 --precision fp32",
    "meanflow_step": f"{TINY} --sizes S --input-size 8 --precisions fp32 --num-classes 10",
    "pipeline_speed": "--device cpu --depth 1 --warmup 1 --steps 1 --rounds 1 --size S --input-size 4 --vae tiny "
                "--num-images 2 --num-steps 3",
}


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for <stage>.json")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the dry run (every stage shrunk to seconds)")
    p.add_argument("--depth", type=int, default=1, help="blocks per model in the CPU dry run")
    p.add_argument("--smoke", action="store_true", help="the same as --device cpu")
    args = p.parse_args(argv)
    dry = args.smoke or args.device == "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = {}
    for name in args.stages:
        fn, stage_args = STAGES[name]
        shrink = SMOKE[fn.__module__.split(".")[-1]].split() + ["--depth", str(args.depth)] if dry else []
        stage_argv = stage_args.split() + shrink
        print(f"\n=== {name}: {' '.join(stage_argv)}", flush=True)
        try:
            fn([*stage_argv, "--json", str(out / f"{name}.json")])
            status[name] = "ok"
        except Exception as err:  # keep going: the other stages' numbers are still worth having
            traceback.print_exc()
            status[name] = f"failed: {type(err).__name__}: {err}"
    print("\n" + "\n".join(f"{k:12s} {v}" for k, v in status.items()))
    return status


if __name__ == "__main__":
    main()
