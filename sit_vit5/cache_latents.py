"""Encode an image folder once into a sharded, memory-mappable cache of SD-VAE posterior moments.

    python -m sit_vit5.cache_latents --data-dir /data/imagenet/train --out /data/latents/in256 \
        --vae stabilityai/sd-vae-ft-ema --image-size 256 --batch-size 64 --shard-size 10000
    accelerate launch -m sit_vit5.cache_latents ...          # one process per GPU
    python -m sit_vit5.cache_latents --verify --out /data/latents/in256   # check every byte

For every image (ADM center crop) and its horizontal flip the cache stores the posterior mean and
std, multiplied by the scaling factor; training draws mean + std·ε
(sit_vit5.data.LatentCacheDataset, which also documents the file layout). Shard k holds images
[k·shard_size, (k+1)·shard_size); pending shards are dealt round-robin to the processes. A shard's
arrays are written under temporary names (``.tmp-<pid>-*``, removed on an error and swept by the
next run after a kill), fsynced and renamed into place, then its `.done` marker records their
SHA-256, so an interrupted run leaves no half shard and a rerun with the same arguments encodes only
the shards without a marker (with any number of processes). Rank 0 writes the manifest first
(settings, labels, file list; "complete": false) and completes it at the end.

The manifest records a digest of every input that decides the output: the image list with each
file's size, the VAE's config and weights (SHA-256 of its state dict as loaded: ≈ 1 s for the
SD-VAE) and every setting. A rerun onto a cache made from other inputs is refused, naming what
changed.

Exit status: 0 done; 2 bad input (one line naming the file, flag or value; SIT_VIT5_DEBUG=1 shows
the traceback); 130 interrupted (rerun the same command to continue).
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
    FILE_SIZES_NAME,
    FILES_NAME,
    LABELS_NAME,
    MANIFEST_NAME,
    CacheMismatchError,
    ImageFolderDataset,
    IncompleteCacheError,
    TooSmallImageError,
    UnreadableImageError,
    read_manifest,
    verify_cache,
)
from sit_vit5.distributed import LaunchError, describe_group, join_launcher_group
from sit_vit5.errors import KNOWN_ERRORS, SitVit5Error, run_cli
from sit_vit5.io import (
    TMP_PREFIX,
    atomic_write,
    atomic_write_text,
    payload_sha256,
    sha256_file,
    unwritable_dir_reason,
)
from sit_vit5.vae import SD_VAE_SCALING_FACTOR, downsampling_factor, encode_moments, load_vae

PROG = "python -m sit_vit5.cache_latents"
# float16 halves disk and page-cache use at a relative rounding of ≤ 4.9e-4 (std values below 6e-5
# keep ~6e-8 absolute precision as subnormals); --dtype float32 stores the moments exactly
STORAGE_DTYPES = {"float16": np.float16, "float32": np.float32}
VAE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# manifest keys that must agree between an existing partial cache and a rerun (with the inputs'
# digests); --skip-bad and --min-image-side may change on a rerun: they only choose what is skipped
SETTINGS_KEYS = (
    "num_images",
    "files_sha256",
    "file_sizes_sha256",
    "classes",
    "image_size",
    "vae",
    "vae_config_sha256",
    "vae_weights_sha256",
    "vae_dtype",
    "scaling_factor",
    "dtype",
    "shard_size",
)
# an image whose short side is below this is refused (or skipped with --skip-bad): upscaling a 1×1
# or 4×4 file to 256 px invents the picture; ImageNet's smallest images are far above it
MIN_IMAGE_SIDE = 8


class CacheArgumentError(SitVit5Error, ValueError):
    """A flag value the cache writer cannot use (an image size the VAE cannot encode, an --out that
    cannot be a folder); the message names the flag and value."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument(
        "--data-dir", help="ImageFolder root: <data-dir>/<class>/<image> (required to encode)"
    )
    p.add_argument(
        "--out", required=True, help="cache directory (created; rerun with it to resume)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="only check the complete cache at --out: layout, SHA-256 and finite values "
        "(≈ 0.5 s per GB once in the page cache)",
    )
    p.add_argument(
        "--vae",
        default="stabilityai/sd-vae-ft-ema",
        help="hub id (stabilityai/sd-vae-ft-ema or -mse) or a local diffusers AutoencoderKL dir",
    )
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument(
        "--batch-size", type=int, default=64, help="images per VAE call (each also flipped)"
    )
    p.add_argument("--shard-size", type=int, default=10000, help="images per shard file")
    p.add_argument("--scaling-factor", type=float, default=SD_VAE_SCALING_FACTOR)
    p.add_argument(
        "--dtype", choices=STORAGE_DTYPES, default="float16", help="storage dtype of mean and std"
    )
    p.add_argument(
        "--vae-dtype", choices=VAE_DTYPES, default="float32", help="precision the VAE runs in"
    )
    p.add_argument(
        "--num-workers", type=int, default=min(8, os.cpu_count() or 1), help="image decoders"
    )
    p.add_argument("--cpu", action="store_true", help="CPU even with GPUs (automatic without)")
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip unreadable or too small images (each reported, listed in the manifest; "
        "the dataset omits them)",
    )
    p.add_argument(
        "--min-image-side",
        type=int,
        default=MIN_IMAGE_SIDE,
        help=f"refuse images whose short side is below this many pixels (default "
        f"{MIN_IMAGE_SIDE}; 0 accepts any size, upscaled by the ADM crop)",
    )
    args = p.parse_args(argv)
    if not args.verify and args.data_dir is None:
        p.error("the following arguments are required: --data-dir (or --verify)")
    for name in ("image_size", "batch_size", "shard_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.min_image_side < 0:
        p.error(f"--min-image-side must be >= 0, got {args.min_image_side}")
    return args


class _CropItems(Dataset):
    """Images [start, stop) of an ImageFolderDataset, center-cropped, unflipped:
    (index, image | None, error message)."""

    def __init__(self, images: ImageFolderDataset, start: int, stop: int, skip_bad: bool):
        self.images, self.start, self.stop, self.skip_bad = images, start, stop, skip_bad

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None, str]:
        index = self.start + i
        try:
            return index, self.images.read(index), ""
        except UnreadableImageError as err:
            if self.skip_bad:
                return index, None, str(err)
            small = isinstance(err, TooSmallImageError)
            hint = (
                "pass --skip-bad to skip it, or --min-image-side with a smaller value to accept it"
                if small
                else "pass --skip-bad to skip unreadable images"
            )
            raise type(err)(f"{err}; {hint}", err.path) from None


