"""A MeanFlow training step against a flow-matching step: same model, same batch, the ratio.

    python -m bench.meanflow_step --device cpu --threads 1 --sizes S B --depth 4 --input-size 16 \
        --batch-size 8 --json meanflow_step_cpu.json

One step = the objective's per-sample loss, mean, backward (no optimizer: it costs the same in both).
Flow matching: SiT's transport (Linear, velocity). MeanFlow: ``objective/meanflow.py`` with its default
time sampler, no guidance (``--kappa 0``; with guidance the target adds one no-grad forward of the batch),
one-pass JVP (``--checkpointing``: the two-pass route that gradient checkpointing takes). Both use one model
built with ``interval_embed`` (the flow step never passes an interval, so it computes the flow function).
Under ``torch.func.jvp`` attention runs SDPA's math kernel and the CPU norms their composite ops (the fused
kernels have no forward-mode rule): that cost is in the MeanFlow column. ``meanflow_over_flow``: median of
the per-round ratios (the two run back to back each round).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
from torch import nn

from bench.common import (
    add_common_args,
    autocast,
    interleaved_timings,
    perturb_zero_init,
    print_table,
    ratios,
    setup,
    write_json,
)
from sit_vit5.models import SIZES, create_model
from sit_vit5.names import MEANFLOW_TANGENTS
from sit_vit5.objective import Objective, create_objective

COLUMNS = ("model", "size", "precision", "tangent", "depth", "batch", "flow_ms", "meanflow_ms",
           "meanflow_over_flow", "meanflow_over_flow_min")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.meanflow_step", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["SiT", "ViT5"], choices=("SiT", "ViT5"))
    p.add_argument("--sizes", nargs="+", default=["S", "B"], choices=SIZES)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256 px images)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--kappa", type=float, default=0.0, help="MeanFlow's target guidance (0: none)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (two-pass JVP)")
    p.add_argument("--tangents", nargs="+", choices=MEANFLOW_TANGENTS, default=["conditional"],
                   help="the JVP's dz/dt (transport.meanflow_tangent): each a MeanFlow step of its own, timed "
                        "in the same rounds (predicted adds one no-grad forward of the batch)")
    p.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32"],
                   help="autocast of both steps (bf16: the JVP runs under it, the loss in fp32)")
    add_common_args(p, steps=3, warmup=1, rounds=3)
    return p.parse_args(argv)


def _step(objective: Objective, model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str
          ) -> Callable[[], None]:
    """One training step of ``objective`` on the batch (x (B, 4, s, s), y (B,)): loss, backward."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast(x.device, precision):
            loss = objective.loss(model, x, y).mean()
        loss.backward()

    return step


def run(args: argparse.Namespace) -> list[dict]:
    """One row per model, size, precision and tangent: milliseconds per step of flow matching and of
    MeanFlow, and their ratio."""
    device = setup(args)
    flow = create_objective({"objective": "sit"})
    mean_flows = {f"meanflow-{tangent}": create_objective({"objective": "meanflow", "meanflow_kappa": args.kappa,
                                                            "meanflow_tangent": tangent})
                  for tangent in args.tangents}
    rows = []
    for size, backbone, precision in itertools.product(args.sizes, args.models, args.precisions):
        depth = args.depth or SIZES[size][0]
        model = create_model(f"{backbone}-{size}/{args.patch}", input_size=args.input_size,
                             num_classes=args.num_classes, depth=depth, learn_sigma=False,
                             interval_embed=True)
        model = perturb_zero_init(model).to(device).train()
        model.set_grad_checkpointing(args.checkpointing)
        gen = torch.Generator().manual_seed(args.seed)
        x = torch.randn(args.batch_size, 4, args.input_size, args.input_size, generator=gen)
        y = torch.randint(0, args.num_classes, (args.batch_size,), generator=gen)
        x, y = x.to(device), y.to(device)

        fns = {name: _step(objective, model, x, y, precision)
               for name, objective in {"flow": flow, **mean_flows}.items()}
        for fn in fns.values():
            for _ in range(args.warmup):
                fn()
        times = interleaved_timings(fns, rounds=args.rounds, steps=args.steps, clock=args.clock,
                                    device=device)
        for name in mean_flows:
            rows.append(dict(model=backbone, size=size, precision=precision,
                             tangent=name.removeprefix("meanflow-"), depth=depth, batch=args.batch_size,
                             flow_ms=1e3 * statistics.median(times["flow"]),
                             meanflow_ms=1e3 * statistics.median(times[name]),
                             **ratios(times, name, "flow", "meanflow_over_flow")))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    print_table(rows, COLUMNS, title=f"MeanFlow vs flow-matching step ({args.device}, {args.clock} clock)")
    write_json(args.json, "meanflow_step", args, torch.device(args.device), rows=rows)


if __name__ == "__main__":
    main()
