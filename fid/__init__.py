"""Evaluation pipeline: FID, sFID, Inception Score and precision/recall as the ADM evaluator defines them,
on torch-fidelity's `inception-v3-compat` network (SHA-256 verified weights), plus an offline "digits FID"
for the demo data. CLI: python -m fid SAMPLES REFERENCE (see fid/__main__.py)."""

from fid.data import ImageSource, InputError, images_from_array, open_images
from fid.digits import digits_metrics, load_digits_net
from fid.evaluate import METRICS, check_sample_size, evaluate
from fid.inception import (
    INCEPTION_FILENAME,
    INCEPTION_SHA256,
    INCEPTION_URL,
    InceptionFeatures,
    InceptionWeightsError,
    extract_features,
    load_inception,
)
from fid.metrics import feature_statistics, frechet_distance, inception_score, precision_recall
from fid.reference import FeatureStats, Reference, make_reference, read_reference, save_reference

__all__ = [
    "INCEPTION_FILENAME",
    "INCEPTION_SHA256",
    "INCEPTION_URL",
    "METRICS",
    "check_sample_size",
    "FeatureStats",
    "ImageSource",
    "InceptionFeatures",
    "InceptionWeightsError",
    "InputError",
    "Reference",
    "digits_metrics",
    "evaluate",
    "extract_features",
    "feature_statistics",
    "frechet_distance",
    "images_from_array",
    "inception_score",
    "load_digits_net",
    "load_inception",
    "make_reference",
    "open_images",
    "precision_recall",
    "read_reference",
    "save_reference",
]