def _collate(items: list[tuple[int, torch.Tensor | None, str]]):
    good = [(i, x) for i, x, _ in items if x is not None]
    bad = [(i, msg) for i, x, msg in items if x is None]
    index = torch.tensor([i for i, _ in good], dtype=torch.long)  # on cpu: collate, in the loader worker
    images = torch.stack([x for _, x in good]) if good else None
    return index, images, bad


def latent_shape_of(vae, image_size: int) -> tuple[int, int, int]:
    """(C, h, w) the AutoencoderKL gives for image_size² inputs (it downsamples by 2 per extra
    block); CacheArgumentError when image_size is not a multiple of that factor."""
    factor = downsampling_factor(vae)
    if image_size % factor:
        lower, upper = image_size // factor * factor, (image_size // factor + 1) * factor
        raise CacheArgumentError(
            f"--image-size {image_size} is not a multiple of the VAE's downsampling "
            f"factor {factor}; use {lower or upper} or {upper}"
        )
    return (vae.config.latent_channels, image_size // factor, image_size // factor)


def vae_digests(vae) -> dict[str, str]:
    """SHA-256 of the VAE's config (public keys) and of its weights as loaded (``payload_sha256`` of
    the state dict: independent of the file format the weights came in)."""
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    text = json.dumps(config, sort_keys=True, default=str)
    return {
        "vae_config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "vae_weights_sha256": payload_sha256(vae.state_dict()),
    }


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(
        path, json.dumps(obj, indent=1)
    )  # readers see the old or the new file, never half of one


def _shard_entries(num_images: int, shard_size: int) -> list[dict[str, Any]]:
    entries = []
    for k, start in enumerate(range(0, num_images, shard_size)):
        name = f"shard_{k:05d}"
        entries.append(
            {
                "name": name,
                "mean": f"{name}.mean.npy",
                "std": f"{name}.std.npy",
                "start": start,
                "stop": min(start + shard_size, num_images),
            }
        )
    return entries


def _file_list_change(out: Path, files: list[str], sizes: np.ndarray) -> str:
    """What differs between the cache's image list (files.txt, file_sizes.npy) and this run's, in
    words."""
    try:
        old = (out / FILES_NAME).read_text().splitlines()
    except OSError:
        return "the image file list differs"
    if old != files:
        added, removed = sorted(set(files) - set(old)), sorted(set(old) - set(files))
        parts = [
            f"{len(added)} added (e.g. {added[0]})" if added else "",
            f"{len(removed)} removed (e.g. {removed[0]})" if removed else "",
        ]
        return "the image file list differs: " + (
            ", ".join(p for p in parts if p) or "another order"
        )
    try:
        old_sizes = np.load(out / FILE_SIZES_NAME)
    except (OSError, ValueError):
        return "the image files' sizes differ"
    changed = np.flatnonzero(old_sizes != sizes) if old_sizes.shape == sizes.shape else [0]
    first = int(changed[0]) if len(changed) else 0
    then = int(old_sizes[first]) if first < len(old_sizes) else "?"
    return (
        f"{len(changed)} image file(s) changed since they were encoded (e.g. {files[first]}: "
        f"{then} bytes then, {int(sizes[first])} now)"
    )


def _check_settings(
    out: Path, settings: dict[str, Any], files: list[str], sizes: np.ndarray
) -> dict[str, Any] | None:
    """The existing manifest (if any), after checking that it was made from the same inputs and
    settings; CacheMismatchError naming each difference (on one line) otherwise."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(out)  # CorruptCacheError if unreadable
    diff = []
    for key in SETTINGS_KEYS:
        if key in ("files_sha256", "file_sizes_sha256") or manifest.get(key) == settings[key]:
            continue
        if key not in manifest:
            diff.append(f"the cache does not record {key} (written by an older version)")
        elif key.endswith("_sha256"):
            diff.append(
                f"{key}: the cache's inputs had {str(manifest[key])[:12]}, this run's "
                f"{settings[key][:12]}"
            )
        else:
            diff.append(f"{key}: cache has {manifest[key]!r}, this run {settings[key]!r}")
    if any(manifest.get(k) != settings[k] for k in ("files_sha256", "file_sizes_sha256")):
        diff.append(_file_list_change(out, files, sizes))
    if diff:
        raise CacheMismatchError(
            f"{out} holds a cache made from other inputs or settings "
            f"({'; '.join(diff)}); rerun with the original arguments and inputs, or "
            "choose a new --out"
        )
    return manifest


def _sweep_temporaries(out: Path) -> list[str]:
    """Remove what a killed writer left: ``.tmp-*`` files (and the ``*.npy.tmp`` of earlier
    versions). Only called while no process of this run writes (before the first barrier)."""
    stale = [*out.glob(f"{TMP_PREFIX}*"), *out.glob("*.npy.tmp")]
    for path in stale:
        path.unlink(missing_ok=True)
    return sorted(path.name for path in stale)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _encode_shard(
    vae,
    images: ImageFolderDataset,
    entry: dict[str, Any],
    out: Path,
    args: argparse.Namespace,
    latent_shape: tuple[int, ...],
    progress: tqdm,
) -> None:
    start, stop = entry["start"], entry["stop"]
    dtype = STORAGE_DTYPES[args.dtype]
    shape = (stop - start, 2, *latent_shape)
    tmp = {key: out / f"{TMP_PREFIX}{os.getpid()}-{entry[key]}" for key in ("mean", "std")}
    arrays: dict[str, np.ndarray] = {}
    bad: list[int] = []
    reasons: list[str] = []
    try:
        for key in tmp:
            arrays[key] = np.lib.format.open_memmap(tmp[key], mode="w+", dtype=dtype, shape=shape)
        loader = DataLoader(
            _CropItems(images, start, stop, args.skip_bad),
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            collate_fn=_collate,
            pin_memory=torch.cuda.is_available(),
        )
        for index, x, skipped in loader:
            for i, msg in skipped:
                tqdm.write(f"skipping {msg}", file=sys.stderr)
                bad.append(i)
                reasons.append(msg)
            if x is not None:
                both = torch.cat([x, x.flip(-1)])  # original and mirrored in one VAE call
                mean, std = encode_moments(vae, both, args.scaling_factor)
                rows = (index - start).numpy()
                for key, value in (("mean", mean), ("std", std)):
                    value = value.view(2, len(x), *latent_shape).transpose(0, 1)  # [B, 2, C, h, w]
                    arrays[key][rows] = value.cpu().numpy().astype(dtype)
            progress.update(len(index) + len(skipped))
        digests = {}
        for key in tmp:
            array = arrays.pop(key)
            array.flush()
            del array  # the last reference: closes the memmap
            _fsync(tmp[key])  # on disk before the rename: a power loss leaves no renamed half file
            digests[key] = sha256_file(
                tmp[key]
            )  # from the page cache: ≈ 0.3 s per 10,000-image shard
        for key in tmp:
            os.replace(tmp[key], out / entry[key])
    except BaseException:
        arrays.clear()
        for path in tmp.values():
            path.unlink(missing_ok=True)  # an error or Ctrl-C leaves no temporary behind
        raise
    _write_json(
        out / f"{entry['name']}.done",
        {"start": start, "stop": stop, "bad": bad, "bad_reasons": reasons, "sha256": digests},
    )


def _verify(out: Path) -> int:
    result = verify_cache(out)
    print(
        f"latent cache {out} verified: {result['files']} shard files, "
        f"{result['bytes'] / 1e9:.3f} GB, sizes, SHA-256 and finite values ok "
        f"({result['seconds']:.1f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Encode (or with --verify check) a cache; raises the errors ``cli`` reports on one line."""
    args = parse_args(argv)
    out = Path(args.out)
    if args.verify:
        return _verify(out)
    state = join_launcher_group(
        cpu=args.cpu
    )  # the launcher's group (gloo without GPUs), else every
    if state.is_main_process:  # process would encode every shard
        print(f"latent cache on {describe_group(state.num_processes, state.device)}", flush=True)
    reason = unwritable_dir_reason(out)
    if reason is not None:
        raise CacheArgumentError(f"--out {out}: cannot be the cache folder ({reason})")
    images = ImageFolderDataset(
        args.data_dir,
        args.image_size,
        random_flip=False,
        skip_bad=args.skip_bad,
        min_side=args.min_image_side,
    )
    files_text = "".join(f"{f}\n" for f in images.files)
    sizes = np.asarray([os.stat(images.root / f).st_size for f in images.files], dtype=np.int64)
    vae = load_vae(args.vae, device=state.device, dtype=VAE_DTYPES[args.vae_dtype],
                   key="--vae")
    latent_shape = latent_shape_of(vae, args.image_size)
    vae_id = args.vae if not os.path.isdir(args.vae) else str(Path(args.vae).resolve())
    settings = {
        "format": CACHE_FORMAT,
        "complete": False,
        "num_images": len(images),
        "files_sha256": hashlib.sha256(files_text.encode()).hexdigest(),
        "file_sizes_sha256": hashlib.sha256(sizes.tobytes()).hexdigest(),
        "classes": images.classes,
        "image_size": args.image_size,
        "vae": vae_id,
        **vae_digests(vae),
        "vae_dtype": args.vae_dtype,
        "scaling_factor": args.scaling_factor,
        "dtype": args.dtype,
        "shard_size": args.shard_size,
        "data_dir": str(Path(args.data_dir).resolve()),
    }
    existing = _check_settings(
        out, settings, images.files, sizes
    )  # every rank checks: all of them stop
    entries = _shard_entries(len(images), args.shard_size)
    if state.is_main_process:
        if existing is None:
            out.mkdir(parents=True, exist_ok=True)
            # each written whole or not at all (the manifest, which names them, comes after them)
            atomic_write(out / LABELS_NAME, lambda f: np.save(f, images.labels))
            atomic_write(out / FILE_SIZES_NAME, lambda f: np.save(f, sizes))
            atomic_write_text(out / FILES_NAME, files_text)
            _write_json(
                out / MANIFEST_NAME,
                {
                    **settings,
                    "latent_shape": list(latent_shape),
                    "shards": entries,
                    "labels": LABELS_NAME,
                    "files": FILES_NAME,
                    "file_sizes": FILE_SIZES_NAME,
                    "bad_indices": [],
                },
            )
        swept = _sweep_temporaries(out)
        if swept:
            print(
                f"removed {len(swept)} temporary file(s) of an interrupted run: "
                f"{', '.join(swept[:4])}",
                flush=True,
            )
    state.wait_for_everyone()
    pending = [e for e in entries if not (out / f"{e['name']}.done").is_file()]
    state.wait_for_everyone()  # every rank has listed the pending shards before any adds a marker
    mine = pending[state.process_index :: state.num_processes]
    print(
        f"process {state.process_index}/{state.num_processes}: shards "
        f"{[e['name'][6:] for e in mine]} of {len(pending)} pending",
        flush=True,
    )
    desc = f"encoding {len(pending)}/{len(entries)} shards on {state.num_processes} process(es)"
    with tqdm(
        total=sum(e["stop"] - e["start"] for e in mine),
        unit="img",
        desc=desc,
        disable=not state.is_main_process,
    ) as bar:
        for entry in mine:
            _encode_shard(vae, images, entry, out, args, latent_shape, bar)
    state.wait_for_everyone()
    if state.is_main_process:
        _complete(out, entries, len(images), latent_shape)
    state.wait_for_everyone()
    return 0


def _complete(
    out: Path, entries: list[dict[str, Any]], num_images: int, latent_shape: tuple[int, ...]
) -> None:
    """Mark the manifest complete, with the skipped images and each shard's digests from its
    marker."""
    manifest = read_manifest(out)
    markers = [out / f"{e['name']}.done" for e in entries]
    missing = [m.name for m in markers if not m.is_file()]
    if missing:
        raise IncompleteCacheError(
            f"{len(missing)} shard(s) of {out} lack a done marker: {missing[:5]}; "
            "rerun the same command"
        )
    done = [json.loads(m.read_text()) for m in markers]
    manifest["bad_indices"] = sorted(i for d in done for i in d["bad"])
    manifest["bad_files"] = [reason for d in done for reason in d.get("bad_reasons", [])]
    for entry, marker in zip(manifest["shards"], done, strict=True):
        entry["sha256"] = marker.get("sha256", {})
    manifest["complete"] = True
    _write_json(out / MANIFEST_NAME, manifest)
    skipped = manifest["bad_files"]
    listed = (
        ": " + "; ".join(skipped[:3]) + ("; ..." if len(skipped) > 3 else "") if skipped else ""
    )
    print(
        f"latent cache complete: {out} ({num_images} images, {len(manifest['bad_indices'])} skipped"
        f"{listed}, latents {list(latent_shape)})"
    )


def cli(argv: list[str] | None = None) -> int:
    """``main`` with the errors a user can fix reported on one line (exit 2), Ctrl-C as exit 130."""
    return run_cli(PROG, lambda: main(argv), errors=(*KNOWN_ERRORS, LaunchError), resumable=True)


if __name__ == "__main__":
    sys.exit(cli())
