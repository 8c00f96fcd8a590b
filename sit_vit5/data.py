"""Training data: ImageNet-style image folders, the embedded 8×8 digits demo set, and cached VAE latents.

Every random choice an item makes (horizontal flip, latent noise) is drawn from a generator seeded by
(seed, epoch, index), so an item's value depends neither on the DataLoader worker that loads it nor on
what was drawn before: a resumed run sees exactly the data an uninterrupted run would. Call
`dataset.set_epoch(epoch)` before iterating an epoch; DataLoader workers copy the dataset when the
iterator starts, so use `persistent_workers=False` (the default) or the workers keep the old epoch.

The latent cache is written by `python -m sit_vit5.cache_latents`; its layout (in `cache_dir`):
    manifest.json            settings, classes, latent shape, scaling factor, VAE id, shard index ranges
    labels.npy               int64 [num_images], class index of each image
    files.txt                one image path per line (relative to the data dir), index order
    shard_NNNNN.mean.npy     [n, 2, C, h, w] posterior mean × scaling factor; [:, 0] original, [:, 1] flipped
    shard_NNNNN.std.npy      [n, 2, C, h, w] posterior std × scaling factor
    shard_NNNNN.done         JSON marker written after both arrays are in place (resume skips these shards)
    file_sizes.npy           int64 [num_images], byte size of each image when it was encoded

Reading it is checked (`LatentCacheDataset`): at open, every file the manifest names must exist with
the size its .npy header implies and the shape / dtype the manifest implies (≈ 0.1 ms a file); every
item read is checked for NaN / inf (≈ 3 µs of a 22 µs item at ImageNet-256 shapes, CPU time,
`python -m bench.cache_checks`, results/bench/cpu/cache_checks.json); `verify_cache` (the writer's
`--verify`) also compares each shard with the SHA-256 the writer recorded. A failure raises
CorruptCacheError naming the file and how to re-encode it.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from .errors import SitVit5Error
from .io import sha256_file
from .transport.rng import item_seed

# torchvision's ImageFolder extensions (matched case-insensitively)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

CACHE_FORMAT = "sit_vit5.latent_cache/1"
MANIFEST_NAME = "manifest.json"
LABELS_NAME = "labels.npy"
FILES_NAME = "files.txt"
FILE_SIZES_NAME = "file_sizes.npy"


class UnreadableImageError(SitVit5Error, RuntimeError):
    """An image file that PIL cannot decode; the message and `.path` name the file at fault.
    (One-argument constructor, so DataLoader workers can re-raise it in the main process.)"""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)


class TooSmallImageError(UnreadableImageError):
    """An image whose short side is below the dataset's ``min_side``: upscaling it to the training
    size would invent the picture. Skipped like an unreadable file under ``skip_bad``."""


class DataRootError(SitVit5Error, FileNotFoundError):
    """A data root (image folder or latent cache) that is missing, empty, unset or incomplete; the message
    names the path. (A FileNotFoundError, so callers that caught that before still do.)"""


class IncompleteCacheError(DataRootError, RuntimeError):
    """A latent cache whose writer has not finished (a RuntimeError too, as it was before)."""


class CorruptCacheError(SitVit5Error, ValueError):
    """A latent cache file that does not hold what the manifest says: missing, truncated, of another
    shape or dtype, non-finite values, or another SHA-256 than the writer recorded. The message
    names the file."""


class CacheMismatchError(SitVit5Error, ValueError):
    """A latent cache that does not fit the run: made from images of another size, or (for its
    writer) from other inputs than those of the run resuming it. The message names the value that
    differs."""


# ----------------------------------------------------------------------------- deterministic per-item RNG


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU torch.Generator for item `index` at `epoch` (≈ 10 µs to make)."""
    return torch.Generator().manual_seed(item_seed(seed, epoch, index))


