"""The ADM evaluation protocol end to end: sample images + reference → FID, sFID, IS, precision/recall."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from fid.image_sets import ImageSource, InputError
from fid.inception import InceptionFeatures, extract_features
from fid.metric_names import METRICS, check_metrics
from fid.metrics import frechet_distance, inception_score, precision_recall
from fid.reference import FeatureStats, Reference


def evaluate(
    samples: ImageSource,
    reference: Reference,
    extractor: InceptionFeatures,
    metrics: Sequence[str] = tuple(METRICS),
    batch_size: int = 64,
    device: str = "cpu",
    num_samples: int | None = None,
    splits: int = 10,
    k: int = 3,
) -> dict[str, float | int]:
    """Evaluate `samples` (uint8 [N, H, W, 3]) against `reference`.

    num_samples: use the first num_samples images (an error if there are fewer); None = all.
    Returns a dict with the requested entries among fid, sfid, inception_score, inception_score_std,
    precision, recall, plus num_samples and num_reference_images (0 when the reference images were not read).
    """
    metrics = check_metrics(metrics)
    n = len(samples) if num_samples is None else num_samples
    if n > len(samples):
        raise InputError(f"{samples.name}: --num-samples {n} requested but it holds only {len(samples)} images")
    need = max([2] + [splits for m in metrics if m == "is"] + [k + 1 for m in metrics if m == "pr"])
    if n < need:
        raise InputError(f"{samples.name}: {n} images is too few for metrics {metrics}; need at least {need}")
    if "pr" in metrics and reference.images is None:
        raise InputError(
            f"{reference.path}: no reference images 'arr_0', so 'pr' is unavailable; drop it from --metrics"
        )
    if "pr" in metrics and len(reference.images) <= k:
        raise InputError(f"{reference.path}: {len(reference.images)} reference images; 'pr' needs more than {k}")

    feats = extract_features(extractor, samples.batches(batch_size, n), n, device, desc="samples")
    needs_ref_images = "pr" in metrics or (reference.stats is None and {"fid", "sfid"} & set(metrics))
    ref_feats, ref_stats = None, reference.stats
    if needs_ref_images:
        ref_images = reference.images
        ref_feats = extract_features(
            extractor, ref_images.batches(batch_size), len(ref_images), device, desc="reference"
        )
        if ref_stats is None:
            ref_stats = FeatureStats.from_features(ref_feats)

    results: dict[str, float | int] = {}
    if "fid" in metrics or "sfid" in metrics:
        sample_stats = FeatureStats.from_features(feats)
        if "fid" in metrics:
            results["fid"] = frechet_distance(sample_stats.mu, sample_stats.sigma, ref_stats.mu, ref_stats.sigma)
        if "sfid" in metrics:
            results["sfid"] = frechet_distance(
                sample_stats.mu_s, sample_stats.sigma_s, ref_stats.mu_s, ref_stats.sigma_s
            )
    if "is" in metrics:
        results["inception_score"], results["inception_score_std"] = inception_score(feats["logits"], splits)
    if "pr" in metrics:
        results["precision"], results["recall"] = precision_recall(ref_feats["pool"], feats["pool"], k=k, device=device)
    results["num_samples"] = n
    results["num_reference_images"] = 0 if ref_feats is None else int(np.shape(ref_feats["pool"])[0])
    return results


def check_sample_size(samples: ImageSource, reference: Reference, resize: bool = False) -> None:
    """Raise InputError unless the samples have the reference images' size and channels [H, W, C]
    (or ``resize``): Inception resizes both to 299x299, so a 16x16 set against a 256x256 reference
    gives a number, but not one that means anything. A reference of statistics only is checked
    against the image shape its metadata_json records; with none it cannot be: noted on stderr."""
    recorded = (reference.metadata or {}).get("image_shape")
    if reference.images is None and recorded is None:
        print(f"note: {reference.path} holds statistics only; the samples' size "
              f"{samples.shape[2]}x{samples.shape[1]} is not checked against it", file=sys.stderr)
        return
    shape = reference.images.shape[1:] if reference.images is not None else tuple(recorded)
    if tuple(samples.shape[1:]) != tuple(shape) and not resize:
        (_, h, w, c), (rh, rw, rc) = samples.shape, shape
        raise InputError(f"{samples.name}: images are {w}x{h}x{c}, the reference {reference.path} "
                         f"holds {rw}x{rh}x{rc}; sample at the reference's size, or pass "
                         "--resize-samples to evaluate anyway (the number is then not comparable)")
