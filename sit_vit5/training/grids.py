"""Sample grids during training: the EMA model's images, the same sample.py makes from the
checkpoint (same seed, classes and pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import Config, ConfigError
from ..images import save_grid
from ..objective import Objective
from ..sampling import SamplingPipeline

SAMPLES_DIR = "samples"  # in the run directory: samples/{step:07d}.png


def grid_classes(cfg_sample: dict[str, Any], num_classes: int) -> list[int]:
    """Class of each grid image: ``sample.classes`` cycled, or 0, 1, 2, ... mod num_classes."""
    n, classes = cfg_sample["num_images"], cfg_sample["classes"]
    if classes is None:
        return [i % num_classes for i in range(n)]
    if not classes or any(not 0 <= int(c) < num_classes for c in classes):
        raise ConfigError(f"sample.classes={classes!r}: need class ids in [0, {num_classes})")
    return [int(classes[i % len(classes)]) for i in range(n)]


def grid_images(ema: nn.Module, transport: Objective, cfg: Config, device: torch.device,
                vae: nn.Module | None = None) -> Tensor:
    """Grid images (N, C, H, W) in [0, 1] (uint8 steps) from the EMA model: samples 0..N-1 with the
    ``sample`` section's settings, seed and ``grid_classes`` (image i = sample.py's image i).
    Latent models are decoded with ``vae``."""
    s, was_training = cfg["sample"], ema.training
    pipe = SamplingPipeline.for_run(cfg, ema, transport, device, vae)
    labels = grid_classes(s, cfg["model"]["num_classes"])
    images = pipe.generate(range(s["num_images"]), s["seed"], labels).images
    ema.train(was_training)
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


def write_grid(ema: nn.Module, transport: Objective, cfg: Config, device: torch.device,
               vae: nn.Module | None, step: int) -> Path:
    """Save ``grid_images`` as ``<train.out_dir>/samples/{step:07d}.png``; returns the path."""
    path = Path(cfg["train"]["out_dir"]) / SAMPLES_DIR / f"{step:07d}.png"
    save_grid(grid_images(ema, transport, cfg, device, vae), path, cfg["sample"]["nrow"])
    return path
