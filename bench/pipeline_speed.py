"""The diffusers pipeline (``SiTPipeline``) in each precision: images/s and the pixel error against fp32.

    python -m bench.pipeline_speed --device cuda --size XL --precisions fp32 bf16 --num-images 16 --num-steps 50
    python -m bench.pipeline_speed --device cpu --threads 1 --size S --input-size 8 --vae tiny --depth 1 --num-steps 3

A random-weight model (``--model`` at ``--size``) and an AutoencoderKL (``--vae sd-arch``: SD-VAE ft-EMA's
architecture; ``tiny``: the same factor 8) are put in a pipeline per precision, fp32 as built, bf16 / fp16
as ``SiTPipeline.to(dtype=...)`` (what ``from_pretrained(..., torch_dtype=...)`` gives), and called with the
same labels and seed: ODE Euler at ``--num-steps`` grid points, CFG ``--cfg-scale``. Reported per precision:
seconds per call (median over rounds, after one untimed call), images/s and the largest |pixel - fp32 pixel|
of the float output (``output_type="pt"``, diffusers' range [0, 1]).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import BUILT_VAES, PRECISIONS, add_common_args, build_for, now, print_table, setup, sync, write_json
from sit_vit5.models import SIZES
from sit_vit5.sampling import SampleSpec

COLUMNS = ("model", "precision", "images", "nfe", "cfg", "call_s", "img_per_s", "max_abs_err_vs_fp32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline_speed", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("SiT", "ViT5"), default="ViT5")
    p.add_argument("--size", choices=SIZES, default="XL")
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256-px images)")
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--vae", choices=tuple(BUILT_VAES), default="sd-arch")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["fp32", "bf16", "fp16"])
    p.add_argument("--num-images", type=int, default=16)
    p.add_argument("--num-steps", type=int, default=50)
    p.add_argument("--cfg-scale", type=float, default=4.0)
    add_common_args(p, steps=1, warmup=1, rounds=2)
    return p.parse_args(argv)


def build_pipeline(args: argparse.Namespace, device: torch.device):
    """fp32 SiTPipeline: random ``--model`` + random ``--vae``, ODE Euler settings from the flags."""
    from diffusers import AutoencoderKL

    from sit_vit5 import SiTPipeline
    from sit_vit5.pipeline import scheduler_from

    model = build_for(args, args.model, args.size)
    torch.manual_seed(args.seed)
    vae = AutoencoderKL(**BUILT_VAES[args.vae]).eval().requires_grad_(False)
    spec = SampleSpec(method="ode", sampling_method="euler", num_steps=args.num_steps, cfg_scale=args.cfg_scale)
    scheduler = scheduler_from({"objective": "sit", "path_type": "Linear", "prediction": "velocity"}, spec)
    pipe = SiTPipeline(transformer=model.eval(), scheduler=scheduler, vae=vae).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    pipe = build_pipeline(args, device)
    labels = [i % args.num_classes for i in range(args.num_images)]
    rows, reference = [], None
    for precision in args.precisions:
        dtype = PRECISIONS[precision] or torch.float32
        pipe.to(dtype=dtype)
        call = lambda: pipe(labels, generator=args.seed, output_type="pt", batch_size=args.num_images).images  # noqa: E731
        images = call()  # untimed: warm-up, and the pixels compared with fp32
        times = []
        for _ in range(args.rounds):
            sync(device)
            start = now(args.clock)
            call()
            sync(device)
            times.append(now(args.clock) - start)
        if reference is None and precision == "fp32":
            reference = images
        err = None if reference is None else float((images - reference).abs().max())
        sec = statistics.median(times)
        rows.append(dict(model=f"{args.model}-{args.size}/2", precision=precision, images=args.num_images,
                         nfe=args.num_steps - 1, cfg=args.cfg_scale, call_s=sec,
                         img_per_s=args.num_images / sec, max_abs_err_vs_fp32=err, clock=args.clock))
    print_table(rows, COLUMNS, f"SiTPipeline ({args.device}, {args.clock} seconds, VAE {args.vae})")
    write_json(args.json, "pipeline", args, device, rows=rows)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
