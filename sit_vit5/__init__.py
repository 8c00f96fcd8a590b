"""sit-vit5: SiT-family latent diffusion with SiT and ViT-5 backbones."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Top-level names, imported on first use (diffusers is heavy). diffusers' pipeline loader resolves a
# component saved as ["sit_vit5", "ViT5"] by getattr on this package, and picks the load method by
# testing the class against getattr(sit_vit5, "ModelMixin") / ("SchedulerMixin"): hence those two
# re-exports.
_LAZY = {
    "SiT": "sit_vit5.models",
    "ViT5": "sit_vit5.models",
    "create_model": "sit_vit5.models",
    "SiTPipeline": "sit_vit5.pipeline",
    "SiTScheduler": "sit_vit5.pipeline",
    "ModelMixin": "diffusers",
    "SchedulerMixin": "diffusers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sit_vit5' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
