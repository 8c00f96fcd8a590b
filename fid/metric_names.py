"""The evaluator's metric names, without torch: ``python -m fid`` checks ``--metrics`` before the
networks load, and ``fid.evaluate`` dispatches on the same registry."""

from __future__ import annotations

from collections.abc import Sequence

from fid.image_sets import InputError

# name → what it reports (the one registry of metric names)
METRICS = {
    "fid": "FID: Fréchet distance of pool_3 features (2048-d)",
    "sfid": "sFID: Fréchet distance of Mixed_6d spatial features (2023-d)",
    "is": "Inception Score: bias-free 1008-way logits, contiguous splits",
    "pr": "precision / recall: k-NN balls against the reference images",
}


def check_metrics(metrics: Sequence[str]) -> list[str]:
    """Validate metric names; returns them deduplicated in registry order."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise InputError(f"unknown metrics {unknown or '(none given)'}; choose from {list(METRICS)}")
    return [m for m in METRICS if m in metrics]
