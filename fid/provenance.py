"""How the evaluated samples were made, for the results JSON, and the checks that samples and reference belong together.

A samples npz written by ``sample.py bulk`` carries `metadata_json`: a 0-d string array holding a JSON object
(``json.loads(str(np.load(path)["metadata_json"]))``, no pickle) with the label sampling, class histogram, sampler,
NFE, CFG, precision and checkpoint SHA-256 (sit_vit5.sampling.bulk.sample_metadata). Older files, and samples from
elsewhere, have none: their fields are null and the label sampling "unknown".

A reference npz may carry labels `arr_1` (ADM's *_labeled reference batches) and `metadata_json` (written by
``python -m fid make-reference``: the image shape and count, and the sample count it is meant for, ``--num-samples``).

The rule for refusing a reference (:func:`check_reference_match`), one line naming both files:

* classes: when the samples and the reference both carry labels, every sample class must lie in the reference's
  label range 0..R-1 (R = its largest label + 1), and a model that made the samples (its class count K in the
  samples' metadata) must know every reference class (K >= R). The range, not the set of labels present, is
  compared: a 10,000-image reference batch need not hold every one of 1,000 classes.
* size: a reference that records the sample count it is meant for refuses any other count; ADM's reference batches
  record none (10,000 reference images against 50,000 samples is the standard). The samples' own metadata must
  describe the file: its num_samples and class histogram must be those of `arr_0` / `arr_1`.
* image size (fid.evaluate.check_sample_size): the samples must have the reference images' size, or the size
  the reference's metadata records when it holds statistics only.

Imports neither torch nor sit_vit5: the checks run before the networks load.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from fid.image_sets import InputError, load_plain_array, npz_keys

METADATA_KEY = "metadata_json"  # sit_vit5.sampling.bulk.METADATA_KEY (tests compare them)
REFERENCE_FORMAT = "fid.reference-metadata/1"
LABEL_SAMPLING_UNKNOWN = "unknown"
#: the results JSON's fields copied from the samples' metadata (null when it has none)
METADATA_FIELDS = ("sampler", "nfe_per_image", "cfg_scale", "cfg_interval", "precision", "checkpoint_sha256")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks: fid/'s one file hash (``fid.inception`` uses it
    as ``sha256_of``). A copy of ``sit_vit5.utils.checksums.sha256_file`` on purpose: fid/ imports
    nothing from sit_vit5, so it stays usable on its own."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(path: str | os.PathLike) -> dict[str, Any] | None:
    """The JSON object in an npz's `metadata_json` member (None: not an npz, or no such member); InputError naming
    the file and key when it is not a JSON object in a string array."""
    path = Path(path)
    if path.suffix != ".npz" or not path.is_file():
        return None
    try:
        if METADATA_KEY not in npz_keys(path):
            return None
    except zipfile.BadZipFile:
        return None  # the image reader names the broken file
    name = f"{path}[{METADATA_KEY}]"
    array = load_plain_array(path, METADATA_KEY)
    if array.dtype.kind != "U" or array.ndim != 0:
        raise InputError(f"{name}: must be a 0-d string array holding JSON, got dtype {array.dtype} "
                         f"shape {array.shape}")
    try:
        metadata = json.loads(str(array))
    except ValueError as e:
        raise InputError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(metadata, dict):
        raise InputError(f"{name}: must hold a JSON object, got {type(metadata).__name__}")
    return metadata


def read_class_labels(path: str | os.PathLike, keys: tuple[str, ...] = ("arr_1",)) -> np.ndarray | None:
    """All class labels (int64 [N]) in an npz under the first of ``keys`` present, or None (not an npz, no such
    member); InputError naming the file and key for labels that are not 1-D non-negative integers (integral floats
    pass, as the digits labels do)."""
    path = Path(path)
    if path.suffix != ".npz" or not path.is_file():
        return None
    try:
        key = next((k for k in keys if k in npz_keys(path)), None)
    except zipfile.BadZipFile:
        return None
    if key is None:
        return None
    name = f"{path}[{key}]"
    labels = load_plain_array(path, key)
    integral = labels.dtype.kind in "iu" or (
        labels.dtype.kind == "f" and bool(np.isfinite(labels).all()) and bool((labels == np.round(labels)).all())
    )
    if labels.ndim != 1 or not integral:
        raise InputError(f"{name}: class labels must be a 1-D array of integer class ids, got dtype {labels.dtype} "
                         f"shape {labels.shape}")
    if len(labels) and labels.min() < 0:
        raise InputError(f"{name}: class labels must be >= 0, got {int(labels.min())}")
    return labels.astype(np.int64)


def check_samples_metadata(name: str, metadata: dict[str, Any] | None, num_images: int,
                           labels: np.ndarray | None) -> None:
    """Raise InputError when the samples' metadata does not describe their file (``name``): another sample count
    than ``num_images`` (`arr_0`), or another class histogram than that of all ``labels`` (`arr_1`)."""
    if metadata is None:
        return
    where = f"{name}[{METADATA_KEY}]"
    recorded = metadata.get("num_samples")
    if recorded is not None and recorded != num_images:
        raise InputError(f"{where}: says num_samples={recorded}, but the file holds {num_images} images; the metadata "
                         "is not this file's (merge the samples again with sample.py bulk)")
    histogram = metadata.get("class_histogram")
    if histogram is not None and labels is not None:
        counts = np.bincount(labels, minlength=len(histogram)).tolist()
        if counts != list(histogram):
            differ = next(c for c in range(len(counts)) if c >= len(histogram) or counts[c] != histogram[c])
            got = histogram[differ] if differ < len(histogram) else 0
            raise InputError(f"{where}: its class_histogram does not match the labels arr_1 (class {differ}: {got} "
                             f"recorded, {counts[differ]} in arr_1); the metadata is not this file's")


def check_reference_match(samples: str, reference: str, labels: np.ndarray | None,
                          metadata: dict[str, Any] | None, reference_labels: np.ndarray | None,
                          reference_metadata: dict[str, Any] | None, num_samples: int,
                          reference_classes: int | None = None) -> None:
    """Raise InputError, naming both files, when the reference ``reference`` does not fit the ``num_samples``
    evaluated samples of ``samples`` (module docstring): their ``labels`` (the evaluated ones, int64) outside the
    reference's label range, a model (``metadata["num_classes"]``) that does not know every reference class, or a
    reference made for another sample count. ``reference_classes``: the reference's class count when it is known
    without labels (the digits reference: 10)."""
    count = (reference_metadata or {}).get("num_samples")
    if count is not None and count != num_samples:
        raise InputError(f"{samples}: {num_samples} samples evaluated, but the reference {reference} is for "
                         f"{count} (its {METADATA_KEY} num_samples): FID depends on the sample count; evaluate "
                         f"{count} samples (--num-samples), or use a reference that records no count")
    if reference_labels is not None and len(reference_labels):
        reference_classes = int(reference_labels.max()) + 1
    if reference_classes is None:
        return
    what = (f"the reference {reference} labels classes 0..{reference_classes - 1}"
            + (" (arr_1)" if reference_labels is not None else ""))
    if labels is not None and len(labels) and int(labels.max()) >= reference_classes:
        outside = np.unique(labels[labels >= reference_classes])
        shown = ", ".join(map(str, outside[:5].tolist())) + (", ..." if len(outside) > 5 else "")
        raise InputError(f"{samples}: {len(outside)} sample class(es) ({shown}) outside the reference's: {what}; "
                         "the samples and the reference are of different label sets, so the FID would not mean "
                         "anything: use the reference of the model's dataset")
    model_classes = (metadata or {}).get("num_classes")
    if model_classes is not None and model_classes < reference_classes:
        raise InputError(f"{samples}: made by a model of {model_classes} classes ({METADATA_KEY} num_classes), but "
                         f"{what}: classes the model cannot make; use the reference of the model's dataset")


def provenance(metadata: dict[str, Any] | None, labels: np.ndarray | None, num_samples: int,
               num_in_file: int, reference_sha256: str | None) -> dict[str, Any]:
    """The results JSON's record of how the ``num_samples`` evaluated samples (of ``num_in_file``) were made:
    label_sampling (random | equal from the metadata, else "unknown"), num_classes, class_histogram (samples per class
    id among the evaluated ones: from their labels, else the metadata's when all are evaluated, else null), the
    METADATA_FIELDS (null without metadata), reference_sha256, and the whole sample_metadata (or null)."""
    meta = metadata or {}
    num_classes = meta.get("num_classes")
    if num_classes is None and labels is not None and len(labels):
        num_classes = int(labels.max()) + 1
    if labels is not None:
        histogram = np.bincount(labels[:num_samples], minlength=num_classes or 0).tolist()
    elif num_samples == meta.get("num_samples", num_in_file):
        histogram = meta.get("class_histogram")
    else:
        histogram = None
    return {
        "num_samples": num_samples,
        "num_samples_in_file": num_in_file,
        "label_sampling": meta.get("label_sampling") or LABEL_SAMPLING_UNKNOWN,
        "num_classes": num_classes,
        "class_histogram": histogram,
        **{key: meta.get(key) for key in METADATA_FIELDS},
        "reference_sha256": reference_sha256,
        "sample_metadata": metadata,
    }


def reference_metadata(num_images: int, image_shape: tuple[int, int, int], num_samples: int | None) -> str:
    """The JSON text of a reference's `metadata_json`: the image count of its statistics, the image shape [H, W, C]
    and the sample count it is meant for (None: any)."""
    return json.dumps({"format": REFERENCE_FORMAT, "num_images": num_images, "image_shape": list(image_shape),
                       "num_samples": num_samples}, sort_keys=True)
