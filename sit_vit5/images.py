"""Image writing: float images -> uint8, PNGs and grids, all written atomically.

Float images: ``(N, C, H, W)`` tensors in [-1, 1]; uint8 images: NumPy ``(N, H, W, C)``, C = 1 or 3
(as in ADM-format ``.npz`` files)."""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torchvision.utils import save_image

from .utils.atomic_files import atomic_write


def to_uint8(x: Tensor) -> np.ndarray:
    """Images ``(N, C, H, W)`` in [-1, 1] -> uint8 ``(N, H, W, C)`` on the CPU: DiT/SiT's
    ``clamp(127.5 * x + 128, 0, 255)`` then a truncating cast (round-half-up, not to even)."""
    scaled = torch.clamp(127.5 * x.float() + 128.0, 0, 255)
    return scaled.permute(0, 2, 3, 1).to("cpu", torch.uint8).numpy()


def to_rgb(images: np.ndarray) -> np.ndarray:
    """NHWC uint8 with 1 or 3 channels -> 3 channels (ADM needs RGB; gray is replicated)."""
    return np.repeat(images, 3, axis=3) if images.shape[3] == 1 else images


def save_png(image: np.ndarray, path: str | os.PathLike) -> None:
    """One uint8 HWC image (1 channel: grayscale PNG, 3: RGB), written atomically."""
    pil = Image.fromarray(image[..., 0] if image.shape[2] == 1 else image)
    atomic_write(path, lambda f: pil.save(f, format="PNG"))


def save_grid(images: Tensor, path: str | os.PathLike, nrow: int | None = None,
              min_side: int = 64) -> None:
    """Save images ``(N, C, H, W)`` in [0, 1] as one PNG grid (``nrow`` per row, default
    ceil(sqrt(N))), atomically; tiny images are upscaled (nearest) to >= ``min_side`` pixels."""
    factor = max(1, math.ceil(min_side / images.shape[-1]))
    if factor > 1:
        images = F.interpolate(images, scale_factor=factor, mode="nearest")
    nrow = nrow or math.ceil(math.sqrt(len(images)))
    padding = max(2, factor // 2)
    atomic_write(path, lambda f: save_image(images, f, format="PNG", nrow=nrow, padding=padding,
                                            pad_value=1.0))


def save_uint8_grid(images: np.ndarray, path: str | os.PathLike, nrow: int | None = None) -> None:
    """``save_grid`` of uint8 ``(N, H, W, C)`` images (exact: k/255 maps back to k)."""
    save_grid(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, path, nrow)
