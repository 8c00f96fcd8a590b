"""Flash attention's time against the tiles it runs: SDPA forward + backward at SiT-XL/2's attention shape, over
token counts around 256, ViT-5's 260 (256 patches + 4 registers) among them (issue 56).

    python -m bench.attention_tiles                                    # GPU: batch 32, 16 heads x 72, bf16
    python -m bench.attention_tiles --device cpu --batch-size 2 --rounds 1 --tokens 256 260   # dry run

``bench.cost_model`` prices a flash kernel by the tiles it executes (``flash_padding``): 260 tokens run 1.875x
the work of 256 for 1.03x the FLOPs, and its fitted ``attention`` constant sets the rate. Each row: the median
ms of forward + backward and of the forward alone, their ratio to the first token count, the useful TFLOP/s, and
the model's ratio and ms beside them (H200 constants), so one GPU run tests both the tile term and the rate.
``<backend>_ms``: SDPA held to cuDNN's or the memory-efficient kernel (``--backends``), the candidates for a faster
attention than flash's for both backbones. ``split_ms``: forward + backward of the opt-in tail attention
(``kernels.tail_attention``) where it applies (half precision, 128·m + r tokens with 0 < r <= 16: 260),
``split_ratio`` its time over the first token count's SDPA.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import cost_model as cm
from bench.common import add_common_args, interleaved_timings, print_table, setup, write_json
from sit_vit5.models import kernels

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: SDPA's other kernels: cuDNN's attention (Hopper kernels of its own) and the memory-efficient one; the default
#: pick on an H100/H200 in bf16 is flash attention, which the cost model's tiles describe
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def predicted_ms(batch: int, heads: int, tokens: int, head_dim: int, eff: cm.Efficiency = cm.FITTED,
                 dev: cm.Device = cm.DEVICES["H200"]) -> tuple[float, float]:
    """The cost model's (forward + backward, forward) ms of one self-attention call of this shape."""
    q = torch.empty(batch, heads, tokens, head_dim, device="meta")
    fwd = cm.attention_flops(q, q, q)
    rate = eff.attention * dev.peak_flops
    fwd_s = fwd * cm.flash_padding(q, q, cm.FLASH_FWD_TILE) / rate
    bwd_s = cm.ATTENTION_BACKWARD * fwd * cm.flash_padding(q, q, cm.FLASH_BWD_TILE) / rate
    return (fwd_s + bwd_s) * 1e3, fwd_s * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.attention_tiles", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 257, 260, 272, 320, 384, 512],
                   help="sequence lengths; ratios are to the first")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--heads", type=int, default=16, help="XL: 16 heads of 72 channels")
    p.add_argument("--head-dim", type=int, default=72)
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--backends", nargs="*", choices=sorted(BACKENDS), default=None,
                   help="also time SDPA held to these backends at every token count (default on CUDA: cudnn "
                        "efficient; each failing one is reported and skipped)")
    add_common_args(p, steps=10, warmup=3, rounds=5)
    args = p.parse_args(argv)
    device = setup(args)
    dtype = PRECISIONS[args.precision]
    b, h, d = args.batch_size, args.heads, args.head_dim
    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the model's layout: q, k, v are (B, H, N, d) views of one (B, N, 3, H, d) qkv activation
        qkv = torch.randn(b, n, 3, h, d, generator=gen).to(device, dtype).requires_grad_()
        return qkv, torch.randn(b, h, n, d, generator=gen).to(device, dtype)

    data = {n: inputs(n) for n in args.tokens}

    def step(n: int, backward: bool, split: bool = False, backend: str | None = None) -> None:
        qkv, grad = data[n]
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        held = sdpa_kernel(BACKENDS[backend]) if backend else contextlib.nullcontext()
        with kernels.tail_attention(split), torch.set_grad_enabled(backward), held:
            out = kernels.attention(q, k, v)  # SDPA, or with split the tail attention
        if backward:
            out.backward(grad)
            qkv.grad = None

    # the opt-in tail attention where it applies (128·m + r tokens, 0 < r <= 16): ViT-5's 260 at 256's tiles
    splits = [n for n in args.tokens if kernels.tail_split(n, dtype)]
    fns = {(n, bwd): (lambda n=n, bwd=bwd: step(n, bwd)) for n in args.tokens for bwd in (True, False)}
    fns.update({(n, "split"): (lambda n=n: step(n, True, split=True)) for n in splits})
    backends = args.backends if args.backends is not None else (["cudnn", "efficient"] if device.type == "cuda"
                                                                else [])
    for backend in backends:  # forward + backward held to one kernel, where it takes this shape and dtype
        try:
            step(args.tokens[0], True, backend=backend)
        except RuntimeError as err:
            print(f"SDPA backend {backend}: skipped ({str(err).splitlines()[0][:160]})")
            continue
        fns.update({(n, backend): (lambda n=n, backend=backend: step(n, True, backend=backend))
                    for n in args.tokens})
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    times = interleaved_timings({f"{n}:{bwd}": fn for (n, bwd), fn in fns.items()}, rounds=args.rounds,
                                steps=args.steps, clock=args.clock, device=device)
    ms = {(n, kind): statistics.median(times[f"{n}:{kind}"]) * 1e3 for n, kind in fns}
    first = args.tokens[0]
    pred_first = predicted_ms(b, h, first, d)
    rows = []
    for n in args.tokens:
        pred = predicted_ms(b, h, n, d)
        useful = (1 + cm.ATTENTION_BACKWARD) * 4.0 * b * h * n * n * d  # FLOPs forward + backward
        rows.append(dict(tokens=n, ms=ms[n, True], ratio=ms[n, True] / ms[first, True], fwd_ms=ms[n, False],
                         fwd_ratio=ms[n, False] / ms[first, False], tflops=useful / ms[n, True] / 1e9,
                         model_ms=pred[0], model_ratio=pred[0] / pred_first[0], model_fwd_ratio=pred[1] / pred_first[1],
                         flop_ratio=(n / first) ** 2, rounds=len(times[f"{n}:True"]),
                         split_ms=ms.get((n, "split")), split_ratio=ms[n, "split"] / ms[first, True]
                         if n in splits else None,
                         **{f"{bk}_ms": ms[n, bk] for bk in backends if (n, bk) in ms}))
    print_table(rows, ("tokens", "ms", "ratio", "fwd_ms", "fwd_ratio", "tflops", "model_ms", "model_ratio",
                       "model_fwd_ratio", "flop_ratio", "split_ms", "split_ratio",
                       *[f"{bk}_ms" for bk in backends if (first, bk) in ms]),
                f"SDPA forward + backward, batch {b}, {h} heads x {d}, {args.precision} (model: H200)")
    write_json(args.json, "attention_tiles", args, device, rows=rows)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
