"""Backbones: the SiT/DiT baseline and the ViT-5 diffusion transformer, one registry for both
(``DiT-*`` names: the SiT network under DiT's ddpm objective)."""

from .checkpoint_files import CheckpointError, LoadedModel, load_checkpoint, load_state_dict
from .diffusers_dit import from_diffusers_dit, to_diffusers_dit
from .loading import load_model
from .official import OFFICIAL_WEIGHTS, WeightsUnavailableError, resolve_checkpoint
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

__all__ = [
    "BACKBONES", "NAME_OBJECTIVES", "OFFICIAL_WEIGHTS", "SIZES", "architecture_name",
    "SIT_SWITCHES", "VIT5_SWITCHES", "CheckpointError", "LoadedModel", "SiT", "ViT5",
    "WeightsUnavailableError", "count_params", "create_model", "flops", "from_diffusers_dit",
    "list_models", "name_objective", "name_objective_conflict", "load_checkpoint", "load_model",
    "model_from_config", "load_state_dict", "resolve_checkpoint", "to_diffusers_dit",
    "valid_overrides",
]
