"""The latent cache: VAE posterior moments of an image folder in memory-mappable shards: its
format, writer (``CacheWriter``), reader (``LatentCacheDataset``) and ``verify_cache``; the
command line is ``python -m sit_vit5.cache_latents``.

Layout (in ``cache_dir``):
    manifest.json         settings, classes, latent shape, normalisation, VAE id, shard ranges,
                          latent_stats (per-channel mean / std of the posterior means, both flips)
    labels.npy            int64 [num_images], class index of each image
    files.txt             one image path per line (relative to the data dir), index order
    file_sizes.npy        int64 [num_images], byte size of each image when it was encoded
    shard_NNNNN.mean.npy  [n, 2, C, h, w] (posterior mean − shift) × scale; [:, 1] = flipped image
    shard_NNNNN.std.npy   [n, 2, C, h, w] posterior std × scaling factor
    shard_NNNNN.done      JSON marker with the arrays' SHA-256 (resume skips these shards)

Training draws mean + std·ε. A shard is written under temporary names, fsynced, renamed, then
marked done, so a killed run leaves no half shard and a rerun encodes only unmarked shards. The
manifest records digests of every input (image list and sizes, VAE config and weights, settings);
a rerun onto a cache made from other inputs is refused, naming what changed. Reads are checked
(layout at open, NaN / inf per item); a failure raises CorruptCacheError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .datasets import DataRootError, EpochDataset, item_generator
from .image_data import ImageFolderDataset, TooSmallImageError, UnreadableImageError, read_image
from .latent_norm import LatentNorm
from .utils.atomic_files import TMP_PREFIX, atomic_write, atomic_write_text, unwritable_dir_reason
from .utils.checksums import payload_sha256, sha256_file
from .utils.errors import ConfigError, SitVit5Error
from .vae import downsampling_factor, encode_moments, load_vae

if TYPE_CHECKING:
    from accelerate import PartialState
    from diffusers import AutoencoderKL

# ----------------------------------------------------------------------------- format

CACHE_FORMAT = "sit_vit5.latent_cache/1"
MANIFEST_NAME = "manifest.json"
LABELS_NAME = "labels.npy"
FILES_NAME = "files.txt"
FILE_SIZES_NAME = "file_sizes.npy"
# float16 halves disk and page-cache use at a relative rounding of ≤ 4.9e-4 (std values below 6e-5
# keep ~6e-8 absolute precision as subnormals); --dtype float32 stores the moments exactly
STORAGE_DTYPES = {"float16": np.float16, "float32": np.float32}
VAE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# manifest keys that must agree between an existing partial cache and a rerun (with the inputs'
# digests); --skip-bad and --min-image-side may change on a rerun: they only choose what is skipped
SETTINGS_KEYS = ("num_images", "files_sha256", "file_sizes_sha256", "classes", "image_size", "vae",
                 "vae_config_sha256", "vae_weights_sha256", "vae_dtype", "scaling_factor",
                 "shift_factor", "dtype", "shard_size")
#: how the writer's messages name the normalisation (its command line's flags)
CLI_KEYS = {"scaling_factor": "--scaling-factor", "shift_factor": "--shift-factor",
            "latent_stats": "vae.latent_stats"}


class IncompleteCacheError(DataRootError, RuntimeError):
    """A latent cache whose writer has not finished."""


class CorruptCacheError(SitVit5Error, ValueError):
    """A cache file that does not hold what the manifest says (missing, truncated, wrong shape or
    dtype, NaN / inf, another SHA-256); the message names the file."""


class CacheMismatchError(SitVit5Error, ValueError):
    """A latent cache that does not fit the run (other image size, or other inputs than the run
    resuming it); the message names the value that differs."""


# ----------------------------------------------------------------------------- reader and verifier

#: manifest keys every reader relies on
MANIFEST_KEYS = ("num_images", "classes", "image_size", "vae", "scaling_factor", "dtype", "shards",
                 "labels", "latent_shape")
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}


def reencode_hint(cache_dir: str | os.PathLike, shard: str) -> str:
    """How to rebuild one shard: the writer re-encodes every shard without a .done marker."""
    return (f"delete {Path(cache_dir) / (shard + '.done')} and rerun "
            f"`python -m sit_vit5.cache_latents` with the cache's arguments (--out {cache_dir}) to "
            "re-encode it")


def read_manifest(cache_dir: str | os.PathLike) -> dict[str, Any]:
    """The cache's manifest.json; errors name the directory and how to create the cache."""
    path = Path(cache_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataRootError(
            f"no latent cache at {cache_dir} ({MANIFEST_NAME} missing); create one with "
            f"`python -m sit_vit5.cache_latents --data-dir <imagenet/train> --out {cache_dir}`")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as err:  # written atomically: damaged from outside
        raise CorruptCacheError(f"{path}: not valid JSON ({err}); re-create the cache in a new "
                                "--out") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CorruptCacheError(f"{path}: format {found!r}, expected {CACHE_FORMAT!r}")
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        raise CorruptCacheError(f"{path}: lacks {', '.join(missing)}; re-create the cache in a new "
                                "--out")
    return manifest


def stored_norm(manifest: dict[str, Any]) -> LatentNorm:
    """How a cache's moments are normalised: its ``scaling_factor`` and ``shift_factor`` (numbers;
    a manifest from before shift_factor has none)."""
    return LatentNorm(float(manifest["scaling_factor"]), manifest.get("shift_factor"))


def npy_layout(path: str | os.PathLike) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, implied file size in bytes) from an .npy header; CorruptCacheError naming
    the file when it is missing or has no readable header."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in _NPY_HEADERS:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, _, dtype = _NPY_HEADERS[version](f)
            offset = f.tell()
    except FileNotFoundError:
        raise CorruptCacheError(f"{path} is missing") from None
    except (OSError, ValueError, EOFError) as err:
        raise CorruptCacheError(f"{path}: not a readable .npy file ({err})") from None
    return tuple(shape), dtype, offset + math.prod(shape) * dtype.itemsize


