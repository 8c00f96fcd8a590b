"""An offline quality number for the demo data (scikit-learn's 8×8 digits, which ship with scikit-learn):
"digits FID" and the class accuracy of generated samples, from a small CNN trained here on CPU.

Protocol (fixed; changing any of it changes the cache key below):
* data: sklearn.datasets.load_digits(), 1,797 grayscale 8×8 images with values 0..16, scaled x/8 − 1 to
  [-1, 1]; test split = every 4th image (index % 4 == 0, 450 images), train split = the other 1,347.
* network (DigitsNet): conv3×3(1→32)–ReLU–conv3×3(32→64)–ReLU–maxpool2–linear(1024→64)–ReLU–linear(64→10);
  features = the 64-d hidden layer *before* its ReLU (no dead, always-zero dimensions to make covariances
  singular).
* training: seed 0, Adam lr 1e-3, weight decay 1e-4, batch 64, 30 epochs over the train split, no
  augmentation, seeded shuffling, one CPU thread (~4 s). Deterministic on one machine, but not across machines:
  CPU kernels differ in the last bits and training amplifies them: FIDs by two such nets differ by up to ~1 %.
* weights: so every machine scores with the same network, the reference weights ship with the package
  (fid/weights/digits_featnet-{8,16}.safetensors, made by ``train_digits_net`` with torch 2.14.1 on one thread)
  and are checked against their SHA-256 before loading. ``load_digits_net(directory)`` instead trains the
  recipe on this machine and caches it in <directory>/digits_featnet-<key>.safetensors; the key hashes the
  config, the data and the training code, so any change to them retrains.
* digits FID: Fréchet distance (float64) between the features of the evaluated images and of all 1,797 real
  images. Like any FID it is biased upward at small N; compare numbers at equal N.
* accuracy: fraction of images whose argmax class equals the requested label.
Images of another size [N, 1, H, W] are resized to 8×8 with area interpolation; values are clamped to [-1, 1].

16×16 variant (``resolution=16``, for data that lives at 16×16 such as the digits proxy's bilinear upsamples,
whose area-downsampled copies the 8×8 network scores far from the originals): the same protocol on the
digits upsampled bilinearly to 16×16 (align_corners False, clamped: ``sit_vit5.datasets.DigitsDataset``'s
transform), real statistics from the same upsamples, network conv3×3(1→32)–ReLU–maxpool2–conv3×3(32→64)–
ReLU–maxpool2–linear(1024→64)–ReLU–linear(64→10); inputs of another size are area-downsampled or bilinearly
upsampled to 16×16. Its own cache key (``TRAIN_CONFIGS[16]``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load, save

from fid.metrics import feature_statistics, frechet_distance

TRAIN_CONFIG = {
    "seed": 0,
    "epochs": 30,
    "batch_size": 64,
    "lr": 1e-3,
    "weight_decay": 1e-4,
    "test_every": 4,
    "threads": 1,
    "arch": "conv32-conv64-pool-fc64-fc10/v1",
}
#: The 16×16 network's protocol: TRAIN_CONFIG's recipe on the bilinear 16×16 upsamples.
TRAIN_CONFIG_16 = {**TRAIN_CONFIG, "resolution": 16, "resize": "bilinear",
                   "arch": "conv32-pool-conv64-pool-fc64-fc10/v1"}
TRAIN_CONFIGS = {8: TRAIN_CONFIG, 16: TRAIN_CONFIG_16}
FEATURE_DIM = 64


class DigitsNet(nn.Module):
    """Small CNN on [N, 1, R, R] images in [-1, 1], R = ``resolution`` (8 or 16); forward → logits [N, 10]."""

    def __init__(self, resolution: int = 8):
        super().__init__()
        if resolution not in TRAIN_CONFIGS:
            raise ValueError(f"DigitsNet resolution must be one of {sorted(TRAIN_CONFIGS)}, got {resolution}")
        self.resolution = resolution
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.hidden = nn.Linear(64 * 4 * 4, FEATURE_DIM)
        self.head = nn.Linear(FEATURE_DIM, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activation hidden features [N, 64]."""
        x = F.relu(self.conv1(x))
        if self.resolution == 16:  # one extra pooling: the same 4×4×64 map as the 8×8 network
            x = F.max_pool2d(x, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.hidden(x.flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.features(x)))


