"""The device forward equals the CPU forward (the suite's first stage: the numbers after it then mean something).

    python -m bench.correctness --device cuda --json results/bench/h200/correctness.json
    python -m bench.correctness --device cpu --depth 1 --input-size 8     # the dry run: CPU against itself

For each backbone (SiT, ViT5; their full output, the variance half included) the same weights and inputs run on
the CPU in fp32 (the reference) and on ``--device`` in fp32 (TF32 matmuls allowed, as training) and in bf16
autocast, with attention restricted to SDPA's flash kernel in bf16 (it raises if q/k/v come in a layout flash
cannot take). A row passes when the max error is within ``--tol`` x the reference's max magnitude (bf16: 8
bits of mantissa, ~0.4 % per rounding; the default 3 % allows the roundings of a deep network; fp32 rows:
``--fp32-tol``, 1 %, for TF32). Then a few ODE
(torchdiffeq's odeint, which FakeTensor cannot trace) and SDE steps on the device against the CPU. Exits
non-zero (the stage fails) if any row fails.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from bench.common import add_common_args, autocast, build_backbone, print_table, setup, write_json
from sit_vit5.models import SIZES
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec

COLUMNS = ("what", "precision", "max_err", "ref_max", "rel_err", "tol", "ok")


def flash_only(device: torch.device, precision: str):
    """SDPA restricted to flash attention (CUDA bf16), else no restriction."""
    if device.type != "cuda" or precision != "bf16":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def compare(what: str, precision: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> dict:
    """Row: max |out - ref| against tol x max |ref| (both float64 on the CPU)."""
    ref, out = ref.double().cpu(), out.double().cpu()
    err, scale = (out - ref).abs().max().item(), ref.abs().max().item()
    finite = bool(torch.isfinite(out).all())
    return dict(what=what, precision=precision, max_err=err, ref_max=scale, rel_err=err / max(scale, 1e-30),
                tol=tol, ok=finite and err <= tol * scale)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.correctness", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="XL", choices=SIZES)
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tol", type=float, default=0.03, help="bf16 tolerance, relative to the max magnitude")
    p.add_argument("--fp32-tol", type=float, default=0.01, help="fp32 tolerance (TF32 matmuls on CUDA)")
    p.add_argument("--num-steps", type=int, default=4, help="sampler grid points")
    p.add_argument("--sampler-size", default="S", choices=SIZES, help="the SiT the samplers run")
    add_common_args(p)
    args = p.parse_args(argv)
    device = setup(args)
    gen = torch.Generator().manual_seed(args.seed)
    b, s = args.batch_size, args.input_size
    x, t = torch.randn(b, 4, s, s, generator=gen), torch.rand(b, generator=gen)
    y = torch.randint(0, 1000, (b,), generator=gen)
    rows = []
    for name, backbone in (("SiT", "SiT"), ("ViT5", "ViT5")):  # full outputs: 2C channels (DiT's too)
        model = build_backbone(backbone, args.size, input_size=s, depth=args.depth).eval()
        with torch.no_grad():
            ref = model(x, t, y)
            model.to(device)
            for precision, tol in (("fp32", args.fp32_tol), ("bf16", args.tol)):
                with flash_only(device, precision), autocast(device, precision):
                    out = model(x.to(device), t.to(device), y.to(device))
                rows.append(compare(f"{name}-{args.size}/2 forward", precision, ref, out, tol))
        del model
    # samplers: odeint (Euler grid) and Euler-Maruyama on the device against the CPU, SiT fp32
    model = build_backbone("SiT", args.sampler_size, input_size=s, depth=args.depth).eval()
    objective = create_objective({})
    for method, spec in (("ode euler", SampleSpec(method="ode", sampling_method="euler", num_steps=args.num_steps)),
                         ("sde Euler", SampleSpec(method="sde", num_steps=args.num_steps))):
        fn = objective.sampler(spec).sample
        outs = []
        for where in ("cpu", device):
            model.to(where)
            gens = [torch.Generator().manual_seed(i) for i in range(b)]
            with torch.no_grad():
                outs.append(fn(x.to(where), model.forward, generator=gens, y=y.to(where))[-1])
        rows.append(compare(f"SiT-{args.sampler_size}/2 {method}, {args.num_steps} points", "fp32", *outs,
                            args.fp32_tol))
    print_table(rows, COLUMNS, f"{args.device} against the CPU (fp32 reference)")
    write_json(args.json, "correctness", args, device, rows=rows)
    failed = [r["what"] + " " + r["precision"] for r in rows if not r["ok"]]
    if failed:
        raise RuntimeError(f"device forward differs from the CPU beyond tolerance: {', '.join(failed)}")
    return dict(rows=rows)


if __name__ == "__main__":
    main()
