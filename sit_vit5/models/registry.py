"""Model registry: ``create_model("SiT-XL/2" | "ViT5-B/4" | "DiT-XL/2" | ..., **overrides)``,
parameter and FLOP counts. ``DiT-*`` names are the SiT architecture (DiT and SiT share it, key for
key) that is trained and sampled with DiT's objective: :func:`name_objective` says so."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..names import MODEL_NAME as _NAME
from ..names import MODEL_NAMES, NAME_OBJECTIVES, PATCH_SIZES, SIZES, name_objective
from .sit import SIT_SWITCHES, SiT
from .vit5 import ViT5

__all__ = ["BACKBONES", "NAME_OBJECTIVES", "SIZES", "architecture_name", "count_params",
           "create_model", "flops", "list_models", "model_from_config", "name_objective",
           "name_objective_conflict", "valid_overrides"]

#: backbone prefix -> class, in ``names.BACKBONE_NAMES`` order (DiT: SiT under the ddpm objective)
BACKBONES: dict[str, type[SiT]] = {"SiT": SiT, "ViT5": ViT5, "DiT": SiT}
#: ``model`` config keys whose None means "take it from the data" (training fills them in).
DATA_DERIVED_KEYS = ("input_size", "in_channels", "num_classes")


def list_models() -> list[str]:
    """All registered names, e.g. ``SiT-XL/2``."""
    return list(MODEL_NAMES)


def architecture_name(name: str) -> str:
    """The network a model name builds, under its class's name (``DiT-XL/2`` -> ``SiT-XL/2``)."""
    match = _NAME.match(name)
    if not match or match["backbone"] not in BACKBONES:
        return name
    return f"{BACKBONES[match['backbone']].__name__}-{match['size']}/{match['patch']}"


def name_objective_conflict(
    name: str, objective: str, key: str = "transport.objective"
) -> str | None:
    """What is wrong when model ``name`` implies another objective than ``objective`` (None:
    nothing): the one wording of that check, for configs and for loading (``key``: how the caller
    names the objective)."""
    implied = name_objective(name)
    if implied is None or implied == objective:
        return None
    return (f"{name} is the SiT network trained with the {implied} objective: set "
            f"{key}={implied}, or use the SiT-* name for {key}={objective}")


def valid_overrides() -> list[str]:
    """Keyword arguments ``create_model`` accepts."""
    params = [p for p in inspect.signature(SiT.__init__).parameters
              if p not in ("self", "switches")]
    return sorted(params + list(SIT_SWITCHES))


def create_model(name: str, **overrides) -> SiT:
    """Build a registered model; ``overrides`` replace any constructor argument or architecture
    switch."""
    match = _NAME.match(name)
    if not match or match["backbone"] not in BACKBONES or int(match["patch"]) not in PATCH_SIZES:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(list_models())}")
    unknown = set(overrides) - set(valid_overrides())
    if unknown:
        raise ValueError(
            f"unknown override(s) {sorted(unknown)} for {name}; valid: {valid_overrides()}")
    depth, hidden_size, num_heads = SIZES[match["size"]]
    kwargs = dict(depth=depth, hidden_size=hidden_size, num_heads=num_heads,
                  patch_size=int(match["patch"]))
    return BACKBONES[match["backbone"]](**{**kwargs, **overrides})


def model_kwargs(section: dict[str, Any]) -> dict[str, Any]:
    """``create_model`` keywords of a ``model`` config section: every key but ``name``. None is
    passed through (it means "off" for switches such as ``layer_scale_init``), except for
    data-derived keys still unset."""
    return {k: v for k, v in section.items()
            if k != "name" and not (v is None and k in DATA_DERIVED_KEYS)}


def model_from_config(section: dict[str, Any]) -> SiT:
    """``create_model(name, **overrides)`` from a (resolved) ``model`` config section."""
    return create_model(section["name"], **model_kwargs(section))


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (the frozen SiT pos-embed included unless ``trainable_only``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def flops(model: SiT, input_size: int | None = None) -> float:
    """Analytic forward GFLOPs per sample (multiply-add = 1 flop; matmuls and attention only).

    Counts patch embed, timestep MLP, adaLN, qkv/proj, attention (QK^T and AV), MLP and the output
    layer, for a latent of side ``input_size`` (default: the training size). Norms, RoPE and softmax
    are ignored.
    """
    side = input_size or model.input_size
    p, D = model.patch_size, model.x_embedder.proj.out_channels
    n_patches = (side // p) ** 2
    n = n_patches + model.num_registers
    block = model.blocks[0]
    mlp_macs = sum(m.in_features * m.out_features for m in block.mlp.modules()
                   if isinstance(m, nn.Linear))
    per_block = 6 * D * D + n * (4 * D * D + mlp_macs) + 2 * n * n * D
    embed = (n_patches * model.in_channels * p * p * D
             + model.t_embedder.frequency_embedding_size * D + D * D)
    final = 2 * D * D + n_patches * D * p * p * model.out_channels
    return (embed + len(model.blocks) * per_block + final) / 1e9