def digits_data(resolution: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: images float32 [N, 1, R, R] in [-1, 1] (R = 16: bilinear upsamples), labels [N]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)
    if resolution != 8:
        images = F.interpolate(images, size=(resolution,) * 2, mode="bilinear", align_corners=False).clamp(-1, 1)
    return images, torch.from_numpy(digits.target.astype(np.int64))


def digits_split(split: str, resolution: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """'train' (1,347 images), 'test' (450: index % 4 == 0) or 'all' (1,797): (images, labels)."""
    images, labels = digits_data(resolution)
    is_test = torch.arange(len(labels)) % TRAIN_CONFIG["test_every"] == 0
    masks = {"train": ~is_test, "test": is_test, "all": torch.ones_like(is_test)}
    if split not in masks:
        raise ValueError(f"unknown digits split {split!r}; choose from {list(masks)}")
    return images[masks[split]], labels[masks[split]]


@torch.enable_grad()  # callers such as digits_metrics run under no_grad
def train_digits_net(resolution: int = 8, threads: int | None = None) -> DigitsNet:
    """Train DigitsNet on the train split with ``TRAIN_CONFIGS[resolution]`` (seconds on CPU). ``threads``: default
    the recipe's 1; another count changes the reduction order as another machine's kernels do (the shipped nets'
    reproducibility check, results/digits/study/featnet.py)."""
    cfg = TRAIN_CONFIGS[resolution]
    images, labels = digits_split("train", resolution)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or cfg["threads"])  # tiny ops gain nothing from threads
    try:
        torch.manual_seed(cfg["seed"])
        net = DigitsNet(resolution)
        opt = torch.optim.Adam(net.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        gen = torch.Generator().manual_seed(cfg["seed"])
        net.train()
        for _ in range(cfg["epochs"]):
            for idx in torch.randperm(len(labels), generator=gen).split(cfg["batch_size"]):
                loss = F.cross_entropy(net(images[idx]), labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(previous)
    return net.eval().requires_grad_(False)


#: The code whose source is part of the cache key (captured here: what it trains with, whatever is patched later).
RECIPE_CODE = (DigitsNet, digits_data, digits_split, train_digits_net)

#: The reference networks that ship with the package: file under WEIGHTS_DIR and its SHA-256, per resolution.
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
SHIPPED_WEIGHTS = {
    8: ("digits_featnet-8.safetensors", "7509769c84473d725e6220b2d992670baa5c7b89834d4c982cb27c8b7fd40960"),
    16: ("digits_featnet-16.safetensors", "54c7ba5f0576449bc87992ce47d33f251564f2af861eb5f55a216e64847f3198"),
}


class DigitsWeightsError(RuntimeError):
    """The shipped digits feature network is missing or is not the file its SHA-256 names."""


def cache_key(resolution: int = 8) -> str:
    """12 hex digits of SHA-256 over the training config, the digits data (at 8×8 for both networks) and the
    source of the code that makes the network (a changed recipe must not reuse an old cache)."""
    images, labels = digits_data()
    h = hashlib.sha256(json.dumps(TRAIN_CONFIGS[resolution], sort_keys=True).encode())
    h.update(images.numpy().tobytes())
    h.update(labels.numpy().tobytes())
    for code in RECIPE_CODE:
        h.update(inspect.getsource(code).encode())
    return h.hexdigest()[:12]


def _net_from(data: bytes, resolution: int) -> DigitsNet:
    net = DigitsNet(resolution)
    net.load_state_dict(load(data))
    return net.eval().requires_grad_(False)


def load_digits_net(directory: str | os.PathLike | None = None, resolution: int = 8) -> DigitsNet:
    """The digits feature network at ``resolution`` (8 or 16).

    Default: the reference weights shipped in ``WEIGHTS_DIR``, SHA-256-verified (DigitsWeightsError otherwise):
    every digits-FID reported by this project uses them. With ``directory``: the recipe trained on this
    machine, cached there and retrained only when the cache key changes (for checking the recipe; on another
    machine its FIDs differ from the reference's by up to ~1 %)."""
    if resolution not in SHIPPED_WEIGHTS:
        raise ValueError(f"DigitsNet resolution must be one of {sorted(SHIPPED_WEIGHTS)}, got {resolution}")
    if directory is None:
        name, sha256 = SHIPPED_WEIGHTS[resolution]
        path = WEIGHTS_DIR / name
        if not path.is_file():
            raise DigitsWeightsError(f"{path}: the shipped digits feature network is missing; reinstall sit-vit5")
        data = path.read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise DigitsWeightsError(f"{path}: SHA-256 {actual}, expected {sha256}; "
                                     "not the reference network, refusing to load it")
        return _net_from(data, resolution)
    path = Path(directory) / f"digits_featnet-{cache_key(resolution)}.safetensors"
    if path.is_file():
        return _net_from(path.read_bytes(), resolution)
    net = train_digits_net(resolution)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(save(net.state_dict()))
    os.replace(tmp.name, path)  # atomic: a concurrent reader never sees half a file
    return net


def to_digits_input(images: torch.Tensor, resolution: int = 8) -> torch.Tensor:
    """[N, H, W] or [N, 1, H, W] float in [-1, 1] → float32 [N, 1, R, R] (R = ``resolution``), clamped;
    area-resized, except smaller images for the 16×16 network: bilinear, as its data was made."""
    if images.ndim == 3:
        images = images.unsqueeze(1)
    if images.ndim != 4 or images.shape[1] != 1 or not images.is_floating_point():
        raise ValueError(
            f"digits images must be float [N, 1, H, W] or [N, H, W] in [-1, 1], got {images.dtype} "
            f"{tuple(images.shape)}"
        )
    images = images.float().cpu()
    side = (resolution, resolution)
    if images.shape[-2:] != side:
        upsample = resolution == 16 and images.shape[-1] < resolution
        images = (F.interpolate(images, size=side, mode="bilinear", align_corners=False) if upsample
                  else F.interpolate(images, size=side, mode="area"))
    return images.clamp(-1.0, 1.0)


def uint8_to_digits_input(array: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 1 or 3] (written as clamp(127.5·x + 128)) → float [N, 1, H, W] in [-1, 1].

    (u − 127.5)/127.5 is the midpoint of the values that map to u; RGB is averaged to gray.
    """
    x = torch.from_numpy(np.asarray(array, dtype=np.float32)).mean(dim=3, keepdim=True)
    return ((x - 127.5) / 127.5).permute(0, 3, 1, 2)


@functools.lru_cache(maxsize=4)
def _real_stats(net: DigitsNet) -> tuple[np.ndarray, np.ndarray]:
    images, _ = digits_split("all", net.resolution)
    return feature_statistics(net.features(images))


@torch.no_grad()
def digits_metrics(
    images: torch.Tensor, labels: torch.Tensor | None = None, net: DigitsNet | None = None
) -> dict[str, float]:
    """Digits FID against all 1,797 real digits, and (with labels [N]) class accuracy.

    images: [N, 1, H, W] or [N, H, W] in [-1, 1], N >= 2. net: default load_digits_net() (8×8); a 16×16
    network (``load_digits_net(resolution=16)``) scores at 16×16 against the 16×16 upsampled real digits.
    Returns {"digits_fid", "digits_accuracy" (if labels), "num_samples"}.
    """
    net = net or load_digits_net()
    x = to_digits_input(images, getattr(net, "resolution", 8))
    if x.shape[0] < 2:
        raise ValueError(f"digits_metrics needs at least 2 images, got {x.shape[0]}")
    mu, sigma = feature_statistics(net.features(x))
    out = {"digits_fid": frechet_distance(mu, sigma, *_real_stats(net)), "num_samples": x.shape[0]}
    if labels is not None:
        labels = torch.as_tensor(labels).cpu().long().reshape(-1)
        if labels.shape[0] != x.shape[0]:
            raise ValueError(f"digits_metrics: {x.shape[0]} images but {labels.shape[0]} labels")
        out["digits_accuracy"] = (net(x).argmax(1) == labels).double().mean().item()
    return out
