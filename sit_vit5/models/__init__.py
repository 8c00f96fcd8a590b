"""Backbones: the SiT/DiT baseline and the ViT-5 diffusion transformer, one registry for both."""

from .checkpoint import CheckpointError, load_checkpoint, load_state_dict
from .registry import BACKBONES, SIZES, count_params, create_model, flops, list_models, valid_overrides
from .sit import SIT_SWITCHES, SiT
from .vit5 import VIT5_SWITCHES, ViT5

__all__ = [
    "BACKBONES",
    "SIZES",
    "SIT_SWITCHES",
    "VIT5_SWITCHES",
    "CheckpointError",
    "SiT",
    "ViT5",
    "count_params",
    "create_model",
    "flops",
    "list_models",
    "load_checkpoint",
    "load_state_dict",
    "valid_overrides",
]
