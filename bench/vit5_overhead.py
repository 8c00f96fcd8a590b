"""ViT-5's training-step cost per FLOP: the ViT5/SiT step-time ratio against their FLOP ratio, side by side.

    python -m bench.vit5_overhead --device cpu --threads 1 --json results/bench/cpu/vit5_overhead.json
    python -m bench.vit5_overhead --device cpu --threads 1 --settings S:16:fp32 --ablate --rounds 9

A setting is ``size:latent_side:precision`` (default: S and B, latents 32 and 16, fp32 and bf16: eight). For
each, SiT and ViT5 train steps (``bench.train_step.make_train_step``: loss, backward, AdamW) run in interleaved
rounds; ``per_flop`` = median per-round step ratio / FLOP ratio (``sit_vit5.models.flops``, forward multiply-adds;
the step's 3x cancels). 1.00 means ViT-5 costs exactly what its extra tokens say; the goal is <= 1.03.

``--ablate`` adds ViT5 variants with one component switched back to SiT's (``-rmsnorm``: LayerNorm blocks,
``-qknorm``, ``-rope``, ``-registers``, ``-learned_ape``: a frozen table, ``-layerscale``) to the same rounds: each
one's own per-FLOP ratio, so ViT5's excess minus a variant's is what that component costs, and the opt-in kernels
(``ViT5+fused_qk``, ``ViT5+tail``, ``ViT5+both``: ``KERNELS``), each checked against the torch ops first
(``kernel_check``). ``--modes eager compile``
times each variant both ways; ``--predict`` prints ``bench.cost_model``'s predicted step ratio (H100 constants on an
H100, else H200) beside each row. The GPU session's first stage (``vit5_ablate`` in bench.suite, issue 56):

    python -m bench.vit5_overhead --device cuda --ablate --predict --settings XL:32:bf16 --depth 4 --batch-size 32
        --modes eager compile       (one command line)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

from bench.common import (
    add_common_args,
    interleaved_timings,
    perturb_zero_init,
    print_table,
    setup,
    write_json,
)
from bench.train_step import make_train_step
from sit_vit5.models import SIZES, create_model, flops
from sit_vit5.models.kernels import fused_qk, tail_attention

DEFAULT_SETTINGS = [f"{s}:{n}:{p}" for s in ("S", "B") for n in (32, 16) for p in ("fp32", "bf16")]
#: ViT5 with one component switched back to its SiT value (the --ablate variants)
ABLATIONS: dict[str, dict] = {
    "-rmsnorm": dict(norm="layernorm"),
    "-qknorm": dict(qk_norm=False),
    "-rope": dict(rope=False, register_rope_theta=None),
    "-registers": dict(num_registers=0, register_rope_theta=None),
    "-learned_ape": dict(pos_embed="fixed"),
    "-layerscale": dict(layer_scale_init=None),
}
#: ViT5 with the opt-in kernels (issue 56): QK-norm + RoPE as one Triton op (``kernels.fused_qk``; eager rows
#: only, compiled code keeps the torch ops), attention at the patches' flash tiles (``kernels.tail_attention``)
KERNELS: dict[str, dict[str, bool]] = {"ViT5+fused_qk": dict(fused=True), "ViT5+tail": dict(tail=True),
                                       "ViT5+both": dict(fused=True, tail=True)}
COLUMNS = ("setting", "variant", "mode", "batch", "flop_ratio", "step_ratio", "pred_ratio", "per_flop",
           "per_round_min", "per_round_max", "rounds", "step_ms")


def parse_setting(text: str) -> tuple[str, int, str]:
    """``"S:16:fp32"`` -> ("S", 16, "fp32"); SystemExit on a malformed one."""
    try:
        size, side, precision = text.split(":")
        if size not in SIZES or precision not in ("fp32", "bf16"):
            raise ValueError
        return size, int(side), precision
    except ValueError:
        raise SystemExit(f"--settings: expected SIZE:SIDE:fp32|bf16 (e.g. S:16:fp32), got {text!r}") from None


def predicted_ratios(args: argparse.Namespace, size: str, side: int, batch: int, depth: int,
                     variants: dict[str, tuple[str, dict]]) -> dict[tuple[str, str], float]:
    """bench.cost_model's predicted step ratio variant / SiT per (variant, mode): the bf16 GPU path's model, the
    same size, latent side, batch and depth (H100 constants when the GPU is one, else H200)."""
    import torch

    from bench import cost_model

    name = torch.cuda.get_device_name() if args.device == "cuda" else ""
    dev = cost_model.DEVICES["H100" if "H100" in name else "H200"]
    times = {}
    for variant, (backbone, kw) in variants.items():
        tr = cost_model.trace(backbone, size, batch, train=True, input_size=side, depth=depth,
                              **KERNELS.get(variant, {}), **kw)
        for mode in args.modes:
            times[variant, mode] = cost_model.predict(tr, mode, dev).seconds
    return {(v, m): times[v, m] / times["SiT", m] for v, m in times}


def kernel_check(device, size: str, side: int, depth: int, switches: dict[str, bool], batch: int = 4) -> dict:
    """The opt-in kernels ``switches`` against the torch ops on ``device``, same weights and inputs, bf16
    autocast: max relative difference of the output and of the parameter gradients (run before the row is
    timed; on a CPU both take the CPU path, so the difference is 0)."""
    import torch

    model = perturb_zero_init(create_model(f"ViT5-{size}/2", input_size=side, depth=depth))
    model = model.to(device).eval()  # eval: no label dropout (the two runs see the same labels)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, model.in_channels, side, side, generator=gen).to(device)
    t, y = torch.rand(batch, generator=gen).to(device), torch.arange(batch).to(device)
    results = []
    for on in (False, True):
        with _switched(switches if on else {}), torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x, t, y).float()
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
        results.append((out, grads))
    (out0, g0), (out1, g1) = results

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    return dict(output=rel(out1, out0), grads=max(rel(a, b) for a, b in zip(g1, g0)))


def _switched(switches: dict[str, bool]):
    """A context with the opt-in kernels ``switches`` (``fused``, ``tail``) on, the others as they are."""
    stack = contextlib.ExitStack()
    if switches.get("fused"):
        stack.enter_context(fused_qk())
    if switches.get("tail"):
        stack.enter_context(tail_attention())
    return stack


def _with_kernels(step, switches: dict[str, bool]):
    """``step`` with the opt-in kernels ``switches`` on around each call."""

    def run():
        with _switched(switches):
            return step()

    return run


def measure_setting(args: argparse.Namespace, device, size: str, side: int, precision: str) -> list[dict]:
    """One row per ViT5 variant (ViT5, and the ablations with --ablate) and mode: step and FLOP ratios against
    SiT; with --predict the cost model's ratio beside it."""
    variants = {"SiT": ("SiT", {}), "ViT5": ("ViT5", {})}
    if args.ablate:
        variants.update({f"ViT5{k}": ("ViT5", kw) for k, kw in ABLATIONS.items()})
        variants.update({name: ("ViT5", {}) for name in KERNELS})
    batch = args.batch_size or max(2, 16 * 16 * 16 // side**2)  # ~ the same tokens per step at either side
    depth = args.depth or SIZES[size][0]
    predicted = predicted_ratios(args, size, side, batch, depth, variants) if args.predict else {}
    rows = []
    for mode in args.modes:
        steps, gflops = {}, {}
        for name, (backbone, kw) in variants.items():
            if KERNELS.get(name, {}).get("fused") and mode != "eager":  # compiled code keeps the torch ops
                continue
            model = create_model(f"{backbone}-{size}/2", input_size=side, depth=depth, **kw)
            gflops[name] = flops(model)
            model = perturb_zero_init(model).to(device).train()
            step = make_train_step(model, device, precision, mode, batch, side, 1000, args.seed)
            steps[name] = _with_kernels(step, KERNELS[name]) if name in KERNELS else step
            for _ in range(args.warmup):
                steps[name]()
        times = interleaved_timings(steps, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
        for name in steps:
            if name == "SiT":
                continue
            per_round = [a / b for a, b in zip(times[name], times["SiT"])]
            flop_ratio = gflops[name] / gflops["SiT"]
            step_ratio = statistics.median(per_round)
            rows.append(dict(setting=f"{size}/2 {side}x{side} {precision}", variant=name, mode=mode, batch=batch,
                             flop_ratio=flop_ratio, step_ratio=step_ratio, pred_ratio=predicted.get((name, mode)),
                             per_flop=step_ratio / flop_ratio, per_round_min=min(per_round) / flop_ratio,
                             per_round_max=max(per_round) / flop_ratio, rounds=len(per_round),
                             step_ms=statistics.median(times[name]) * 1e3,
                             sit_step_ms=statistics.median(times["SiT"]) * 1e3,
                             per_round_ratio=[round(r, 4) for r in per_round]))
        del steps  # free one mode's models (and compiled graphs) before the next
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.vit5_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, help="SIZE:SIDE:PRECISION, e.g. S:16:fp32")
    p.add_argument("--batch-size", type=int, default=None,
                   help="default: 16 at side 16, 4 at side 32 (the same tokens per step)")
    p.add_argument("--ablate", action="store_true", help="add ViT5 variants with one component removed")
    p.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager"])
    p.add_argument("--predict", action="store_true",
                   help="print bench.cost_model's predicted step ratio (bf16 GPU path) beside each row")
    add_common_args(p, steps=1, warmup=2, rounds=7)
    args = p.parse_args(argv)
    settings = [parse_setting(s) for s in args.settings]
    device = setup(args)
    rows, checks = [], {}
    for size, side, precision in settings:
        if args.ablate:  # the opt-in kernels' numbers before their time (bf16: within bf16 rounding)
            for name, switches in KERNELS.items():
                key = f"{size}/2 {side}x{side} {name}"
                checks[key] = kernel_check(device, size, side, args.depth or SIZES[size][0], switches)
                print(f"{name} against the torch ops, {size}/2 {side}x{side} bf16: {checks[key]}")
        new = measure_setting(args, device, size, side, precision)
        rows += new
        print_table(new, COLUMNS)
    unit = "wall" if args.clock == "wall" else "process-CPU"
    print_table(rows, COLUMNS, f"ViT5 / SiT train step per FLOP ({args.device}, {unit} time, interleaved; "
                               "per_round_*: the extremes of the per-round ratio / FLOP ratio; pred_ratio: "
                               "bench.cost_model's)")
    write_json(args.json, "vit5_overhead", args, device, rows=rows, kernel_check=checks)
    return dict(rows=rows, kernel_check=checks)


if __name__ == "__main__":
    main()
