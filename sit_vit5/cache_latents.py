"""Encode an image folder once into a sharded, memory-mappable cache of SD-VAE posterior moments.

    python -m sit_vit5.cache_latents --data-dir /data/imagenet/train --out /data/latents/in256 \
        --vae stabilityai/sd-vae-ft-ema --image-size 256 --batch-size 64 --shard-size 10000
    accelerate launch -m sit_vit5.cache_latents ...          # one process per GPU

For every image (ADM center crop) and its horizontal flip the cache stores the posterior mean and std,
multiplied by the scaling factor; training draws mean + std·ε (sit_vit5.data.LatentCacheDataset, which
also documents the file layout). Shard k holds images [k·shard_size, (k+1)·shard_size); pending shards are
dealt round-robin to the processes. A shard's arrays are written under temporary names and renamed into
place, then its `.done` marker is written, so an interrupted run leaves no half shard and a rerun with the
same arguments encodes only the shards without a marker (with any number of processes). Rank 0 writes
the manifest first (settings, labels, file list; "complete": false) and completes it at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from sit_vit5.data import (
    CACHE_FORMAT,
    FILES_NAME,
    LABELS_NAME,
    MANIFEST_NAME,
    ImageFolderDataset,
    UnreadableImageError,
)
from sit_vit5.distributed import LaunchError, describe_group, join_launcher_group
from sit_vit5.io import atomic_write_text
from sit_vit5.vae import SD_VAE_SCALING_FACTOR, encode_moments, load_vae

# float16 halves disk and page-cache use at a relative rounding of ≤ 4.9e-4 (std values below 6e-5 keep
# ~6e-8 absolute precision as subnormals); --dtype float32 stores the moments exactly
STORAGE_DTYPES = {"float16": np.float16, "float32": np.float32}
VAE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# manifest keys that must agree between an existing partial cache and a rerun
SETTINGS_KEYS = ("num_images", "files_sha256", "classes", "image_size", "vae", "scaling_factor", "dtype",
                 "shard_size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sit_vit5.cache_latents", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="ImageFolder root: <data-dir>/<class>/<image>")
    p.add_argument("--out", required=True, help="cache directory (created; rerun with it to resume)")
    p.add_argument("--vae", default="stabilityai/sd-vae-ft-ema",
                   help="hub id (stabilityai/sd-vae-ft-ema or -mse) or a local diffusers AutoencoderKL dir")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="images per VAE call (each also flipped)")
    p.add_argument("--shard-size", type=int, default=10000, help="images per shard file")
    p.add_argument("--scaling-factor", type=float, default=SD_VAE_SCALING_FACTOR)
    p.add_argument("--dtype", choices=STORAGE_DTYPES, default="float16", help="storage dtype of mean and std")
    p.add_argument("--vae-dtype", choices=VAE_DTYPES, default="float32", help="precision the VAE runs in")
    p.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 1), help="image decoders")
    p.add_argument("--cpu", action="store_true", help="CPU even with GPUs (automatic without)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unreadable images (listed in the manifest; the dataset omits them)")
    args = p.parse_args(argv)
    for name in ("image_size", "batch_size", "shard_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


class _CropItems(Dataset):
    """Images [start, stop) of an ImageFolderDataset, center-cropped, unflipped: (index, image|None, err)."""

    def __init__(self, images: ImageFolderDataset, start: int, stop: int, skip_bad: bool):
        self.images, self.start, self.stop, self.skip_bad = images, start, stop, skip_bad

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None, str]:
        index = self.start + i
        try:
            return index, self.images.read(index), ""
        except UnreadableImageError as err:
            if not self.skip_bad:
                raise
            return index, None, str(err)


def _collate(items: list[tuple[int, torch.Tensor | None, str]]):
    good = [(i, x) for i, x, _ in items if x is not None]
    bad = [(i, msg) for i, x, msg in items if x is None]
    index = torch.tensor([i for i, _ in good], dtype=torch.long)
    images = torch.stack([x for _, x in good]) if good else None
    return index, images, bad


def latent_shape_of(vae, image_size: int) -> tuple[int, int, int]:
    """(C, h, w) the AutoencoderKL gives for image_size² inputs: it downsamples by 2 per extra block."""
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if image_size % factor:
        raise ValueError(f"--image-size {image_size} is not a multiple of the VAE's downsampling {factor}")
    return (vae.config.latent_channels, image_size // factor, image_size // factor)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))  # readers see the old or the new file, never half of one


def _shard_entries(num_images: int, shard_size: int) -> list[dict[str, Any]]:
    entries = []
    for k, start in enumerate(range(0, num_images, shard_size)):
        name = f"shard_{k:05d}"
        entries.append({"name": name, "mean": f"{name}.mean.npy", "std": f"{name}.std.npy",
                        "start": start, "stop": min(start + shard_size, num_images)})
    return entries


def _check_settings(out: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest (if any), after checking that it was made with the same settings."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != CACHE_FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r} isn't {CACHE_FORMAT!r}; use a new --out")
    diff = [f"{k}: cache has {manifest.get(k)!r}, this run {settings[k]!r}"
            for k in SETTINGS_KEYS if manifest.get(k) != settings[k] and k != "files_sha256"]
    if manifest.get("files_sha256") != settings["files_sha256"]:
        diff.append("the image file list differs")
    if diff:
        raise ValueError(f"{out} holds a cache made with other settings ({'; '.join(diff)}); "
                         "rerun with the original arguments or choose a new --out")
    return manifest


def _encode_shard(vae, images: ImageFolderDataset, entry: dict[str, Any], out: Path, args: argparse.Namespace,
                  latent_shape: tuple[int, ...], progress: tqdm) -> None:
    start, stop = entry["start"], entry["stop"]
    dtype = STORAGE_DTYPES[args.dtype]
    shape = (stop - start, 2, *latent_shape)
    tmp = {key: out / (entry[key] + ".tmp") for key in ("mean", "std")}
    arrays = {key: np.lib.format.open_memmap(tmp[key], mode="w+", dtype=dtype, shape=shape) for key in tmp}
    loader = DataLoader(_CropItems(images, start, stop, args.skip_bad), batch_size=args.batch_size,
                        num_workers=args.num_workers, collate_fn=_collate, pin_memory=torch.cuda.is_available())
    bad: list[int] = []
    for index, x, skipped in loader:
        for i, msg in skipped:
            tqdm.write(f"skipping {msg}")
            bad.append(i)
        if x is not None:
            both = torch.cat([x, x.flip(-1)])  # original and mirrored in one VAE call
            mean, std = encode_moments(vae, both, args.scaling_factor)
            rows = (index - start).numpy()
            for key, value in (("mean", mean), ("std", std)):
                value = value.view(2, len(x), *latent_shape).transpose(0, 1)  # [B, 2, C, h, w]
                arrays[key][rows] = value.cpu().numpy().astype(dtype)
        progress.update(len(index) + len(skipped))
    for key in tmp:
        array = arrays.pop(key)
        array.flush()
        del array  # the last reference: closes the memmap
        os.replace(tmp[key], out / entry[key])
    _write_json(out / f"{entry['name']}.done", {"start": start, "stop": stop, "bad": bad})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:  # the launcher's group (gloo without GPUs), else every process would encode every shard
        state = join_launcher_group(cpu=args.cpu)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if state.is_main_process:
        print(f"latent cache on {describe_group(state.num_processes, state.device)}", flush=True)
    out = Path(args.out)
    images = ImageFolderDataset(args.data_dir, args.image_size, random_flip=False, skip_bad=args.skip_bad)
    files_text = "".join(f"{f}\n" for f in images.files)
    vae_id = args.vae if not os.path.isdir(args.vae) else str(Path(args.vae).resolve())
    settings = {"format": CACHE_FORMAT, "complete": False, "num_images": len(images),
                "files_sha256": hashlib.sha256(files_text.encode()).hexdigest(), "classes": images.classes,
                "image_size": args.image_size, "vae": vae_id, "scaling_factor": args.scaling_factor,
                "dtype": args.dtype, "shard_size": args.shard_size,
                "data_dir": str(Path(args.data_dir).resolve())}
    existing = _check_settings(out, settings)  # every rank checks, so a mismatch stops all of them
    vae = load_vae(args.vae, device=state.device, dtype=VAE_DTYPES[args.vae_dtype])
    latent_shape = latent_shape_of(vae, args.image_size)
    entries = _shard_entries(len(images), args.shard_size)
    if state.is_main_process and existing is None:
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / LABELS_NAME, images.labels)
        (out / FILES_NAME).write_text(files_text)
        _write_json(out / MANIFEST_NAME, {**settings, "latent_shape": list(latent_shape), "shards": entries,
                                          "labels": LABELS_NAME, "files": FILES_NAME, "bad_indices": []})
    state.wait_for_everyone()
    pending = [e for e in entries if not (out / f"{e['name']}.done").is_file()]
    state.wait_for_everyone()  # every rank has listed the pending shards before any rank adds a marker
    mine = pending[state.process_index :: state.num_processes]
    print(f"process {state.process_index}/{state.num_processes}: shards {[e['name'][6:] for e in mine]} "
          f"of {len(pending)} pending", flush=True)
    desc = f"encoding {len(pending)}/{len(entries)} shards on {state.num_processes} process(es)"
    with tqdm(total=sum(e["stop"] - e["start"] for e in mine), unit="img", desc=desc,
              disable=not state.is_main_process) as bar:
        for entry in mine:
            _encode_shard(vae, images, entry, out, args, latent_shape, bar)
    state.wait_for_everyone()
    if state.is_main_process:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        markers = [out / f"{e['name']}.done" for e in entries]
        missing = [m.name for m in markers if not m.is_file()]
        if missing:
            raise RuntimeError(f"{len(missing)} shard(s) of {out} lack a done marker: {missing[:5]}; rerun")
        manifest["bad_indices"] = sorted(i for m in markers for i in json.loads(m.read_text())["bad"])
        manifest["complete"] = True
        _write_json(out / MANIFEST_NAME, manifest)
        print(f"latent cache complete: {out} ({len(images)} images, {len(manifest['bad_indices'])} skipped, "
              f"latents {list(latent_shape)})")
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