# ----------------------------------------------------------------------------- images


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM center crop (guided-diffusion image_datasets.py, used by DiT/SiT): halve with BOX while the
    short side is ≥ 2·image_size, resize with BICUBIC so the short side is image_size, crop the center.
    Returns an image_size × image_size PIL image in the input's mode."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.asarray(pil_image)
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top : top + image_size, left : left + image_size])


def pil_to_tensor(pil_image: Image.Image) -> torch.Tensor:
    """RGB PIL image → float32 Tensor[3, H, W] in [-1, 1]: uint8 x ↦ x/127.5 − 1
    (what ToTensor + Normalize(0.5, 0.5) compute in DiT/SiT)."""
    arr = np.asarray(pil_image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1.0


def read_image(path: str | os.PathLike, image_size: int, min_side: int = 0) -> torch.Tensor:
    """The image file at `path`, RGB, ADM-center-cropped to `image_size`, as Tensor[3, S, S] in
    [-1, 1]. Raises UnreadableImageError (naming the file) if PIL cannot decode it,
    TooSmallImageError if a side is below `min_side` pixels."""
    try:
        with Image.open(path) as img:
            img = img.convert("RGB")  # forces the full decode inside the try
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        message = f"cannot read image {path}: {type(err).__name__}: {err}"
        raise UnreadableImageError(message, path) from err
    if min(img.size) < min_side:
        width, height = img.size
        raise TooSmallImageError(f"image {path} is {width}x{height} px, below the minimum side "
                                 f"of {min_side} px", path)
    return pil_to_tensor(center_crop_arr(img, image_size))


def list_image_folder(root: str | os.PathLike) -> tuple[list[str], list[int], list[str]]:
    """ImageFolder listing: class = each sub-directory of `root` in sorted order; files found recursively
    (sorted) with an IMG_EXTENSIONS suffix. Returns (paths relative to root, labels, classes)."""
    root = Path(root)
    if not root.is_dir():
        raise DataRootError(f"image folder {root} does not exist or is not a directory")
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise DataRootError(f"image folder {root} has no class sub-directories "
                                "(expected <root>/<class>/<image>)")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        for dirpath, _, filenames in sorted(os.walk(root / name, followlinks=True)):
            for filename in sorted(filenames):
                if filename.lower().endswith(IMG_EXTENSIONS):
                    files.append(os.path.relpath(os.path.join(dirpath, filename), root))
                    labels.append(label)
    if not files:
        raise DataRootError(f"image folder {root} has no images "
                                f"(extensions {', '.join(IMG_EXTENSIONS)})")
    return files, labels, classes


class EpochDataset(Dataset):
    """What the three datasets share: class names (``classes``), the epoch that seeds each item's
    flip (``set_epoch``, called by the training loop), and ``sample_shape`` (C, H, W) of an item."""

    classes: list[str]
    epoch: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self._sample_shape()

    def _sample_shape(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class ImageFolderDataset(EpochDataset):
    """`root/<class>/**/<image>` → (Tensor[3, image_size, image_size] in [-1, 1], label).

    Labels follow the sorted class-folder names. Each image is ADM-center-cropped, then flipped
    horizontally with probability 1/2 if `random_flip` (decided by (seed, epoch, index)). An unreadable
    file raises UnreadableImageError naming it, an image with a side below `min_side` pixels
    TooSmallImageError (default 0: any size is upscaled, as ADM's crop does); with `skip_bad`
    either is counted in `num_skipped` (per process: DataLoader workers count their own), reported
    with a warning, and the next readable index is returned instead.
    """

    def __init__(self, root: str | os.PathLike, image_size: int, random_flip: bool = True,
                 skip_bad: bool = False, seed: int = 0, min_side: int = 0):
        self.root = Path(root)
        self.min_side = int(min_side)
        self.image_size = int(image_size)
        self.random_flip = random_flip
        self.skip_bad = skip_bad
        self.seed = seed
        self.epoch = 0
        self.num_skipped = 0
        self.files, labels, self.classes = list_image_folder(self.root)
        self.labels = np.asarray(labels, dtype=np.int64)

    def _sample_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    def __len__(self) -> int:
        return len(self.files)

    def read(self, index: int) -> torch.Tensor:
        """Center-cropped, unflipped image `index` as Tensor[3, S, S] in [-1, 1] (`read_image`)."""
        return read_image(self.root / self.files[index], self.image_size, self.min_side)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        flip = self.random_flip and bool(torch.randint(2, (1,), generator=self._generator(index)).item())
        for attempt in range(len(self)):
            source = (index + attempt) % len(self)
            try:
                image = self.read(source)
                break
            except UnreadableImageError as err:
                if not self.skip_bad:
                    raise
                self.num_skipped += 1
                warnings.warn(f"skipping {err}", stacklevel=2)
        else:
            raise RuntimeError(f"no readable image in {self.root} ({len(self)} files, all unreadable)")
        if flip:
            image = image.flip(-1)
        return image, int(self.labels[source])

    def _generator(self, index: int) -> torch.Generator:
        return item_generator(self.seed, self.epoch, index)


# ----------------------------------------------------------------------------- embedded digits


class DigitsDataset(EpochDataset):
    """scikit-learn's 8×8 handwritten digits (1797 images, 10 classes; the data ships inside scikit-learn,
    no download) → (Tensor[1, S, S] in [-1, 1], label).

    Pixel values 0..16 map to x/8 − 1. `image_size` ≠ 8 resizes with `resize_mode` ("bilinear" or
    "bicubic", clamped back to [-1, 1]). `split`: "all", or a fixed stratified 80/20 "train"/"test"
    split (20 % of each class, chosen by a permutation with seed 0). Flips are off by default: a
    mirrored digit is a different glyph.
    """

    SPLITS = ("all", "train", "test")

    def __init__(self, image_size: int = 8, split: str = "all", random_flip: bool = False,
                 resize_mode: str = "bilinear", seed: int = 0):
        from sklearn.datasets import load_digits

        if split not in self.SPLITS:
            raise ValueError(f"DigitsDataset split={split!r}; valid: {', '.join(self.SPLITS)}")
        if resize_mode not in ("bilinear", "bicubic"):
            raise ValueError(f"DigitsDataset resize_mode={resize_mode!r}; valid: bilinear, bicubic")
        digits = load_digits()
        images = torch.from_numpy(digits.images.astype(np.float32)) / 8.0 - 1.0  # [1797, 8, 8]
        labels = digits.target.astype(np.int64)
        if split != "all":
            is_test = np.zeros(len(labels), dtype=bool)
            rng = np.random.default_rng(0)
            for c in range(10):
                members = rng.permutation(np.flatnonzero(labels == c))
                is_test[members[: round(0.2 * len(members))]] = True
            keep = np.flatnonzero(is_test if split == "test" else ~is_test)
            images, labels = images[torch.from_numpy(keep)], labels[keep]
        images = images[:, None]
        if image_size != 8:
            images = F.interpolate(images, size=(image_size,) * 2, mode=resize_mode, align_corners=False)
            images = images.clamp(-1.0, 1.0)  # bicubic overshoots
        self.images = images.contiguous()
        self.labels = labels
        self.image_size = image_size
        self.random_flip = random_flip
        self.seed = seed
        self.epoch = 0
        self.classes = [str(c) for c in range(10)]

    def _sample_shape(self) -> tuple[int, int, int]:
        return (1, self.image_size, self.image_size)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.random_flip:
            if torch.randint(2, (1,), generator=item_generator(self.seed, self.epoch, index)).item():
                image = image.flip(-1)
        return image.clone(), int(self.labels[index])


# ----------------------------------------------------------------------------- latent cache

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
    """The cache's manifest.json as a dict; errors name the directory and how to create the cache."""
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


def npy_layout(path: str | os.PathLike) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, the file size in bytes they imply) from an .npy header, without reading the
    data. Raises CorruptCacheError naming the file when it is missing or has no readable header."""
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
    ``dtype`` ``shape`` and is exactly as long as its header says (a truncated or padded file is
    refused)."""
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
    """Cached SD-VAE posteriors → (latent Tensor[C, h, w] float32, label), and with `image_root`
    (the ImageFolder the cache was made from) → (latent, label, image Tensor[3, S, S] in [-1, 1]):
    the item's own image, center-cropped as the writer cropped it and flipped with the latent (what
    REPA's encoder sees beside cached latents, as REPA's own code trains).

    The latent is mean + std·ε with ε ~ N(0, I), both moments already multiplied by the scaling factor,
    from the original or (if `random_flip`, probability 1/2) the flipped image. Flip and ε come from a
    generator seeded by (seed, epoch, index): first draw the flip bit, then ε. Shards are opened with
    `np.load(mmap_mode="r")` lazily in each process (never pickled), so an item costs two small memmap
    reads. Images the cache writer skipped as unreadable are left out (`len` counts the rest).

    Checked (CorruptCacheError naming the file): at open, that labels.npy and every shard file
    exist with the shape, dtype and byte size the manifest implies (headers only: ≈ 0.1 ms a file);
    at each read, that the item's mean and std are finite (≈ 3 µs for a 4×32×32 latent, on a 22 µs
    item read), so a shard overwritten with NaN is named before it can reach the loss. With
    `image_root` (CacheMismatchError naming the file): at open, that files.txt lists the cache's
    images and its first and last image exist there; at each read, that the image still has the
    byte size it had when it was encoded (one stat).
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
                f"rerun the same `python -m sit_vit5.cache_latents ... --out {self.cache_dir}` to resume")
        self.manifest = manifest
        self.classes: list[str] = manifest["classes"]
        self.latent_shape = tuple(manifest["latent_shape"])
        self.scaling_factor = float(manifest["scaling_factor"])
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
            raise CorruptCacheError(f"{listing}: cannot be read ({err}); it names the images the "
                                    "cache was made from: re-create the cache in a new --out") from None
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
        """Item `index`'s image (dataset numbering) as the cache writer cropped it, mirrored when
        `flip` is 1: Tensor[3, S, S] in [-1, 1]. Raises CacheMismatchError when the file's size
        differs from the one recorded at encoding (the latent would not be this image's)."""
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
        """Scaled (mean, std) float32 of item `index` (dataset numbering); flip 0 = original,
        1 = mirrored. Raises CorruptCacheError naming the shard file when either holds NaN or
        inf."""
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
        return torch.from_numpy(values["mean"]), torch.from_numpy(values["std"])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | tuple[torch.Tensor, int, torch.Tensor]:
        gen = item_generator(self.seed, self.epoch, index)
        flip = int(torch.randint(2, (1,), generator=gen).item()) if self.random_flip else 0
        mean, std = self.moments(index, flip)
        latent = mean + std * torch.randn(mean.shape, generator=gen)  # on cpu: a loader item, its own generator
        label = int(self.labels[self._indices[index]])
        if self.image_root is None:
            return latent, label
        return latent, label, self.image(index, flip)


def _recorded_digests(cache_dir: Path, info: dict[str, Any]) -> dict[str, str]:
    """The SHA-256 per array ("mean", "std") the writer recorded for a shard: in the manifest, else
    in its .done marker; {} for caches written before digests were recorded."""
    if isinstance(info.get("sha256"), dict):
        return info["sha256"]
    try:
        marker = json.loads((cache_dir / f"{info['name']}.done").read_text())
    except (OSError, ValueError):
        return {}
    digests = marker.get("sha256") if isinstance(marker, dict) else None
    return digests if isinstance(digests, dict) else {}


def first_nonfinite_row(array: np.ndarray, chunk_rows: int = 256) -> int | None:
    """Index of the first row of ``array`` holding NaN or inf, or None; reads ``chunk_rows`` rows
    at a time (a memmap is never loaded whole)."""
    for start in range(0, len(array), chunk_rows):
        block = np.asarray(array[start : start + chunk_rows])
        finite = np.isfinite(block.reshape(len(block), -1)).all(axis=1)
        if not finite.all():
            return start + int(np.flatnonzero(~finite)[0])
    return None


def verify_cache(cache_dir: str | os.PathLike) -> dict[str, Any]:
    """Check every byte of a complete latent cache: LatentCacheDataset's layout checks, then each
    shard file's SHA-256 against the one its writer recorded (caches written before digests were
    recorded skip this) and every value for NaN / inf. Raises CorruptCacheError listing the bad
    files on one line; returns {"files", "bytes", "seconds"}.

    Cost: one read of every shard for the digest, one more (from the page cache) for the values:
    ≈ 1.7 s of CPU per GB on one core here (SHA-256 1.5 of it; `python -m bench.cache_checks`),
    i.e. ≈ 70 s for ImageNet-256's 42 GB float16 cache, or the disk's read time if that is longer.
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


# ----------------------------------------------------------------------------- config → dataset


def _build_digits(cfg: dict[str, Any]) -> Dataset:
    return DigitsDataset(image_size=cfg.get("image_size", 8), split=cfg.get("split", "all"),
                         random_flip=cfg.get("random_flip", False),
                         resize_mode=cfg.get("resize_mode", "bilinear"), seed=cfg.get("seed", 0))


def _build_imagefolder(cfg: dict[str, Any]) -> Dataset:
    return ImageFolderDataset(_require(cfg, "root"), _require(cfg, "image_size"),
                              random_flip=cfg.get("random_flip", True), skip_bad=cfg.get("skip_bad", False),
                              seed=cfg.get("seed", 0), min_side=cfg.get("min_image_side", 0))


def _build_latents(cfg: dict[str, Any]) -> Dataset:
    dataset = LatentCacheDataset(_require(cfg, "root"), random_flip=cfg.get("random_flip", True),
                                 seed=cfg.get("seed", 0), image_root=cfg.get("image_root"))
    if cfg.get("image_size") is not None and int(cfg["image_size"]) != dataset.image_size:
        raise CacheMismatchError(
            f"data.image_size={cfg['image_size']} but the latent cache {cfg['root']} was made from "
            f"{dataset.image_size}px images (its {MANIFEST_NAME}); set data.image_size="
            f"{dataset.image_size} or point data.root at a {cfg['image_size']}px cache")
    return dataset


# kind → builder; each reads only its own keys of the data config
DATASETS: dict[str, Callable[[dict[str, Any]], Dataset]] = {
    "digits": _build_digits,  # image_size (default 8), split, random_flip (default False), resize_mode, seed
    "imagefolder": _build_imagefolder,  # root, image_size, random_flip, skip_bad, min_image_side, seed
    "latents": _build_latents,  # root (the cache dir), random_flip, seed, image_root (images beside)
}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key == "root" and cfg.get(key) is None:
        raise DataRootError(f"data.root is not set: data.kind={cfg.get('kind', cfg.get('name'))!r} reads its "
                            "images (or latent cache) from there")
    if cfg.get(key) is None:
        raise KeyError(f"data config for kind {cfg.get('kind', cfg.get('name'))!r} needs key {key!r}")
    return cfg[key]


def build_dataset(cfg: dict[str, Any]) -> Dataset:
    """Dataset from a data config dict: `kind` (or `name`) ∈ DATASETS plus that kind's keys, e.g.
    {"kind": "imagefolder", "root": "/data/imagenet/train", "image_size": 256, "random_flip": True}.
    Keys the kind does not use (loader settings, other kinds' options) are ignored: sit_vit5.config
    validates key names. An unknown kind raises, listing the valid ones."""
    kind = cfg.get("kind", cfg.get("name"))
    if kind not in DATASETS:
        raise ValueError(f"data kind {kind!r} is not one of: {', '.join(DATASETS)}")
    return DATASETS[kind](cfg)
