"""Evaluation pipeline: FID, sFID, Inception Score and precision/recall as the ADM evaluator defines them,
on torch-fidelity's `inception-v3-compat` network (SHA-256 verified weights), plus an offline "digits FID"
for the demo data. CLI: python -m fid SAMPLES REFERENCE (see fid/__main__.py).

The names below are imported on first use: ``python -m fid`` checks its arguments and files before
torch loads (seconds), and importing this package would otherwise load it first.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: public name -> the module that defines it
_LAZY = {
    **dict.fromkeys(["ImageSource", "InputError", "images_from_array", "open_images"], "fid.image_sets"),
    **dict.fromkeys(["digits_metrics", "load_digits_net"], "fid.digits"),
    **dict.fromkeys(["METRICS", "check_sample_size", "evaluate"], "fid.evaluate"),
    **dict.fromkeys(["INCEPTION_FILENAME", "INCEPTION_SHA256", "INCEPTION_URL", "InceptionFeatures",
                     "InceptionWeightsError", "extract_features", "load_inception"], "fid.inception"),
    **dict.fromkeys(["feature_statistics", "frechet_distance", "inception_score", "precision_recall"],
                    "fid.metrics"),
    **dict.fromkeys(["FeatureStats", "Reference", "make_reference", "read_reference", "save_reference"],
                    "fid.reference"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


class _Package(types.ModuleType):
    """This package, keeping ``fid.evaluate`` the function: importing the submodule of the same name
    would otherwise set the package attribute to the module (the eager imports rebound it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # a submodule named like a public function: reached through sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
