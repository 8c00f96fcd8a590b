"""Class labels of bulk (FID) samples: how they are drawn (``--label-sampling``) and counted.

* ``random`` (the default; DiT/SiT's sample_ddp): sample ``i``'s label is uniform in
  ``[0, num_classes)``, drawn from its own generator (:func:`random_labels`).
* ``equal`` (the ADM / REPA-E convention): exactly ``num_samples / num_classes`` samples of every
  class (50 per class for 50K ImageNet samples), in a seeded shuffled order. ``num_samples`` must
  be a multiple of ``num_classes``; another count is refused (:func:`check_label_sampling`), so a
  file that says ``equal`` is always exactly balanced.

Either way, the label of sample ``i`` is a pure function of ``(global_seed, num_samples,
num_classes, i)`` (``random``: of ``(global_seed, num_classes, i)``), so any process can label any
index: sharded and resumed runs get the same labels as one process in one go.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from ..names import LABEL_SAMPLINGS
from ..utils.errors import SettingError
from .sampling_pipeline import random_labels

DEFAULT_LABEL_SAMPLING = LABEL_SAMPLINGS[0]
EQUAL_ORDER_TAG = 0x45514C  # "EQL": keeps the shuffle's seed apart from the per-sample streams


def check_label_sampling(label_sampling: str, num_samples: int, num_classes: int) -> None:
    """Raise SettingError naming ``label_sampling`` when it is unknown, or when it is ``equal``
    and ``num_samples`` is not a multiple of ``num_classes`` (the nearest counts that are are
    suggested)."""
    if label_sampling not in LABEL_SAMPLINGS:
        raise SettingError("label_sampling", label_sampling,
                           f"; valid: {', '.join(LABEL_SAMPLINGS)}")
    if label_sampling == "equal" and num_samples % num_classes:
        below = num_samples - num_samples % num_classes
        options = " or ".join(str(n) for n in (below, below + num_classes) if n > 0)
        raise SettingError("label_sampling", label_sampling,
                           f": {num_samples} samples (--num-samples) are not a multiple of the "
                           f"model's {num_classes} classes, so not every class can occur equally "
                           f"often; use --num-samples {options}, or --label-sampling random")


@lru_cache(maxsize=4)
def _equal_order(global_seed: int, num_samples: int, num_classes: int) -> np.ndarray:
    """All ``num_samples`` labels of an ``equal`` run, int64 ``[num_samples]`` (read-only):
    ``arange(N) % K`` permuted by a PCG64 generator seeded with (seed, N, K, tag)."""
    if global_seed < 0:
        raise ValueError(f"seeds must be >= 0, got global_seed={global_seed}")
    seed = np.random.SeedSequence([global_seed, num_samples, num_classes, EQUAL_ORDER_TAG])
    order = np.random.Generator(np.random.PCG64(seed)).permutation(num_samples)
    labels = (order % num_classes).astype(np.int64)
    labels.flags.writeable = False
    return labels


def equal_labels(indices: Sequence[int], global_seed: int, num_samples: int,
                 num_classes: int) -> np.ndarray:
    """Labels (int64 ``[len(indices)]``) of samples ``indices`` of an ``equal`` run of
    ``num_samples``: over all indices ``0 .. num_samples-1`` every class occurs exactly
    ``num_samples / num_classes`` times."""
    check_label_sampling("equal", num_samples, num_classes)
    index = np.asarray(indices, dtype=np.int64)
    if len(index) and (index.min() < 0 or index.max() >= num_samples):
        raise ValueError(f"sample indices must lie in [0, {num_samples}), got "
                         f"{int(index.min())}..{int(index.max())}")
    return _equal_order(int(global_seed), int(num_samples), int(num_classes))[index].copy()


def sample_labels(label_sampling: str, indices: Sequence[int], global_seed: int,
                  num_samples: int, num_classes: int) -> np.ndarray:
    """Labels (int64 ``[len(indices)]``) of samples ``indices`` under ``label_sampling``."""
    check_label_sampling(label_sampling, num_samples, num_classes)
    if label_sampling == "equal":
        return equal_labels(indices, global_seed, num_samples, num_classes)
    return random_labels(list(indices), global_seed, num_classes)


def class_histogram(labels: np.ndarray, num_classes: int) -> list[int]:
    """Samples per class, ``[num_classes]`` (class id = position)."""
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).tolist()
