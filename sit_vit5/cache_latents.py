"""Encode an image folder once into a sharded, memory-mappable cache of VAE posterior moments.

    python -m sit_vit5.cache_latents --data-dir /data/imagenet/train --out /data/latents/in256 \
        --vae stabilityai/sd-vae-ft-ema --image-size 256 --batch-size 64 --shard-size 10000
    accelerate launch -m sit_vit5.cache_latents ...          # one process per GPU
    python -m sit_vit5.cache_latents --verify --out /data/latents/in256   # check every byte

The command line over sit_vit5.latent_cache (format, writer, reader, verifier).
Exit status: 0 done; 2 bad input (one line); 130 interrupted (rerun the same command)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

from sit_vit5.latent_cache import (
    STORAGE_DTYPES,
    VAE_DTYPES,
    CacheWriter,
    WriteOptions,
    verify_cache,
)
from sit_vit5.names import SD_VAE_SCALING_FACTOR
from sit_vit5.utils.distributed import LaunchError, describe_group, join_launcher_group
from sit_vit5.utils.errors import KNOWN_ERRORS, run_cli

PROG = "python -m sit_vit5.cache_latents"
# a shorter image side is refused (or skipped with --skip-bad): upscaling it invents the picture
MIN_IMAGE_SIDE = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--data-dir",
                   help="ImageFolder root: <data-dir>/<class>/<image> (required to encode)")
    p.add_argument("--out", required=True,
                   help="cache directory (created; rerun with it to resume)")
    p.add_argument("--verify", action="store_true",
                   help="only check the complete cache at --out: layout, SHA-256 and finite values "
                   "(≈ 0.5 s per GB once in the page cache)")
    p.add_argument("--vae", default="stabilityai/sd-vae-ft-ema",
                   help="hub id (stabilityai/sd-vae-ft-ema or -mse) or a local diffusers "
                   "AutoencoderKL dir")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64,
                   help="images per VAE call (each also flipped)")
    p.add_argument("--shard-size", type=int, default=10000, help="images per shard file")
    p.add_argument("--scaling-factor", type=float, default=SD_VAE_SCALING_FACTOR,
                   help="stored moments = (posterior − shift) × this (default SD-VAE's 0.18215; "
                   "SD3 1.5305, FLUX 0.3611)")
    p.add_argument("--shift-factor", type=float, default=None,
                   help="the shift (default none; SD3 0.0609, FLUX 0.1159). Per-channel "
                   "statistics are always recorded in the manifest (vae.latent_stats: cache)")
    p.add_argument("--dtype", choices=STORAGE_DTYPES, default="float16",
                   help="storage dtype of mean and std")
    p.add_argument("--vae-dtype", choices=VAE_DTYPES, default="float32",
                   help="precision the VAE runs in")
    p.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="image decoders")
    p.add_argument("--cpu", action="store_true", help="CPU even with GPUs (automatic without)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unreadable or too small images (each reported, listed in the "
                   "manifest; the dataset omits them)")
    p.add_argument("--min-image-side", type=int, default=MIN_IMAGE_SIDE,
                   help=f"refuse images whose short side is below this many pixels (default "
                   f"{MIN_IMAGE_SIDE}; 0 accepts any size, upscaled by the ADM crop)")
    args = p.parse_args(argv)
    if not args.verify and args.data_dir is None:
        p.error("the following arguments are required: --data-dir (or --verify)")
    for name in ("image_size", "batch_size", "shard_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.scaling_factor > 0 or not math.isfinite(args.scaling_factor):
        p.error(f"--scaling-factor must be a positive number, got {args.scaling_factor}")
    if args.shift_factor is not None and not math.isfinite(args.shift_factor):
        p.error(f"--shift-factor must be a finite number, got {args.shift_factor}")
    if args.min_image_side < 0:
        p.error(f"--min-image-side must be >= 0, got {args.min_image_side}")
    return args


def _verify(out: Path) -> int:
    result = verify_cache(out)
    print(f"latent cache {out} verified: {result['files']} shard files, "
          f"{result['bytes'] / 1e9:.3f} GB, sizes, SHA-256 and finite values ok "
          f"({result['seconds']:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Encode (or with --verify check) a cache; raises the errors ``cli`` reports on one line."""
    args = parse_args(argv)
    out = Path(args.out)
    if args.verify:
        return _verify(out)
    state = join_launcher_group(cpu=args.cpu)  # else every process would encode every shard
    if state.is_main_process:
        print(f"latent cache on {describe_group(state.num_processes, state.device)}", flush=True)
    options = WriteOptions(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(WriteOptions)})
    writer = CacheWriter(out, args.data_dir, options, state)
    swept = writer.begin()
    if swept:
        print(f"removed {len(swept)} temporary file(s) of an interrupted run: "
              f"{', '.join(swept[:4])}", flush=True)
    mine, pending = writer.my_shards()
    print(f"process {state.process_index}/{state.num_processes}: shards "
          f"{[e['name'][6:] for e in mine]} of {len(pending)} pending", flush=True)
    desc = (f"encoding {len(pending)}/{len(writer.entries)} shards on "
            f"{state.num_processes} process(es)")
    with tqdm(total=sum(e["stop"] - e["start"] for e in mine), unit="img", desc=desc,
              disable=not state.is_main_process) as bar:
        for entry in mine:
            writer.encode_shard(entry, progress=bar.update,
                                skipped=lambda msg: tqdm.write(f"skipping {msg}", file=sys.stderr))
    if state.is_main_process:
        print("recording the per-channel statistics of the posterior means (one pass over the "
              "cache's means)", flush=True)
    manifest = writer.finish()
    if manifest is not None:
        skipped = manifest["bad_files"]
        more = "; ..." if len(skipped) > 3 else ""
        listed = ": " + "; ".join(skipped[:3]) + more if skipped else ""
        print(f"latent cache complete: {out} ({manifest['num_images']} images, "
              f"{len(manifest['bad_indices'])} skipped{listed}, "
              f"latents {manifest['latent_shape']})")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` with the errors a user can fix reported on one line (exit 2), Ctrl-C as exit 130."""
    return run_cli(PROG, lambda: main(argv), errors=(*KNOWN_ERRORS, LaunchError), resumable=True)


if __name__ == "__main__":
    sys.exit(cli())
