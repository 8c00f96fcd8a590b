"""Image generation from trained models: per-index deterministic sampling (``pipeline``), grids
(``grid``) and bulk (FID) sampling into an ADM-compatible ``.npz`` (``bulk``); the sampler settings
are :class:`~sit_vit5.sample_spec.SampleSpec`.

Determinism: sample ``i`` of a run with global seed ``s`` draws its initial noise, its SDE noise and
(when labels are random) its label from its own generators, seeded by ``sample_seed(s, i, stream)``;
with ``equal`` labels (``labels``), its label is entry i of a seeded balanced order of all N labels.
Its image therefore does not depend on which process made it, on the batch it was in, or on what was
sampled before; bulk sampling can be sharded over any number of processes, batched at any size, and
resumed. Two caveats: (1) a model's float numerics can differ by ~1e-7 between batch sizes (CPU and
GPU matmul kernels depend on the batch shape), which can move a pixel across a uint8 boundary (±1)
in rare cases; (2) adaptive ODE solvers (dopri5, ...) choose their steps from the error of the whole
batch, so their images depend on the batch composition within the solver tolerance. Fixed-step ODE
solvers and all SDE samplers have no such coupling.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..sample_spec import DEFAULT_SAMPLING_METHOD, METHODS, SampleSpec
from .grid import GridResult, generate_first, sample_grid
from .sampling_pipeline import (
    LABEL_STREAM,
    NOISE_STREAM,
    Generated,
    NonFiniteSampleError,
    SamplingPipeline,
    random_labels,
)

#: resumable bulk sampling (FID sets) and its label conventions are a platform layer: their names
#: resolve from here on first use
_BULK = {name: "bulk" for name in ("METADATA_KEY", "BulkResult", "ResumeError", "merge_parts",
                                   "sample_bulk", "sample_metadata", "scan_parts")}
_BULK.update({name: "labels" for name in ("LABEL_SAMPLINGS", "class_histogram", "equal_labels",
                                          "sample_labels")})

__all__ = [
    "DEFAULT_SAMPLING_METHOD", "LABEL_STREAM", "NOISE_STREAM", "METHODS", "Generated", "GridResult",
    "NonFiniteSampleError", "SampleSpec", "SamplingPipeline", "generate_first", "random_labels",
    "sample_grid", *_BULK,
]


def __getattr__(name: str) -> Any:
    if name in _BULK:
        return getattr(importlib.import_module(f"{__name__}.{_BULK[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_BULK])
