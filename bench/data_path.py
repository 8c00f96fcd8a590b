"""Data-path cost per batch, as a fraction of a training step: raw images + VAE encode vs the latent cache.

    python -m bench.data_path --device cuda --vae stabilityai/sd-vae-ft-ema --model SiT-XL/2 --batch-size 32
    python -m bench.data_path --device cpu --threads 1 --model SiT-S/2 --batch-size 8 --num-images 32

A synthetic ImageFolder (``--num-images`` JPEGs of about 1.5 x 1.2 ``--image-size``, ImageNet-like) is written
to a temporary directory, and its latent cache is built with ``sit_vit5.cache_latents``. Timed per batch, in
the main process (``--num-workers 0``: the cost itself, which workers could only hide, not remove):

* ``images + VAE``: ImageFolderDataset (JPEG decode, ADM center crop, flip) -> device -> ``vae.encode``
  posterior sample (SiT's train.py path), reported as ``decode`` and ``encode``;
* ``latent cache``: LatentCacheDataset (memmap read of mean and std, mean + std * eps) -> device;
* ``train step``: the ``--model`` step of bench.train_step on latents of the same shape and batch.

``--vae sd-arch`` (default) builds the SD-VAE architecture (sd-vae-ft-ema config) with random weights: the
encode costs the same as with the real weights and needs no download. The cache is then written with a tiny
VAE of the same downsampling factor 8, since reading the cache costs the same whatever VAE filled it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from bench.common import (
    BUILT_VAES,
    PRECISIONS,
    TINY_VAE_ARCH,
    add_common_args,
    build_backbone,
    interleaved_timings,
    print_table,
    setup,
    write_json,
)
from bench.train_step import make_train_step

COLUMNS = ("path", "decode_ms", "encode_ms", "batch_ms", "fraction_of_step")
_MODEL = re.compile(r"^(?P<backbone>\w+?)-(?P<size>S|B|L|XL)/(?P<patch>\d+)$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.data_path", description=__doc__.split("\n")[0])
    p.add_argument("--vae", default="sd-arch",
                   help="sd-arch | tiny (built from a config, random weights) | hub id | local diffusers dir")
    p.add_argument("--vae-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--model", default="SiT-S/2", help="whose train step is the yardstick, e.g. SiT-XL/2")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="of the train step (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--num-images", type=int, default=32)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (0: time the work itself)")
    p.add_argument("--cache-dtype", choices=("float16", "float32"), default="float16")
    p.add_argument("--workdir", default=None, help="where images and cache go (default: a temporary dir)")
    add_common_args(p, steps=1, warmup=1, rounds=3)
    args = p.parse_args(argv)
    if not _MODEL.match(args.model):
        p.error(f"--model {args.model!r} is not like SiT-S/2, ViT5-B/2, Timm-XL/2")
    if args.num_images < args.batch_size:
        p.error(f"--num-images {args.num_images} is smaller than --batch-size {args.batch_size}")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    return args


def write_image_folder(root: Path, num_images: int, image_size: int, seed: int = 0) -> None:
    """``num_images`` smooth random JPEGs (quality 90) of ~1.5 x 1.2 image_size in two class folders."""
    rng = np.random.default_rng(seed)
    w, h = round(1.5 * image_size), round(1.2 * image_size)
    for i in range(num_images):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        noise = rng.integers(-20, 21, (h, w, 3))
        smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int64)
        pixels = np.clip(smooth + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def build_vae(name: str, device: torch.device, dtype: torch.dtype, workdir: Path):
    """(encoder VAE on ``device``, VAE directory for cache_latents)."""
    from diffusers import AutoencoderKL

    from sit_vit5.vae import load_vae

    if name not in BUILT_VAES:
        return load_vae(name, device, dtype), name
    torch.manual_seed(0)
    tiny_dir = workdir / "tiny_vae"
    AutoencoderKL(**TINY_VAE_ARCH).save_pretrained(tiny_dir)
    vae = AutoencoderKL(**BUILT_VAES[name]).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return vae, str(tiny_dir)


def batches(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    from sit_vit5 import cache_latents
    from sit_vit5.image_data import ImageFolderDataset
    from sit_vit5.latent_cache import LatentCacheDataset
    from sit_vit5.vae import encode

    tmp = None if args.workdir else tempfile.mkdtemp(prefix="bench_data_path_")
    workdir = Path(args.workdir or tmp)
    try:
        images_dir, cache_dir = workdir / "images", workdir / "latents"
        if not images_dir.is_dir():
            write_image_folder(images_dir, args.num_images, args.image_size, args.seed)
        vae, vae_for_cache = build_vae(args.vae, device, getattr(torch, args.vae_dtype), workdir)
        if not (cache_dir / "manifest.json").is_file():
            cache_latents.main(["--data-dir", str(images_dir), "--out", str(cache_dir), "--vae",
                                vae_for_cache, "--image-size", str(args.image_size), "--batch-size",
                                str(args.batch_size), "--dtype", args.cache_dtype, "--num-workers", "0",
                                *(["--cpu"] if device.type == "cpu" else [])])
        latents = LatentCacheDataset(cache_dir)
        loader_kw = dict(batch_size=args.batch_size, shuffle=True, drop_last=True,
                         num_workers=args.num_workers, pin_memory=device.type == "cuda")
        image_batches = batches(DataLoader(ImageFolderDataset(images_dir, args.image_size), **loader_kw))
        latent_batches = batches(DataLoader(latents, **loader_kw))
        fixed_images = next(image_batches)[0].to(device)

        def decode() -> None:
            next(image_batches)[0].to(device, non_blocking=True)

        def encode_batch() -> None:
            encode(vae, fixed_images)

        def cache_fetch() -> None:
            next(latent_batches)[0].to(device, non_blocking=True)

        m = _MODEL.match(args.model)
        model = build_backbone(m["backbone"], m["size"], patch=int(m["patch"]),
                               input_size=latents.latent_shape[-1], depth=args.depth,
                               init=args.init).to(device).train()
        train_step = make_train_step(model, device, args.precision, "eager", args.batch_size,
                                     latents.latent_shape[-1], 1000, args.seed)
        fns = dict(decode=decode, encode=encode_batch, cache=cache_fetch, step=train_step)
        for fn in fns.values():
            for _ in range(args.warmup):
                fn()
        times = interleaved_timings(fns, rounds=args.rounds, steps=args.steps, clock=args.clock,
                                    device=device)
        sec = {name: statistics.median(v) for name, v in times.items()}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    step = sec["step"]
    raw = sec["decode"] + sec["encode"]
    rows = [
        dict(path="images + VAE", decode_ms=sec["decode"] * 1e3, encode_ms=sec["encode"] * 1e3,
             batch_ms=raw * 1e3, fraction_of_step=raw / step),
        dict(path="latent cache", batch_ms=sec["cache"] * 1e3, fraction_of_step=sec["cache"] / step),
        dict(path=f"train step {args.model} {args.precision}", batch_ms=step * 1e3, fraction_of_step=1.0),
    ]
    unit = "wall" if args.clock == "wall" else "process-CPU"
    print_table(rows, COLUMNS, f"data path per batch of {args.batch_size} ({args.device}, {unit} seconds, "
                               f"VAE {args.vae}, {args.image_size} px)")
    write_json(args.json, "data_path", args, device, latent_shape=list(latents.latent_shape), rows=rows)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
