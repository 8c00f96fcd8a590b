"""Training images from ImageNet-style folders: listing (each real folder once), reading with the
ADM center crop, and the dataset (per-item randomness as in :mod:`sit_vit5.datasets`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .datasets import DataRootError, EpochDataset, item_generator
from .utils.errors import SitVit5Error

# torchvision's ImageFolder extensions (matched case-insensitively)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class UnreadableImageError(SitVit5Error, RuntimeError):
    """An image file that PIL cannot decode; the message and `.path` name it."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)


class TooSmallImageError(UnreadableImageError):
    """An image whose short side is below ``min_side`` (skipped like an unreadable one)."""


# ----------------------------------------------------------------------------- images


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM center crop (guided-diffusion, as in DiT/SiT): halve with BOX while the short side is
    ≥ 2·image_size, BICUBIC to short side image_size, crop the center (PIL, image_size²)."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size),
                                 resample=Image.BICUBIC)
    arr = np.asarray(pil_image)
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top : top + image_size, left : left + image_size])


def pil_to_tensor(pil_image: Image.Image) -> torch.Tensor:
    """RGB PIL image → float32 Tensor[3, H, W] in [-1, 1] (x/127.5 − 1, as DiT/SiT)."""
    arr = np.asarray(pil_image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1.0


def read_image(path: str | os.PathLike, image_size: int, min_side: int = 0) -> torch.Tensor:
    """The image at `path`, RGB, center-cropped to `image_size`: Tensor[3, S, S] in [-1, 1].
    UnreadableImageError if PIL cannot decode it, TooSmallImageError if a side < `min_side` px."""
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


def _real_dir(path: str | os.PathLike) -> tuple[int, int]:
    """(device, inode) of the directory ``path`` leads to (links followed)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk_once(root: Path, top: Path, seen: set[tuple[int, int]]
               ) -> list[tuple[str, list[str], list[str]]]:
    """``os.walk(top, followlinks=True)`` that enters each real directory once: a sub-directory
    whose (device, inode) is in ``seen`` is pruned with a warning naming it (relative to ``root``)
    and what it leads to; ``seen`` grows with every directory entered."""
    walked = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        for dirname in list(dirnames):
            path = os.path.join(dirpath, dirname)
            try:
                real = _real_dir(path)
            except OSError:  # vanished or unreadable: os.walk reports nothing for it either
                continue
            if real in seen:
                dirnames.remove(dirname)
                warnings.warn(f"skipping {os.path.relpath(path, root)} in image folder {root}: it "
                              f"leads to {os.path.realpath(path)}, which is already listed (a "
                              "symlink loop or a second link to one folder)", stacklevel=3)
            else:
                seen.add(real)
        walked.append((dirpath, dirnames, filenames))
    return walked


def list_image_folder(root: str | os.PathLike) -> tuple[list[str], list[int], list[str]]:
    """ImageFolder listing (classes: sorted sub-directories; images found recursively, sorted):
    (paths relative to root, labels, classes). Symlinks are followed, each real directory once: a
    link to the root, to a class folder or to a folder already listed (a loop such as ``ln -s .
    self``) is skipped with one warning naming it."""
    root = Path(root)
    if not root.is_dir():
        raise DataRootError(f"image folder {root} does not exist or is not a directory")
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise DataRootError(f"image folder {root} has no class sub-directories "
                                "(expected <root>/<class>/<image>)")
    files: list[str] = []
    labels: list[int] = []
    # every real directory is listed once: a link back to the root, a class or a folder seen before
    # (a loop, or a second way into the same folder) is skipped with one warning
    seen = {_real_dir(root)} | {_real_dir(root / name) for name in classes}
    for label, name in enumerate(classes):
        for dirpath, _, filenames in sorted(_walk_once(root, root / name, seen)):
            for filename in sorted(filenames):
                if filename.lower().endswith(IMG_EXTENSIONS):
                    files.append(os.path.relpath(os.path.join(dirpath, filename), root))
                    labels.append(label)
    if not files:
        raise DataRootError(f"image folder {root} has no images "
                                f"(extensions {', '.join(IMG_EXTENSIONS)})")
    return files, labels, classes


class ImageFolderDataset(EpochDataset):
    """`root/<class>/**/<image>` → (Tensor[3, image_size, image_size] in [-1, 1], label).

    Labels: sorted class folders. Images are center-cropped, flipped with p = 1/2 if `random_flip`.
    An unreadable file raises UnreadableImageError, a side below `min_side` TooSmallImageError;
    with `skip_bad` either is warned about, counted in `num_skipped` (per process) and the next
    readable index returned instead.
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
        flip = self.random_flip and bool(
            torch.randint(2, (1,), generator=self._generator(index)).item())
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
            raise RuntimeError(f"no readable image in {self.root} ({len(self)} files, "
                               "all unreadable)")
        if flip:
            image = image.flip(-1)
        return image, int(self.labels[source])

    def _generator(self, index: int) -> torch.Generator:
        return item_generator(self.seed, self.epoch, index)
