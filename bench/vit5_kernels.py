"""ViT-5's per-block extra work in isolation: q/k QK-norm + RoPE, unfused chain vs the fused node.

    python -m bench.vit5_kernels --threads 1 --size S --batch-size 8 --rounds 15

Each variant is forward + backward of q and k taken from one qkv activation (B, N, 3, H, head_dim) of the
given size (N = patches + 4 registers), the gradient flowing back into qkv; ``qkv only`` is the same without
norm or rotation (the floor both share). Interleaved rounds, process CPU time; medians and the per-round
ratio fused / unfused.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import add_common_args, interleaved_timings, print_table, setup, write_json
from sit_vit5.models.kernels import _QKNormRopeFunction
from sit_vit5.models.layers import RMSNorm
from sit_vit5.models.registry import SIZES
from sit_vit5.models.rope import RopeTables


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.vit5_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="S", choices=SIZES)
    p.add_argument("--grid", type=int, default=16, help="patch grid side (16 = 256-px images at /2)")
    p.add_argument("--batch-size", type=int, default=8)
    add_common_args(p, steps=5, warmup=2, rounds=15)
    args = p.parse_args(argv)
    device = setup(args)
    _, width, heads = SIZES[args.size]
    d, grid, b = width // heads, (args.grid, args.grid), args.batch_size
    rotation = RopeTables(d, grid, 10000.0, 4, 100.0)(grid, device, torch.float32)
    n = args.grid**2 + 4
    q_norm, k_norm = RMSNorm(d).to(device), RMSNorm(d).to(device)
    qkv0 = torch.randn(b, n, 3, heads, d, device=device)
    grads = [torch.randn(b, n, heads, d, device=device) for _ in range(2)]

    def run(kind: str) -> None:
        qkv = qkv0.clone().requires_grad_()
        q, k, _ = qkv.unbind(2)
        if kind == "unfused":
            q, k = rotation(q_norm(q)), rotation(k_norm(k))
        elif kind == "fused":
            q, k = (_QKNormRopeFunction.apply(t, norm.weight, norm.eps, rotation.cis, rotation.cis_conj)
                    for t, norm in ((q, q_norm), (k, k_norm)))
        torch.autograd.backward([q, k], grads)

    fns = {kind: (lambda kind=kind: run(kind)) for kind in ("qkv only", "unfused", "fused")}
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    times = interleaved_timings(fns, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
    floor = statistics.median(times["qkv only"])
    rows = [dict(variant=k, ms=statistics.median(v) * 1e3, ms_min=min(v) * 1e3,
                 extra_ms=(statistics.median(v) - floor) * 1e3, rounds=len(v)) for k, v in times.items()]
    per_round = [a / c for a, c in zip(times["fused"], times["unfused"])]
    print_table(rows, ("variant", "ms", "ms_min", "extra_ms", "rounds"),
                f"q/k norm + RoPE fwd + bwd, {args.size} heads, {n} tokens, batch {b}")
    print(f"fused / unfused: median {statistics.median(per_round):.3f} "
          f"[{min(per_round):.3f}, {max(per_round):.3f}] over {len(per_round)} rounds")
    write_json(args.json, "vit5_kernels", args, device, rows=rows, fused_over_unfused=per_round)
    return dict(rows=rows, fused_over_unfused=per_round)


if __name__ == "__main__":
    main()
