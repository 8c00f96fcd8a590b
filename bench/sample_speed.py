"""Sampling throughput (images/s at a fixed number of function evaluations), SiT vs ViT-5, side by side.

    python -m bench.sample_speed --device cuda --sizes XL --precisions bf16 --samplers sde --num-steps 250 \
        --cfg-scale 4.0 --batch-size 64 --json results/bench/sample_h200.json
    python -m bench.sample_speed --device cpu --threads 1 --sizes S B --num-steps 8 --batch-size 8

``sde``: Euler-Maruyama on the SiT SDE (``Sampler.sample_sde``, last step "Mean"): NFE = num_steps.
``ode``: Euler on the probability-flow ODE (``sample_ode(sampling_method="euler")``): NFE = num_steps - 1.
With CFG (scale != 1) every evaluation runs the model on the doubled batch (conditional + null class), as in
SiT's sample.py. One timed call = one whole sampling run from noise to latents (no VAE decode).
"""

from __future__ import annotations

import argparse
import gc
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
    now,
    peak_memory_gb,
    print_table,
    ratios,
    setup,
    sync,
    write_json,
)
from sit_vit5.guidance import ClassifierFreeGuidance
from sit_vit5.models import SIZES
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.transport import Sampler

SAMPLERS = ("sde", "ode")
COLUMNS = ("model", "size", "sampler", "nfe", "cfg", "precision", "mode", "batch", "run_s", "img_per_s",
           "ms_per_nfe", "vit5_over_sit", "vit5_over_sit_min", "peak_mem_gb", "first_run_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sample_speed", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["SiT", "ViT5"], choices=BACKBONE_NAMES)
    p.add_argument("--sizes", nargs="+", default=["S", "B"], choices=SIZES)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, nargs="+", default=[8], help="images per run (CFG doubles it)")
    p.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=["sde"])
    p.add_argument("--num-steps", type=int, default=None, help="grid points (default: 250 on cuda, 8 on cpu)")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="1.0 = no guidance (single batch)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                   help="default: fp32 on cpu, bf16 on cuda (autocast around the model; integrator in fp32)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["eager"])
    p.add_argument("--num-classes", type=int, default=1000)
    add_common_args(p, steps=1, warmup=1, rounds=3)
    args = p.parse_args(argv)
    args.num_steps = args.num_steps or (250 if args.device == "cuda" else 8)
    args.precisions = args.precisions or (["bf16"] if args.device == "cuda" else ["fp32"])
    return args


def make_sample_run(model: nn.Module, device: torch.device, precision: str, mode: str, sampler_name: str,
                    num_steps: int, cfg_scale: float, batch: int, input_size: int, num_classes: int,
                    seed: int = 0) -> tuple[Callable[[], None], Sampler]:
    """A closure sampling ``batch`` latents from fixed noise and labels; the Sampler reports ``last_nfe``."""
    spec = SampleSpec(method=sampler_name, num_steps=num_steps,
                      sampling_method="euler" if sampler_name == "ode" else "Euler")
    built = create_objective({}).sampler(spec)
    sampler, sample_fn = built.sampler, built.sample
    net = maybe_compile(model.eval(), mode)

    def model_fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(device, precision):
            return net(x, t, y).float()

    guided = ClassifierFreeGuidance(model_fn, cfg_scale, null_class=num_classes)  # scale 1: one plain call
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, 4, input_size, input_size, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)

    @torch.no_grad()
    def run() -> None:
        sample_fn(z, guided, generator=torch.Generator().manual_seed(seed + 1), y=y)

    return run, sampler


def measure_group(args: argparse.Namespace, device: torch.device, size: str, sampler_name: str,
                  precision: str, mode: str, batch: int) -> list[dict]:
    """One row per backbone at one setting, timed interleaved."""
    runs, rows = {}, {}
    for backbone in args.models:
        row = rows[backbone] = dict(model=backbone, size=f"{size}/{args.patch}", sampler=sampler_name,
                                    cfg=args.cfg_scale, precision=precision, mode=mode, batch=batch,
                                    clock=args.clock)
        baseline = memory_baseline(device)
        try:
            model = build_for(args, backbone, size).to(device)
            run, sampler = make_sample_run(model, device, precision, mode, sampler_name, args.num_steps,
                                           args.cfg_scale, batch, args.input_size, args.num_classes,
                                           args.seed)
            sync(device)
            start = now("wall")
            run()  # always one untimed run: it compiles and gives the NFE and the peak memory
            sync(device)
            row.update(first_run_s=now("wall") - start, nfe=sampler.last_nfe,
                       peak_mem_gb=peak_memory_gb(device, baseline))
            for _ in range(args.warmup - 1):
                run()
            runs[backbone] = run
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        model = run = None
        gc.collect()
    times = interleaved_timings(runs, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
    runs.clear()
    for backbone, secs in times.items():
        row, sec = rows[backbone], statistics.median(secs)
        row.update(run_s=sec, run_s_min=min(secs), img_per_s=batch / sec, ms_per_nfe=sec * 1e3 / row["nfe"],
                   rounds_s=[round(v, 4) for v in secs])
    if "ViT5" in rows:
        rows["ViT5"].update(ratios(times, "ViT5", "SiT", "vit5_over_sit"))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    rows = []
    for size in args.sizes:
        for sampler_name in args.samplers:
            for precision in args.precisions:
                for mode in args.modes:
                    for batch in args.batch_size:
                        group = measure_group(args, device, size, sampler_name, precision, mode, batch)
                        print_table(group, COLUMNS)
                        rows += group
    unit = "wall" if args.clock == "wall" else "process-CPU"
    print_table(rows, COLUMNS, f"sampling ({args.device}, {unit} seconds, {args.num_steps} grid points)")
    write_json(args.json, "sample", args, device, rows=rows)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
