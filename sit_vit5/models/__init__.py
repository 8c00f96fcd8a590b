"""Backbones: the SiT/DiT baseline and the ViT-5 diffusion transformer, one registry for both
(``DiT-*`` names: the SiT network under DiT's ddpm objective)."""

from .checkpoint import CheckpointError, load_checkpoint, load_state_dict
from .diffusers_dit import from_diffusers_dit, to_diffusers_dit
from .loading import LoadedModel, load_model
from .official import OFFICIAL_WEIGHTS, WeightsUnavailableError, resolve_checkpoint
from .registry import (
    BACKBONES,
    NAME_OBJECTIVES,
    SIZES,
    count_params,
    create_model,
    flops,
    list_models,
    model_from_config,
    name_objective,
    valid_overrides,
)
from .sit import SIT_SWITCHES, SiT
from .vit5 import VIT5_SWITCHES, ViT5

__all__ = [
    "BACKBONES",
    "NAME_OBJECTIVES",
    "OFFICIAL_WEIGHTS",
    "SIZES",
    "SIT_SWITCHES",
    "VIT5_SWITCHES",
    "CheckpointError",
    "LoadedModel",
    "SiT",
    "ViT5",
    "WeightsUnavailableError",
    "count_params",
    "create_model",
    "flops",
    "from_diffusers_dit",
    "list_models",
    "name_objective",
    "load_checkpoint",
    "load_model",
    "model_from_config",
    "load_state_dict",
    "resolve_checkpoint",
    "to_diffusers_dit",
    "valid_overrides",
]
