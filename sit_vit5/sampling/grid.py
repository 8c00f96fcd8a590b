"""Grids: samples ``0 .. n-1`` of a pipeline as single PNGs and one grid image."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..images import save_png, save_uint8_grid
from ..utils.atomic_files import output_dir
from .sampling_pipeline import Generated, SamplingPipeline


@dataclass
class GridResult:
    """What ``sample_grid`` wrote and measured."""

    grid: Path
    images: list[Path]
    labels: np.ndarray
    nfe: int | None
    seconds: float
    images_per_second: float


def generate_first(
    pipe: SamplingPipeline, num_images: int, labels: Sequence[int] | None = None,
    global_seed: int = 0, batch_size: int = 32, progress: bool = True,
) -> list[Generated]:
    """Samples ``0 .. num_images-1`` in batches of ``batch_size``; ``labels`` None = random labels,
    else one label per image."""
    if labels is not None and len(labels) != num_images:
        raise ValueError(f"{len(labels)} labels for {num_images} images")
    batches = []
    starts = range(0, num_images, batch_size)
    for lo in tqdm(starts, disable=not progress, desc="grid", unit="batch"):
        idx = list(range(lo, min(lo + batch_size, num_images)))
        batches.append(pipe.generate(idx, global_seed,
                                     None if labels is None else labels[lo : lo + len(idx)]))
    return batches


def sample_grid(
    pipe: SamplingPipeline, out_dir: str | os.PathLike, num_images: int,
    labels: Sequence[int] | None = None, global_seed: int = 0, batch_size: int = 32,
    nrow: int | None = None, progress: bool = True,
) -> GridResult:
    """Generate samples ``0 .. num_images-1`` and write ``out_dir/grid.png`` and
    ``out_dir/{i:06d}.png``.

    ``labels`` None = random labels (image i is then bulk sample i of the same seed); otherwise one
    label per image. Tiny images are upscaled (nearest) to >= 64 px in the grid only; the single
    PNGs keep their size.
    """
    out = output_dir(out_dir)
    start = time.perf_counter()
    batches = generate_first(pipe, num_images, labels, global_seed, batch_size, progress)
    seconds = time.perf_counter() - start
    images = np.concatenate([b.images for b in batches])
    paths = []
    for i, image in enumerate(images):
        paths.append(out / f"{i:06d}.png")
        save_png(image, paths[-1])
    grid = out / "grid.png"
    save_uint8_grid(images, grid, nrow)
    return GridResult(grid, paths, np.concatenate([b.labels for b in batches]), batches[-1].nfe,
                      seconds, num_images / max(seconds, 1e-9))
