"""Class-label names: where they come from (ImageNet's list, a file) and how ``class_labels``
arguments (ids, names, tensors) become class ids, with one-line errors naming the value at fault.

Names follow DiT's ``id2label``: class id -> name, comma-separated synonyms allowed
(``"tiger cat, Felis tigris"``); ``label_index`` maps every synonym to its id.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGENET_CLASSES = 1000


def imagenet_id2label() -> dict[int, str] | None:
    """The 1000 ImageNet-1k class names by id (torchvision's list, shipped with the package: no
    download); None when torchvision is not installed."""
    try:
        from torchvision.models import ResNet50_Weights
    except ImportError:
        return None
    return dict(enumerate(ResNet50_Weights.IMAGENET1K_V1.meta["categories"]))


def read_id2label(path: str | Path) -> dict[int, str]:
    """Class names from a file: JSON (``{"0": "tench", ...}`` or a list of names) or text (one
    name per line, line i = class i)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(data, list):
        return dict(enumerate(map(str, data)))
    if isinstance(data, dict):
        return {int(k): str(v) for k, v in data.items()}
    raise ValueError(f"{path}: expected a JSON object {{id: name}}, a JSON list or one name a line")


def is_integer(value: Any) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an int to Python, never a class id)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def class_names(
    id2label: Mapping[int | str, str] | None, num_classes: int | None
) -> dict[int, str]:
    """``id2label`` with int keys (JSON gives strings); None = ImageNet's names for a 1000-class
    model, else none. Raises ValueError for an id outside [0, num_classes)."""
    if id2label is None and num_classes == IMAGENET_CLASSES:
        id2label = imagenet_id2label()
    names = {int(k): str(v) for k, v in (id2label or {}).items()}
    bad = [k for k in names if num_classes is not None and not 0 <= k < num_classes]
    if bad:
        raise ValueError(f"id2label: class id {bad[0]} is out of range for a model with "
                         f"{num_classes} classes")
    return names


def label_index(names: Mapping[int, str]) -> dict[str, int]:
    """Each name and synonym (comma-separated in ``names``' values) -> its class id, sorted."""
    return dict(sorted(
        (name.strip(), k) for k, value in names.items() for name in value.split(",")
    ))


def label_ids(labels: Mapping[str, int], label: str | Sequence[str]) -> list[int]:
    """Class ids of label names (one name or a list) in ``labels`` (:func:`label_index`); an
    unknown name raises a one-line ValueError naming it, with close names as hints."""
    names = [label] if isinstance(label, str) else list(label)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"get_label_ids: {name!r} is not a label name (a str)")
        if name in labels:
            continue
        if not labels:
            raise ValueError(f"class_labels: {name!r} is a name, but this pipeline has no "
                             "label names (id2label); pass class ids, or load it with "
                             "id2label={...}")
        close = [k for k in labels if name.lower() in k.lower()][:3] or \
            difflib.get_close_matches(name, list(labels), n=3)  # "cat": "tiger cat"
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"class_labels: {name!r} is not a label name of this pipeline{hint} "
                         f"(pipe.labels maps its {len(labels)} names to ids)")
    return [labels[name] for name in names]


def class_ids(class_labels: Any, labels: Mapping[str, int], num_classes: int) -> list[int]:
    """``class_labels`` (an id, a name, a list of either, an integer tensor / array) as ids in
    [0, num_classes), names looked up in ``labels``; else a one-line TypeError / ValueError naming
    the value at fault."""
    n = num_classes
    expected = f"a class id (an int in [0, {n})) or a label name"
    if isinstance(class_labels, (torch.Tensor, np.ndarray)):
        dtype = class_labels.dtype
        integral = (not dtype.is_floating_point and not dtype.is_complex
                    and dtype != torch.bool) if isinstance(dtype, torch.dtype) \
            else np.issubdtype(dtype, np.integer)
        if not integral:
            raise TypeError(f"class_labels: a {dtype} tensor; class ids are integers in [0, {n})")
        items: list[Any] = class_labels.reshape(-1).tolist()
    elif isinstance(class_labels, (list, tuple)):
        items = list(class_labels)
    elif isinstance(class_labels, str) or is_integer(class_labels):
        items = [class_labels]
    else:
        kind = type(class_labels).__name__
        raise TypeError(f"class_labels: {class_labels!r} ({kind}) is not {expected}, nor a "
                        "list of them")
    if not items:
        raise ValueError(f"class_labels is empty: give at least one class id or label name "
                         f"(this model has {n} classes)")
    ids = []
    for item in items:
        if isinstance(item, str):
            ids += label_ids(labels, item)
        elif is_integer(item):
            ids.append(int(item))
        else:
            raise TypeError(f"class_labels: {item!r} ({type(item).__name__}) is not {expected}")
    bad = next((i for i in ids if not 0 <= i < n), None)
    if bad is not None:
        raise ValueError(f"class_labels: {bad} is out of range; this model has {n} classes "
                         f"(ids 0..{n - 1})")
    return ids
