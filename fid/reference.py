"""Reference batches in the ADM format: an npz with `mu` [2048], `sigma` [2048, 2048] (pool features),
`mu_s` [2023], `sigma_s` [2023, 2023] (sFID spatial features) and `arr_0` (uint8 [N, H, W, 3] images, ADM
ships 10,000 of them, used for precision/recall). E.g. ADM's VIRTUAL_imagenet256_labeled.npz.

A reference may lack the statistics (then they are computed from `arr_0`, as ADM does) or `arr_0` (then
precision/recall is unavailable). A folder of images, or an npz with only `arr_0`, becomes a reference with
make_reference(). Optional members: `arr_1`, class labels of the images (ADM's *_labeled batches), and
`metadata_json` (make_reference: image count and shape, the sample count it is meant for); see fid.provenance for
how they are checked against the samples.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fid.image_sets import ImageSource, InputError, npz_keys, open_images
from fid.inception import InceptionFeatures, extract_features
from fid.metrics import feature_statistics
from fid.provenance import METADATA_KEY, read_class_labels, read_metadata, reference_metadata

STAT_KEYS = ("mu", "sigma", "mu_s", "sigma_s")
PR_IMAGES = 10_000  # ADM's reference batches hold 10K images for precision/recall


@dataclass
class FeatureStats:
    """Float64 moments of the pool (mu, sigma) and spatial (mu_s, sigma_s) Inception features."""

    mu: np.ndarray
    sigma: np.ndarray
    mu_s: np.ndarray
    sigma_s: np.ndarray

    @classmethod
    def from_features(cls, features: dict[str, np.ndarray]) -> FeatureStats:
        """From extract_features() output (keys pool [N, 2048], spatial [N, 2023])."""
        mu, sigma = feature_statistics(features["pool"])
        mu_s, sigma_s = feature_statistics(features["spatial"])
        return cls(mu, sigma, mu_s, sigma_s)


@dataclass
class Reference:
    """stats: precomputed moments or None; images: the reference images (for PR, or stats) or None; labels: class
    labels `arr_1` (int64 [M]) or None; metadata: its `metadata_json` object or None."""

    path: str
    stats: FeatureStats | None
    images: ImageSource | None
    labels: np.ndarray | None = None
    metadata: dict | None = None


def read_reference(path: str | os.PathLike) -> Reference:
    """Open an ADM-format reference npz, or an image folder / npz / npy holding only images."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".npz":
        return Reference(str(path), None, open_images(path))
    if not path.is_file():
        raise InputError(f"{path}: no such reference file (expected an ADM reference .npz or an image set)")
    try:
        keys = npz_keys(path)
    except Exception as e:  # noqa: BLE001 - any failure here means "not a readable npz"
        raise InputError(f"{path}: not a readable npz file ({e})") from None
    present = [k for k in STAT_KEYS if k in keys]
    if present and len(present) != len(STAT_KEYS):
        missing = [k for k in STAT_KEYS if k not in keys]
        raise InputError(f"{path}: reference statistics incomplete: has {present}, missing {missing}")
    if not present and "arr_0" not in keys:
        raise InputError(f"{path}: neither statistics {list(STAT_KEYS)} nor images 'arr_0'; arrays present: {keys}")
    stats = None
    if present:
        with np.load(path, allow_pickle=False) as f:
            stats = FeatureStats(*(f[k].astype(np.float64) for k in STAT_KEYS))
        _check_stats(str(path), stats)
    images = open_images(path, "arr_0") if "arr_0" in keys else None
    return Reference(str(path), stats, images, _reference_labels(path), read_metadata(path))


def _reference_labels(path: Path) -> np.ndarray | None:
    """The reference's class labels `arr_1`, or None. A member that is not class labels is not ours to refuse (the
    reference batch format does not define it): one stderr note, and the classes go unchecked."""
    try:
        return read_class_labels(path)
    except InputError as e:
        print(f"note: {e}; the sample classes are not checked against this reference", file=sys.stderr)
        return None


def save_reference(
    path: str | os.PathLike, stats: FeatureStats, images: np.ndarray | None = None, metadata: str | None = None
) -> None:
    """Write the ADM format: mu, sigma, mu_s, sigma_s (float64) and, if given, arr_0 (uint8 NHWC) and metadata_json
    (``metadata``: JSON text, stored as a 0-d string array)."""
    _check_stats(str(path), stats)
    arrays = {k: np.asarray(getattr(stats, k), np.float64) for k in STAT_KEYS}
    if images is not None:
        arrays["arr_0"] = np.asarray(images, np.uint8)
    if metadata is not None:
        arrays[METADATA_KEY] = np.array(metadata)
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:  # renamed into place: a crash or a full disk never leaves half a reference
        with open(tmp, "wb") as f:  # a file object: np.savez must not append ".npz" to the name
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_reference(
    images: ImageSource,
    extractor: InceptionFeatures,
    out_path: str | os.PathLike | None = None,
    pr_images: int = PR_IMAGES,
    batch_size: int = 64,
    device: str = "cpu",
    seed: int = 0,
    num_samples: int | None = None,
) -> tuple[FeatureStats, np.ndarray]:
    """Statistics over all `images`, plus a subset of `pr_images` of them kept as arr_0 for precision/recall
    (all images when there are fewer; otherwise a seeded uniform subset, in original order).

    Writes the ADM-format npz to out_path when given, with metadata_json recording the image count and shape and
    ``num_samples``, the sample count the reference is meant for (None: any; ``python -m fid`` refuses another).
    Returns (stats, kept images uint8 [M, H, W, 3]).
    """
    n = len(images)
    keep = np.arange(n) if n <= pr_images else np.sort(np.random.default_rng(seed).choice(n, pr_images, False))
    kept: list[np.ndarray] = []

    def batches_keeping_subset():
        start = 0
        for batch in images.batches(batch_size):
            local = keep[(keep >= start) & (keep < start + len(batch))] - start
            kept.append(np.array(batch[local]))
            start += len(batch)
            yield batch

    features = extract_features(extractor, batches_keeping_subset(), n, device, desc="reference")
    stats = FeatureStats.from_features(features)
    arr_0 = np.concatenate(kept)
    if out_path is not None:
        save_reference(out_path, stats, arr_0, reference_metadata(n, tuple(images.shape[1:]), num_samples))
    return stats, arr_0


def _check_stats(name: str, stats: FeatureStats) -> None:
    for mu_key, sigma_key in (("mu", "sigma"), ("mu_s", "sigma_s")):
        mu, sigma = getattr(stats, mu_key), getattr(stats, sigma_key)
        if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
            raise InputError(f"{name}: {mu_key} must be [D] and {sigma_key} [D, D], got {mu.shape} and {sigma.shape}")
