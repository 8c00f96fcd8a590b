"""``python -m sit_vit5.models``: parameter / FLOP table for every size of both backbones (meta
device)."""

from __future__ import annotations

import argparse

import torch

from .registry import SIZES, count_params, create_model, flops


def table(input_size: int = 32, patch_size: int = 2, learn_sigma: bool = True) -> str:
    """Markdown table of parameters (M) and forward GFLOPs at ``input_size`` x ``input_size``
    latents."""
    rows = ["| model | params (M) | GFLOPs |", "|---|---:|---:|"]
    for backbone in ("SiT", "ViT5"):
        for size in SIZES:
            name = f"{backbone}-{size}/{patch_size}"
            with torch.device("meta"):
                model = create_model(name, input_size=input_size, learn_sigma=learn_sigma)
            rows.append(f"| {name} | {count_params(model) / 1e6:.2f} | {flops(model):.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input-size", type=int, default=32,
                    help="latent side (32 for ImageNet 256 + SD-VAE)")
    ap.add_argument("--patch-size", type=int, default=2, choices=(2, 4, 8))
    args = ap.parse_args(argv)
    print(table(args.input_size, args.patch_size))


if __name__ == "__main__":
    main()