def check_npy(path: str | os.PathLike, shape: tuple[int, ...], dtype: np.dtype, hint: str) -> None:
    """Raise CorruptCacheError (naming ``path``, ending in ``hint``) unless the .npy file holds
    ``dtype`` ``shape`` and is exactly as long as its header says."""
    path = Path(path)
    try:
        found_shape, found_dtype, size = npy_layout(path)
    except CorruptCacheError as err:
        raise CorruptCacheError(f"{err}; {hint}") from None
    if found_shape != tuple(shape) or found_dtype != np.dtype(dtype):
        raise CorruptCacheError(f"{path}: holds {found_dtype} {list(found_shape)}, the manifest "
                                f"says {np.dtype(dtype)} {list(shape)}; {hint}")
    actual = path.stat().st_size
    if actual != size:
        kind = "truncated" if actual < size else "extra bytes"
        raise CorruptCacheError(f"{path}: {actual} bytes, its header ({found_dtype} "
                                f"{list(found_shape)}) needs {size} ({kind}); {hint}")


class LatentCacheDataset(EpochDataset):
    """Cached SD-VAE posteriors → (latent Tensor[C, h, w] float32, label); with `image_root` (the
    ImageFolder the cache was made from, for REPA) also the item's image Tensor[3, S, S] in [-1, 1],
    cropped as the writer did and flipped with the latent.

    latent = mean + std·ε (scaled moments) of the original or, with `random_flip` (p = 1/2), the
    flipped image; flip bit then ε from a generator seeded by (seed, epoch, index). Shards are
    memmapped lazily per process. Images the writer skipped are left out of `len`.

    Checked (CorruptCacheError naming the file): at open, every file's shape, dtype and size
    (headers only); per item, that mean and std are finite. With `image_root`
    (CacheMismatchError): files.txt's first and last image exist; per item, its byte size is
    unchanged since encoding.
    """

    def __init__(self, cache_dir: str | os.PathLike, random_flip: bool = True, seed: int = 0,
                 image_root: str | os.PathLike | None = None):
        self.cache_dir = Path(cache_dir)
        manifest = read_manifest(self.cache_dir)
        if not manifest.get("complete"):
            shards = manifest["shards"]
            done = sum((self.cache_dir / f"{s['name']}.done").is_file() for s in shards)
            raise IncompleteCacheError(
                f"latent cache {self.cache_dir} is incomplete ({done}/{len(shards)} shards done); "
                f"rerun the same `python -m sit_vit5.cache_latents ... --out {self.cache_dir}` "
                "to resume")
        self.manifest = manifest
        self.classes: list[str] = manifest["classes"]
        self.latent_shape = tuple(manifest["latent_shape"])
        # how the stored moments are normalised, and how this reader returns them
        self.norm = self.target_norm = stored_norm(manifest)
        self._affine: tuple[torch.Tensor, torch.Tensor] | None = None  # stored → target
        self.vae = manifest["vae"]
        self.image_size = int(manifest["image_size"])
        self.random_flip = random_flip
        self.seed = seed
        self.epoch = 0
        self._check_files()
        self.labels = np.load(self.cache_dir / manifest["labels"])
        self._starts = np.asarray([s["start"] for s in manifest["shards"]], dtype=np.int64)
        valid = np.ones(manifest["num_images"], dtype=bool)
        valid[np.asarray(manifest.get("bad_indices", []), dtype=np.int64)] = False
        self._indices = np.flatnonzero(valid)  # dataset index → cache index
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.image_root = None if image_root is None else Path(image_root)
        if self.image_root is not None:
            self._files, self._file_sizes = self._check_images()

    def _check_images(self) -> tuple[list[str], np.ndarray]:
        """files.txt and file_sizes.npy of the cache, after checking that `image_root` holds its
        first and last image (the per-read size check covers the rest)."""
        root, n = self.image_root, int(self.manifest["num_images"])
        if not root.is_dir():
            raise DataRootError(f"data.image_root={root} is not a folder: point it at the "
                                f"ImageFolder the latent cache {self.cache_dir} was made from")
        listing = self.cache_dir / self.manifest.get("files", FILES_NAME)
        try:
            files = listing.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise CorruptCacheError(f"{listing}: cannot be read ({err}); it names the images "
                                    "the cache was made from: re-create the cache in a new --out"
                                    ) from None
        sizes_path = self.cache_dir / self.manifest.get("file_sizes", FILE_SIZES_NAME)
        check_npy(sizes_path, (n,), np.dtype(np.int64), "re-create the cache in a new --out")
        if len(files) != n:
            raise CorruptCacheError(f"{listing}: {len(files)} lines for the manifest's {n} images; "
                                    "re-create the cache in a new --out")
        for i in {int(self._indices[0]), int(self._indices[-1])} if len(self._indices) else ():
            if not (root / files[i]).is_file():
                raise CacheMismatchError(
                    f"data.image_root={root} has no {files[i]}, an image of the latent cache "
                    f"{self.cache_dir} ({listing.name}): point it at the folder the cache was made "
                    "from")
        return files, np.load(sizes_path)

    def image(self, index: int, flip: int) -> torch.Tensor:
        """Item `index`'s image as the writer cropped it, mirrored when `flip` is 1: Tensor[3, S, S]
        in [-1, 1]. CacheMismatchError when the file's size changed since encoding."""
        i = int(self._indices[index])
        path = self.image_root / self._files[i]
        try:
            size = path.stat().st_size
        except OSError as err:
            raise UnreadableImageError(f"cannot read image {path}: {err}", path) from None
        if size != int(self._file_sizes[i]):
            raise CacheMismatchError(
                f"{path}: {size} bytes, {int(self._file_sizes[i])} when the latent cache "
                f"{self.cache_dir} encoded it: the image changed since; re-encode the cache or "
                "restore the image")
        image = read_image(path, self.image_size)
        return image.flip(-1) if flip else image

    def _check_files(self) -> None:
        """The layout checks of the class docstring (headers and sizes only; no data is read)."""
        manifest = self.manifest
        check_npy(self.cache_dir / manifest["labels"], (int(manifest["num_images"]),),
                  np.dtype(np.int64), "re-create the cache in a new --out")
        dtype = np.dtype(manifest["dtype"])
        for info in manifest["shards"]:
            shape = (info["stop"] - info["start"], 2, *self.latent_shape)
            for key in ("mean", "std"):
                check_npy(self.cache_dir / info[key], shape, dtype,
                          reencode_hint(self.cache_dir, info["name"]))

    def _sample_shape(self) -> tuple[int, int, int]:
        return self.latent_shape

    def normalize_to(self, norm: LatentNorm) -> None:
        """Return latents normalised by ``norm`` (the run's) instead of the stored normalisation:
        an exact affine map per item; nothing changes when they are equal."""
        norm.check_channels(self.latent_shape[0], f"the latent cache {self.cache_dir}")
        self.target_norm = norm
        self._affine = None if norm == self.norm else self.norm.affine_to(norm,
                                                                          self.latent_shape[0])

    def latent_stats(self) -> LatentNorm:
        """Per-channel standardisation from the manifest's ``latent_stats`` (the posterior means'
        mean and std, before any normalisation); ConfigError when the cache has none."""
        stats = self.manifest.get("latent_stats")
        if not isinstance(stats, dict):
            raise ConfigError(
                f"vae.latent_stats=cache, but the latent cache {self.cache_dir} records no "
                "latent_stats (written by an older version): rerun `python -m "
                f"sit_vit5.cache_latents` with its arguments (--out {self.cache_dir}) to add them")
        return LatentNorm.from_stats(stats["mean"], stats["std"])

    def __len__(self) -> int:
        return len(self._indices)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = {}  # memmaps are reopened in the receiving process instead of copied
        return state

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k not in self._arrays:
            info = self.manifest["shards"][k]
            arrays = []
            for key in ("mean", "std"):
                path = self.cache_dir / info[key]
                try:  # checked at open; a file changed since (in a worker) is still named
                    arrays.append(np.load(path, mmap_mode="r"))
                except (OSError, ValueError) as err:
                    hint = reencode_hint(self.cache_dir, info["name"])
                    raise CorruptCacheError(f"{path}: cannot be mapped ({err}); {hint}") from None
            self._arrays[k] = (arrays[0], arrays[1])
        return self._arrays[k]

    def _image_name(self, i: int) -> str:
        """The image file of cache index ``i`` (for messages), or "?" when files.txt cannot tell."""
        try:
            names = self.cache_dir / self.manifest.get("files", FILES_NAME)
            return names.read_text().splitlines()[i]
        except (OSError, IndexError, UnicodeDecodeError):
            return "?"

    def moments(self, index: int, flip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled (mean, std) float32 of item `index`; flip 1 = mirrored. CorruptCacheError
        naming the shard file when either holds NaN or inf."""
        i = int(self._indices[index])
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        mean, std = self._shard(k)
        row = i - int(self._starts[k])
        values = {"mean": np.array(mean[row, flip], dtype=np.float32),
                  "std": np.array(std[row, flip], dtype=np.float32)}
        for key, value in values.items():
            if not np.isfinite(value).all():
                info = self.manifest["shards"][k]
                raise CorruptCacheError(
                    f"{self.cache_dir / info[key]}: row {row} (image {i}, {self._image_name(i)}) "
                    f"holds NaN or inf: the cache is corrupt; "
                    f"{reencode_hint(self.cache_dir, info['name'])}")
        mean, std = torch.from_numpy(values["mean"]), torch.from_numpy(values["std"])
        if self._affine is None:
            return mean, std
        gain, offset = self._affine
        return mean * gain + offset, std * gain

    def __getitem__(self, index: int
                    ) -> tuple[torch.Tensor, int] | tuple[torch.Tensor, int, torch.Tensor]:
        gen = item_generator(self.seed, self.epoch, index)
        flip = int(torch.randint(2, (1,), generator=gen).item()) if self.random_flip else 0
        mean, std = self.moments(index, flip)
        latent = mean + std * torch.randn(mean.shape, generator=gen)  # on cpu: a loader item
        label = int(self.labels[self._indices[index]])
        if self.image_root is None:
            return latent, label
        return latent, label, self.image(index, flip)


def _recorded_digests(cache_dir: Path, info: dict[str, Any]) -> dict[str, str]:
    """The writer's SHA-256 per array ("mean", "std") of a shard: from the manifest, else its
    .done marker; {} when none was recorded."""
    if isinstance(info.get("sha256"), dict):
        return info["sha256"]
    try:
        marker = json.loads((cache_dir / f"{info['name']}.done").read_text())
    except (OSError, ValueError):
        return {}
    digests = marker.get("sha256") if isinstance(marker, dict) else None
    return digests if isinstance(digests, dict) else {}


def first_nonfinite_row(array: np.ndarray, chunk_rows: int = 256) -> int | None:
    """Index of the first row of ``array`` holding NaN or inf, or None (reads in chunks)."""
    for start in range(0, len(array), chunk_rows):
        block = np.asarray(array[start : start + chunk_rows])
        finite = np.isfinite(block.reshape(len(block), -1)).all(axis=1)
        if not finite.all():
            return start + int(np.flatnonzero(~finite)[0])
    return None


def verify_cache(cache_dir: str | os.PathLike) -> dict[str, Any]:
    """Check every byte of a complete cache: the layout, each shard's SHA-256 against the writer's
    (when recorded) and every value for NaN / inf. Raises CorruptCacheError listing the bad files;
    returns {"files", "bytes", "seconds"}. ≈ 1.7 s CPU per GB (`python -m bench.cache_checks`).
    """
    began = time.perf_counter()
    dataset = LatentCacheDataset(cache_dir, random_flip=False)
    problems: list[str] = []
    files = size = 0
    for info in dataset.manifest["shards"]:
        digests = _recorded_digests(dataset.cache_dir, info)
        for key in ("mean", "std"):
            path = dataset.cache_dir / info[key]
            files, size = files + 1, size + path.stat().st_size
            if digests.get(key) and sha256_file(path) != digests[key]:
                problems.append(f"{info[key]} (its SHA-256 differs from the one written with it)")
                continue
            row = first_nonfinite_row(np.load(path, mmap_mode="r"))
            if row is not None:
                problems.append(f"{info[key]} (NaN or inf from row {row})")
    if problems:
        raise CorruptCacheError(
            f"latent cache {dataset.cache_dir}: {len(problems)} corrupt file(s): "
            f"{'; '.join(problems[:8])}{'; ...' if len(problems) > 8 else ''}; delete the .done "
            "marker of each one's shard and rerun `python -m sit_vit5.cache_latents` with the "
            "cache's arguments to re-encode them")
    return {"files": files, "bytes": size, "seconds": time.perf_counter() - began}


# ----------------------------------------------------------------------------- writer


@dataclass(frozen=True)
class WriteOptions:
    """What the writer encodes with (the command line's flags of the same names)."""

    vae: str  # hub id or a local diffusers AutoencoderKL dir
    image_size: int
    batch_size: int  # images per VAE call (each also flipped)
    shard_size: int  # images per shard file
    scaling_factor: float  # stored moments: (posterior − shift_factor) × scaling_factor
    dtype: str  # storage dtype of mean and std: a key of STORAGE_DTYPES
    vae_dtype: str  # precision the VAE runs in: a key of VAE_DTYPES
    num_workers: int  # image decoders
    skip_bad: bool  # skip unreadable or too small images (listed in the manifest)
    min_image_side: int  # refuse images whose short side is below this many pixels
    shift_factor: float | None = None  # None = 0 (SD-VAE)

    @property
    def norm(self) -> LatentNorm:
        """The normalisation of the stored moments."""
        return LatentNorm(self.scaling_factor, self.shift_factor)


class _CropItems(Dataset):
    """Images [start, stop), center-cropped, unflipped: (index, image | None, error message)."""

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
            hint = ("pass --skip-bad to skip it, or --min-image-side with a smaller value to "
                    "accept it" if small else "pass --skip-bad to skip unreadable images")
            raise type(err)(f"{err}; {hint}", err.path) from None


def _collate(items: list[tuple[int, torch.Tensor | None, str]]):
    good = [(i, x) for i, x, _ in items if x is not None]
    bad = [(i, msg) for i, x, msg in items if x is None]
    index = torch.tensor([i for i, _ in good], dtype=torch.long)  # on cpu: collate (loader worker)
    images = torch.stack([x for _, x in good]) if good else None
    return index, images, bad


def latent_shape_of(vae: AutoencoderKL, image_size: int) -> tuple[int, int, int]:
    """(C, h, w) of the AutoencoderKL's latents for image_size² inputs; ConfigError when
    image_size is not a multiple of its downsampling factor."""
    factor = downsampling_factor(vae)
    if image_size % factor:
        lower, upper = image_size // factor * factor, (image_size // factor + 1) * factor
        raise ConfigError(f"--image-size {image_size} is not a multiple of the VAE's "
                          f"downsampling factor {factor}; use {lower or upper} or {upper}")
    return (vae.config.latent_channels, image_size // factor, image_size // factor)


def vae_digests(vae: AutoencoderKL) -> dict[str, str]:
    """SHA-256 of the VAE's config (public keys) and of its loaded state dict (any file format)."""
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    text = json.dumps(config, sort_keys=True, default=str)
    return {"vae_config_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "vae_weights_sha256": payload_sha256(vae.state_dict())}


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))  # readers never see half a file


def _shard_entries(num_images: int, shard_size: int) -> list[dict[str, Any]]:
    entries = []
    for k, start in enumerate(range(0, num_images, shard_size)):
        name = f"shard_{k:05d}"
        entries.append({"name": name, "mean": f"{name}.mean.npy", "std": f"{name}.std.npy",
                        "start": start, "stop": min(start + shard_size, num_images)})
    return entries


def _file_list_change(out: Path, files: list[str], sizes: np.ndarray) -> str:
    """What differs between the cache's image list (files.txt, sizes) and this run's, in words."""
    try:
        old = (out / FILES_NAME).read_text().splitlines()
    except OSError:
        return "the image file list differs"
    if old != files:
        added, removed = sorted(set(files) - set(old)), sorted(set(old) - set(files))
        parts = [f"{len(added)} added (e.g. {added[0]})" if added else "",
                 f"{len(removed)} removed (e.g. {removed[0]})" if removed else ""]
        return "the image file list differs: " + (", ".join(p for p in parts if p)
                                                  or "another order")
    try:
        old_sizes = np.load(out / FILE_SIZES_NAME)
    except (OSError, ValueError):
        return "the image files' sizes differ"
    changed = np.flatnonzero(old_sizes != sizes) if old_sizes.shape == sizes.shape else [0]
    first = int(changed[0]) if len(changed) else 0
    then = int(old_sizes[first]) if first < len(old_sizes) else "?"
    return (f"{len(changed)} image file(s) changed since they were encoded (e.g. {files[first]}: "
            f"{then} bytes then, {int(sizes[first])} now)")


def _check_settings(out: Path, settings: dict[str, Any], files: list[str],
                    sizes: np.ndarray) -> dict[str, Any] | None:
    """The existing manifest (if any), checked to come from the same inputs and settings;
    CacheMismatchError naming each difference otherwise."""
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
            diff.append(f"{key}: the cache's inputs had {str(manifest[key])[:12]}, this run's "
                        f"{settings[key][:12]}")
        else:
            diff.append(f"{key}: cache has {manifest[key]!r}, this run {settings[key]!r}")
    if any(manifest.get(k) != settings[k] for k in ("files_sha256", "file_sizes_sha256")):
        diff.append(_file_list_change(out, files, sizes))
    if diff:
        raise CacheMismatchError(f"{out} holds a cache made from other inputs or settings "
                                 f"({'; '.join(diff)}); rerun with the original arguments and "
                                 "inputs, or choose a new --out")
    return manifest


def _sweep_temporaries(out: Path) -> list[str]:
    """Remove a killed writer's ``.tmp-*`` / ``*.npy.tmp`` files (before the first barrier)."""
    stale = [*out.glob(f"{TMP_PREFIX}*"), *out.glob("*.npy.tmp")]
    for path in stale:
        path.unlink(missing_ok=True)
    return sorted(path.name for path in stale)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


class CacheWriter:
    """Encodes the image folder ``data_dir`` into the cache ``out`` with the processes of
    ``state`` (accelerate's PartialState); every process calls, in turn: the constructor (checks,
    loads the VAE), ``begin``, ``my_shards``, ``encode_shard`` for each, ``finish``."""

    def __init__(self, out: str | os.PathLike, data_dir: str | os.PathLike, options: WriteOptions,
                 state: PartialState):
        self.out, self.options, self.state = Path(out), options, state
        reason = unwritable_dir_reason(self.out)
        if reason is not None:
            raise ConfigError(f"--out {self.out}: cannot be the cache folder ({reason})")
        self.images = ImageFolderDataset(data_dir, options.image_size, random_flip=False,
                                         skip_bad=options.skip_bad, min_side=options.min_image_side)
        self.files_text = "".join(f"{f}\n" for f in self.images.files)
        self.sizes = np.asarray([os.stat(self.images.root / f).st_size for f in self.images.files],
                                dtype=np.int64)
        self.vae = load_vae(options.vae, device=state.device, dtype=VAE_DTYPES[options.vae_dtype],
                            key="--vae")
        self.latent_shape = latent_shape_of(self.vae, options.image_size)
        options.norm.check_vae(self.vae.config, options.vae, CLI_KEYS)
        vae_id = options.vae if not os.path.isdir(options.vae) else str(Path(options.vae).resolve())
        self.settings = {
            "format": CACHE_FORMAT,
            "complete": False,
            "num_images": len(self.images),
            "files_sha256": hashlib.sha256(self.files_text.encode()).hexdigest(),
            "file_sizes_sha256": hashlib.sha256(self.sizes.tobytes()).hexdigest(),
            "classes": self.images.classes,
            "image_size": options.image_size,
            "vae": vae_id,
            **vae_digests(self.vae),
            "vae_dtype": options.vae_dtype,
            "scaling_factor": options.scaling_factor,
            "shift_factor": options.shift_factor,
            "dtype": options.dtype,
            "shard_size": options.shard_size,
            "data_dir": str(Path(data_dir).resolve()),
        }
        # every rank checks: all of them stop
        self.existing = _check_settings(self.out, self.settings, self.images.files, self.sizes)
        self.entries = _shard_entries(len(self.images), options.shard_size)

    def begin(self) -> list[str]:
        """Main process: write a new cache's labels, file list and incomplete manifest, then
        remove a killed run's temporaries; returns their names."""
        if not self.state.is_main_process:
            return []
        out = self.out
        if self.existing is None:
            out.mkdir(parents=True, exist_ok=True)
            # each written whole or not at all (the manifest, which names them, comes after them)
            atomic_write(out / LABELS_NAME, lambda f: np.save(f, self.images.labels))
            atomic_write(out / FILE_SIZES_NAME, lambda f: np.save(f, self.sizes))
            atomic_write_text(out / FILES_NAME, self.files_text)
            _write_json(out / MANIFEST_NAME, {
                **self.settings, "latent_shape": list(self.latent_shape), "shards": self.entries,
                "labels": LABELS_NAME, "files": FILES_NAME, "file_sizes": FILE_SIZES_NAME,
                "bad_indices": []})
        return _sweep_temporaries(out)

    def my_shards(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(this process's shards, all pending shards without a .done marker), round-robin."""
        state = self.state
        state.wait_for_everyone()
        pending = [e for e in self.entries if not (self.out / f"{e['name']}.done").is_file()]
        state.wait_for_everyone()  # all ranks list the pending shards before any adds a marker
        return pending[state.process_index :: state.num_processes], pending

    def encode_shard(self, entry: dict[str, Any], progress: Callable[[int], object],
                     skipped: Callable[[str], object]) -> None:
        """Encode one shard (``progress(n)`` after each batch of n images, ``skipped(message)`` for
        each image skipped under skip_bad), write it atomically, then its .done marker."""
        out, options, latent_shape = self.out, self.options, self.latent_shape
        start, stop = entry["start"], entry["stop"]
        dtype = STORAGE_DTYPES[options.dtype]
        shape = (stop - start, 2, *latent_shape)
        tmp = {key: out / f"{TMP_PREFIX}{os.getpid()}-{entry[key]}" for key in ("mean", "std")}
        arrays: dict[str, np.ndarray] = {}
        bad: list[int] = []
        reasons: list[str] = []
        try:
            for key in tmp:
                arrays[key] = np.lib.format.open_memmap(tmp[key], mode="w+", dtype=dtype,
                                                        shape=shape)
            loader = DataLoader(_CropItems(self.images, start, stop, options.skip_bad),
                                batch_size=options.batch_size, num_workers=options.num_workers,
                                collate_fn=_collate, pin_memory=torch.cuda.is_available())
            for index, x, bad_items in loader:
                for i, msg in bad_items:
                    skipped(msg)
                    bad.append(i)
                    reasons.append(msg)
                if x is not None:
                    both = torch.cat([x, x.flip(-1)])  # original and mirrored in one VAE call
                    mean, std = encode_moments(self.vae, both, options.norm)
                    rows = (index - start).numpy()
                    for key, value in (("mean", mean), ("std", std)):
                        # [B, 2, C, h, w]
                        value = value.view(2, len(x), *latent_shape).transpose(0, 1)
                        arrays[key][rows] = value.cpu().numpy().astype(dtype)
                progress(len(index) + len(bad_items))
            digests = {}
            for key in tmp:
                array = arrays.pop(key)
                array.flush()
                del array  # the last reference: closes the memmap
                _fsync(tmp[key])  # on disk before the rename: no renamed half file
                digests[key] = sha256_file(tmp[key])  # from the page cache
            for key in tmp:
                os.replace(tmp[key], out / entry[key])
        except BaseException:
            arrays.clear()
            for path in tmp.values():
                path.unlink(missing_ok=True)  # an error or Ctrl-C leaves no temporary behind
            raise
        _write_json(out / f"{entry['name']}.done",
                    {"start": start, "stop": stop, "bad": bad, "bad_reasons": reasons,
                     "sha256": digests})

    def finish(self) -> dict[str, Any] | None:
        """After all shards: the main process completes the manifest and returns it (else None)."""
        self.state.wait_for_everyone()
        manifest = _complete(self.out, self.entries) if self.state.is_main_process else None
        self.state.wait_for_everyone()
        return manifest


def cache_stats(out: Path, manifest: dict[str, Any], chunk_rows: int = 1024) -> dict[str, Any]:
    """Per-channel mean and std (float64 sums, population std) of the stored posterior means of
    every image the cache kept, both flips, in the VAE's own units (normalisation undone)."""
    norm = stored_norm(manifest)
    scale, shift = norm.scale, norm.shift or 0.0
    bad = set(manifest.get("bad_indices", []))
    channels = manifest["latent_shape"][0]
    total, squares, count = np.zeros(channels), np.zeros(channels), 0
    for info in manifest["shards"]:
        mean = np.load(out / info["mean"], mmap_mode="r")
        keep = [r for r in range(len(mean)) if info["start"] + r not in bad]
        for lo in range(0, len(keep), chunk_rows):
            block = np.asarray(mean[keep[lo : lo + chunk_rows]], dtype=np.float64)
            values = block.transpose(2, 0, 1, 3, 4).reshape(channels, -1)  # [C, rows·2·h·w]
            total, squares = total + values.sum(1), squares + (values**2).sum(1)
            count += values.shape[1]
    if count == 0:
        return {"mean": [0.0] * channels, "std": [1.0] * channels, "values": 0}
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    return {"mean": (mean / scale + shift).tolist(), "std": (std / scale).tolist(),
            "values": count, "of": "posterior means, both flips, before normalisation"}


def _complete(out: Path, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mark the manifest complete, with the skipped images and each shard's digests."""
    manifest = read_manifest(out)
    markers = [out / f"{e['name']}.done" for e in entries]
    missing = [m.name for m in markers if not m.is_file()]
    if missing:
        raise IncompleteCacheError(f"{len(missing)} shard(s) of {out} lack a done marker: "
                                   f"{missing[:5]}; rerun the same command")
    done = [json.loads(m.read_text()) for m in markers]
    manifest["bad_indices"] = sorted(i for d in done for i in d["bad"])
    manifest["bad_files"] = [reason for d in done for reason in d.get("bad_reasons", [])]
    for entry, marker in zip(manifest["shards"], done, strict=True):
        entry["sha256"] = marker.get("sha256", {})
    manifest["latent_stats"] = cache_stats(out, manifest)
    manifest["complete"] = True
    _write_json(out / MANIFEST_NAME, manifest)
    return manifest
