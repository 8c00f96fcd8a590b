"""Inception-v3 features for FID / sFID / IS / precision-recall, from torch-fidelity's `inception-v3-compat`
network (a PyTorch port of the TF graph the ADM evaluator uses, including the TF1 bilinear resize to 299).

The weights file is a pickle, so it is SHA-256 verified before anything unpickles it. The verified bytes are
copied to a private temporary file and only that copy is handed to torch-fidelity, so the file cannot change
between the check and the load.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
from tqdm.auto import tqdm

from fid.provenance import file_sha256 as sha256_of  # noqa: F401  (the one file hash of fid/)

INCEPTION_FILENAME = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_FILENAME}"
# 95,628,359 bytes. Not published by torch-fidelity itself; recorded identically by several independent
# public projects that verified the downloaded file, and its first 8 hex digits match the torch.hub
# file-name convention (name-<sha256 prefix>.pth).
INCEPTION_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"

POOL_DIM, SPATIAL_DIM, LOGITS_DIM = 2048, 17 * 17 * 7, 1008
SPATIAL_CHANNELS = 7  # ADM: mixed_6/conv (= Mixed_6d.branch1x1 after ReLU), channels [:7]


class InceptionWeightsError(RuntimeError):
    """The Inception weights file is missing or its SHA-256 does not match."""


def default_weights_path() -> Path:
    """Where torch-fidelity's own download lands: <torch hub dir>/checkpoints/<file name>."""
    return Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILENAME


def read_verified(path: str | os.PathLike, sha256: str) -> bytes:
    """The file's bytes, after checking their SHA-256 against `sha256`; raises InceptionWeightsError."""
    path = Path(path)
    if not path.is_file():
        raise InceptionWeightsError(
            f"Inception weights not found at {path}.\n"
            f"  Download {INCEPTION_URL}\n"
            f"  (file {INCEPTION_FILENAME}, SHA-256 {INCEPTION_SHA256})\n"
            f"  to {default_weights_path()} or pass its location (--inception-weights PATH)."
        )
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256.lower():
        raise InceptionWeightsError(
            f"SHA-256 of {path} is {actual}, expected {sha256.lower()}; refusing to unpickle it. "
            f"Re-download {INCEPTION_URL}. (A deliberately different file needs its hash passed explicitly; "
            "its numbers are then not comparable to published ones.)"
        )
    return data


def spatial_features(mixed_6d_branch1x1: torch.Tensor) -> torch.Tensor:
    """sFID features: [N, C, 17, 17] → first 7 channels, flattened in (h, w, c) order → [N, 17·17·7].

    (h, w, c) is TF's NHWC memory order, which ADM's reshape([N, -1]) of the spatial tensor flattens.
    """
    x = mixed_6d_branch1x1[:, :SPATIAL_CHANNELS]
    return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)


class InceptionFeatures(nn.Module):
    """Wraps torch-fidelity's network; forward(uint8 [N, 3, H, W]) → dict of float32 features:
    pool [N, 2048] (pool_3), spatial [N, 2023] (sFID), logits [N, 1008] (bias-free, for IS)."""

    def __init__(self, net: FeatureExtractorInceptionV3):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self._spatial: torch.Tensor | None = None
        net.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._spatial = spatial_features(output).float()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"InceptionFeatures expects uint8 images [N, 3, H, W], got {images.dtype} {tuple(images.shape)}"
            )
        self._spatial = None
        pool, logits = self.net(images)
        spatial, self._spatial = self._spatial, None
        return {"pool": pool, "spatial": spatial, "logits": logits}


def load_inception(
    weights_path: str | os.PathLike | None = None,
    sha256: str = INCEPTION_SHA256,
    device: str | torch.device = "cpu",
) -> InceptionFeatures:
    """Build the verified Inception feature network.

    weights_path: torch-fidelity's weights file; None → default_weights_path(). Nothing is downloaded.
    sha256: expected hash. Override it only for tests (e.g. a randomly initialised network saved to a file).
    """
    data = read_verified(weights_path or default_weights_path(), sha256)
    with tempfile.TemporaryDirectory() as tmp:  # mode 0700: only we can swap the verified copy
        copy = Path(tmp) / INCEPTION_FILENAME
        copy.write_bytes(data)
        # torch-fidelity unpickles this with torch.load(weights_only=False): safe, the bytes are verified.
        net = FeatureExtractorInceptionV3(
            "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(copy)
        )
    return InceptionFeatures(net).to(device)


def extract_features(
    extractor: InceptionFeatures,
    batches: Iterable[np.ndarray],
    total: int | None = None,
    device: str | torch.device = "cpu",
    desc: str = "inception",
) -> dict[str, np.ndarray]:
    """Run uint8 NHWC batches [B, H, W, 3] through the network.

    total: number of images, for the progress bar.
    Returns {"pool", "spatial", "logits"}: float32 arrays [N, D].
    """
    out: dict[str, list[np.ndarray]] = {"pool": [], "spatial": [], "logits": []}
    with tqdm(total=total, desc=desc, unit="img", disable=None) as bar:
        for batch in _to_nchw(batches):
            feats = extractor(batch.to(device))
            for name, value in feats.items():
                out[name].append(value.cpu().numpy())
            bar.update(batch.shape[0])
    if not out["pool"]:
        raise ValueError("extract_features got no images")
    return {name: np.concatenate(values) for name, values in out.items()}


def _to_nchw(batches: Iterable[np.ndarray]) -> Iterator[torch.Tensor]:
    for batch in batches:
        # "W": streamed npz batches are read-only buffers, which torch.from_numpy warns about; copy those
        yield torch.from_numpy(np.require(batch, requirements=["C", "W"])).permute(0, 3, 1, 2)
