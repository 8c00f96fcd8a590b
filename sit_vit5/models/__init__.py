"""Backbones: the SiT/DiT baseline and the ViT-5 diffusion transformer, one registry for both
(``DiT-*`` names: the SiT network under DiT's ddpm objective).

Loading checkpoints (``load_model``, ``load_checkpoint``), official weights and diffusers DiT
conversion are the platform around the backbones: their names resolve from here on first use, so
that building a model loads only the backbone code.
"""

from __future__ import annotations

import importlib
from typing import Any

from .registry import (
    BACKBONES,
    NAME_OBJECTIVES,
    SIZES,
    architecture_name,
    count_params,
    create_model,
    flops,
    list_models,
    model_from_config,
    name_objective,
    name_objective_conflict,
    valid_overrides,
)
from .sit import SIT_SWITCHES, SiT
from .vit5 import VIT5_SWITCHES, ViT5

#: platform names -> the module of this package that defines them, imported on first use
_PLATFORM = {
    "CheckpointError": "checkpoint_files", "LoadedModel": "checkpoint_files",
    "load_checkpoint": "checkpoint_files", "load_state_dict": "checkpoint_files",
    "from_diffusers_dit": "diffusers_dit", "to_diffusers_dit": "diffusers_dit",
    "load_model": "loading",
    "OFFICIAL_WEIGHTS": "official", "WeightsUnavailableError": "official",
    "resolve_checkpoint": "official",
}

__all__ = [
    "BACKBONES", "NAME_OBJECTIVES", "SIZES", "SIT_SWITCHES", "VIT5_SWITCHES", "SiT", "ViT5",
    "architecture_name", "count_params", "create_model", "flops", "list_models",
    "model_from_config", "name_objective", "name_objective_conflict", "valid_overrides", *_PLATFORM,
]


def __getattr__(name: str) -> Any:
    if name in _PLATFORM:
        return getattr(importlib.import_module(f"{__name__}.{_PLATFORM[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PLATFORM])
