"""What every training dataset shares, and the embedded 8×8 digits demo set.

Each item's random choices (flip, latent noise) come from a generator seeded by (seed, epoch,
index), so a resumed run sees exactly the data an uninterrupted one would. Call
`dataset.set_epoch(epoch)` before each epoch, with `persistent_workers=False` (workers copy it).
Image folders: :mod:`sit_vit5.image_data`; latent caches: :mod:`sit_vit5.latent_cache`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .transport.rng import item_seed
from .utils.errors import SitVit5Error


class DataRootError(SitVit5Error, FileNotFoundError):
    """A data root (image folder or latent cache) that is missing, empty, unset or incomplete; the
    message names the path."""


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU torch.Generator for item `index` at `epoch` (≈ 10 µs to make)."""
    return torch.Generator().manual_seed(item_seed(seed, epoch, index))


class EpochDataset(Dataset):
    """What the datasets share: ``classes``, the epoch that seeds each item (``set_epoch``) and
    an item's ``sample_shape`` (C, H, W)."""

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


class DigitsDataset(EpochDataset):
    """scikit-learn's 8×8 digits (1797 images, 10 classes, no download) → (Tensor[1, S, S] in
    [-1, 1], label): pixels 0..16 ↦ x/8 − 1, resized with `resize_mode` when `image_size` ≠ 8.
    `split`: "all" or a fixed stratified 80/20 "train"/"test". No flips by default (a mirrored
    digit is another glyph).
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
            images = F.interpolate(images, size=(image_size,) * 2, mode=resize_mode,
                                   align_corners=False)
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
            gen = item_generator(self.seed, self.epoch, index)
            if torch.randint(2, (1,), generator=gen).item():
                image = image.flip(-1)
        return image.clone(), int(self.labels[index])
