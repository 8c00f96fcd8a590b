"""Training-step throughput, peak memory and MFU: SiT vs ViT-5 vs a timm-layer SiT, side by side.

    python -m bench.train_step --device cuda --sizes S B XL --precisions fp32 bf16 --modes eager compile \
        --batch-size 32 64 --json results/bench/train_step_h200.json
    python -m bench.train_step --device cpu --threads 1 --sizes S B --batch-size 8 --json train_step_cpu.json

One step = transport loss (Linear path, velocity prediction, SiT defaults) forward, backward, AdamW step
(lr 1e-4, no weight decay, as SiT; ``--optimizer none`` skips it) and zero_grad; random latents (B, 4, s, s)
and labels. EMA is left out. ``--loop`` also times each model's step as ``training/loop.py`` runs it (rows
``SiT+loop``, ``ViT5+loop``): gradient clipping, the loss and gradient-norm reads that guard the optimizer step,
the EMA update; ``loop_over_step``: that step over the plain one, per model (the reads' cost on a GPU).
MFU = achieved FLOP/s / peak, achieved = img/s x 3 x 2 x forward GFLOPs: `sit_vit5.models.flops` counts a
multiply-add as 1 (hence x 2) and a training step is forward + backward (~2x forward, hence x 3).
Memory: peak allocated CUDA memory of one model's warm-up steps (weights, grads, AdamW state, activations),
next to ``bench.plan``'s prediction for the same step (``plan_mem_gb``: no EMA, one process).
``--fsdp`` shards each model with FSDP2 (one unit per block, as ``train.distributed=fsdp``) in a 1-process
group: the FSDP code path's step time and memory on one device.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
from collections.abc import Callable

import torch
from torch import nn

from bench.common import (
    BACKBONE_NAMES,
    MODES,
    PRECISIONS,
    add_common_args,
    autocast,
    build_for,
    interleaved_timings,
    maybe_compile,
    memory_baseline,
    model_counts,
    now,
    peak_memory_gb,
    peak_tflops,
    print_table,
    ratios,
    setup,
    sync,
    write_json,
)
from bench.plan import plan
from sit_vit5.models import SIZES
from sit_vit5.training.ema import update_ema
from sit_vit5.training.fsdp import shard_model
from sit_vit5.training.optim import adamw_kernel
from sit_vit5.transport import create_transport

COLUMNS = ("model", "size", "precision", "mode", "strategy", "batch", "step_ms", "step_ms_min", "img_per_s",
           "tflops", "mfu", "peak_mem_gb", "plan_mem_gb", "first_step_s")
RATIO_COLUMNS = ("size", "precision", "mode", "batch", "vit5_over_sit", "vit5_over_sit_min", "sit_over_timm",
                 "sit_over_timm_min")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(BACKBONE_NAMES), choices=BACKBONE_NAMES)
    p.add_argument("--sizes", nargs="+", default=["S", "B"], choices=SIZES, help="XL/2 is slow on a CPU")
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256 px images)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[8], help="per-device batch; several allowed")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                   help="default: fp32 on cpu, fp32 bf16 on cuda")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["eager"], help="eager and/or torch.compile")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="none: forward + backward only (e.g. XL/2 pairs in a small CPU memory)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) in a 1-process group")
    p.add_argument("--loop", action="store_true",
                   help="also time each model's step as training/loop.py runs it (clipping, the loss and "
                        "grad-norm reads, EMA): rows MODEL+loop")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak for MFU (default by GPU name: H100/H200 989, A100 312)")
    add_common_args(p)
    args = p.parse_args(argv)
    args.precisions = args.precisions or (["fp32", "bf16"] if args.device == "cuda" else ["fp32"])
    return args


def make_train_step(model: nn.Module, device: torch.device, precision: str, mode: str, batch: int,
                    input_size: int, num_classes: int, seed: int = 0,
                    optimizer: bool = True, sharded: bool = False, loop: bool = False) -> Callable[[], None]:
    """A closure running one full training step of ``model`` (already on ``device``; ``sharded``: by FSDP2)
    on fixed random data; ``optimizer=False`` stops after the backward pass (gradients are dropped: no AdamW
    state in memory). ``loop``: as ``training/loop.py`` steps (one GPU): the gradients clipped to norm 1, the
    norm and the loss read on the host before the optimizer step (the loop stops on a non-finite one), then
    the EMA updated (decay 0.9999)."""
    ema = copy.deepcopy(model).requires_grad_(False) if loop else None
    transport = create_transport()
    net = maybe_compile(model, mode)
    params = list(model.parameters())
    # the optimizer training builds (fused on CUDA since issue 56; the H200 table of 2026-12-04 had foreach)
    kernel = adamw_kernel([{"params": params}], sharded)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0, **kernel) if optimizer else None
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.randn(batch, 4, input_size, input_size, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)

    def step() -> None:
        with autocast(device, precision):
            loss = transport.training_losses(net, x1, dict(y=y))["loss"].mean()
        loss.backward()
        if ema is not None:  # the loop's guard: two host reads before the optimizer step
            norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
            if not (math.isfinite(loss.item()) and math.isfinite(norm)):
                raise FloatingPointError(f"non-finite loss or gradient norm ({norm})")
        if opt is not None:
            opt.step()
        if ema is not None:
            update_ema(ema, model, 0.9999)
        for p in params:  # = opt.zero_grad(set_to_none=True)
            p.grad = None

    return step


def _warm_up(args: argparse.Namespace, device: torch.device, backbone: str, size: str, precision: str,
             mode: str, batch: int, row: dict, loop: bool = False) -> Callable[[], None] | None:
    """Build one model and its step (``loop``: the training loop's), run the warm-up steps (recording
    first-step time and peak memory)."""
    baseline = memory_baseline(device)
    try:
        model = build_for(args, backbone, size).to(device).train()
        if args.fsdp:
            args.own_group = single_process_group(device) or getattr(args, "own_group", False)
            shard_model(model)
        step = make_train_step(model, device, precision, mode, batch, args.input_size, args.num_classes,
                               args.seed, optimizer=args.optimizer == "adamw", sharded=args.fsdp, loop=loop)
        sync(device)
        start = now("wall")
        for i in range(args.warmup):
            step()
            if i == 0:
                sync(device)
                row["first_step_s"] = now("wall") - start  # includes compilation
        row["peak_mem_gb"] = peak_memory_gb(device, baseline) if args.warmup else None
        return step
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
        return None


def measure_group(args: argparse.Namespace, device: torch.device, size: str, precision: str, mode: str,
                  batch: int, peak: float | None) -> tuple[list[dict], dict]:
    """Rows for every backbone at one (size, precision, mode, batch), timed interleaved, and their ratios."""
    steps, rows = {}, {}
    variants = [(b, loop) for b in args.models for loop in ((False, True) if args.loop else (False,))]
    for backbone, loop in variants:
        key = f"{backbone}+loop" if loop else backbone
        params_m, gflops = model_counts(backbone, size, args.patch, args.input_size, args.depth)
        rows[key] = dict(model=key, size=f"{size}/{args.patch}", precision=precision, mode=mode,
                         strategy="fsdp" if args.fsdp else "single", batch=batch, params_m=params_m,
                         fwd_gflops=gflops, clock=args.clock, plan_mem_gb=None)
        if device.type == "cuda":  # what bench.plan predicts for this step (one process)
            name = f"{'SiT' if backbone == 'Timm' else backbone}-{size}/{args.patch}"
            predicted = plan(name, batch, precision, "fsdp" if args.fsdp else "ddp", 1, device="cuda", ema=loop,
                             input_size=args.input_size, depth=args.depth or SIZES[size][0])
            rows[key]["plan_mem_gb"] = predicted.peak_gib
        step = _warm_up(args, device, backbone, size, precision, mode, batch, rows[key], loop)
        if step is not None:
            steps[key] = step
        del step
        _free(device)
    times = interleaved_timings(steps, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
    steps.clear()
    _free(device)
    for backbone, secs in times.items():
        row, sec = rows[backbone], statistics.median(secs)
        row.update(step_ms=sec * 1e3, step_ms_min=min(secs) * 1e3, img_per_s=batch / sec,
                   rounds_ms=[round(v * 1e3, 4) for v in secs])
        row["tflops"] = row["img_per_s"] * 3 * 2 * row["fwd_gflops"] / 1e3  # see module docstring
        row["mfu"] = row["tflops"] / peak if peak and precision == "bf16" and args.clock == "wall" else None
    group = dict(size=f"{size}/{args.patch}", precision=precision, mode=mode, batch=batch,
                 **ratios(times, "ViT5", "SiT", "vit5_over_sit"),
                 **ratios(times, "SiT", "Timm", "sit_over_timm"))
    if args.loop:
        group["loop_over_step"] = {b: ratios(times, f"{b}+loop", b, "ratio") for b in args.models}
    return list(rows.values()), group


def single_process_group(device: torch.device) -> bool:
    """A 1-process torch.distributed group (FSDP2 needs one), in memory: no port, no launcher. True if this
    call created it (the caller then destroys it)."""
    dist = torch.distributed
    if dist.is_initialized():
        return False
    cuda = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else None
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=cuda)
    return True


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    peak = peak_tflops(device, args.peak_tflops)
    rows, ratios = [], []
    for size in args.sizes:
        for precision in args.precisions:
            for mode in args.modes:
                for batch in args.batch_size:
                    group_rows, group_ratios = measure_group(args, device, size, precision, mode, batch, peak)
                    rows += group_rows
                    ratios.append(group_ratios)
                    print_table(group_rows, COLUMNS)
    unit = "wall" if args.clock == "wall" else "process-CPU"
    print_table(rows, COLUMNS, f"train step ({args.device}, {unit} seconds; peak bf16 {peak} TFLOP/s)")
    print_table(ratios, RATIO_COLUMNS, "step-time ratios (same run, interleaved)")
    for group in ratios:
        if "loop_over_step" in group:
            print(f"{group['size']} {group['precision']} {group['mode']} b{group['batch']}: training loop / step "
                  + ", ".join(f"{b} {r['ratio']:.3f}" for b, r in group["loop_over_step"].items()
                              if r["ratio"] is not None))
    if getattr(args, "own_group", False):
        torch.distributed.destroy_process_group()
    adamw = "fused" if adamw_kernel([{"params": [torch.empty(0, device=device)]}], args.fsdp) else "default"
    write_json(args.json, "train_step", args, device, peak_tflops=peak, adamw=adamw, rows=rows,
               ratios=ratios)
    return dict(rows=rows, ratios=ratios)


if __name__ == "__main__":
    main()
