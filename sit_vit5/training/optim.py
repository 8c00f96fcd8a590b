"""The optimizer's settings: AdamW parameter groups and the lr schedule (linear warmup, then
constant). With ``weight_decay > 0`` only weight matrices (``ndim >= 2``) other than
``pos_embed`` and ``register_tokens`` decay, as in the official ViT-5 code; with 0 (the SiT/DiT
recipe) everything is one group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

#: Weight tensors exempt from decay although they are >= 2-D (matched on the parameter's own name).
NO_DECAY_NAMES = ("pos_embed", "register_tokens")


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether ``param`` (dotted ``name``) gets weight decay under the rule above."""
    return param.ndim >= 2 and name.rsplit(".", 1)[-1] not in NO_DECAY_NAMES


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters as AdamW groups ``[{params, weight_decay}, {params, 0.0}]`` (one group
    when ``weight_decay == 0``), in ``named_parameters`` order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if weight_decay == 0:
        return [{"params": [p for _, p in named], "weight_decay": 0.0}]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


def adamw_kernel(groups: Iterable[dict[str, Any]], sharded: bool = False) -> dict[str, bool]:
    """AdamW's implementation keyword for these parameter groups: ``{"fused": True}`` when every
    parameter is on CUDA and the model is not sharded, else ``{}`` (torch's default). Why: torch's
    CUDA default, foreach, makes 7 passes over the fp32 state (72 B per parameter), fused one (28 B;
    docs/gpu-cost-model.md: SiT-XL/2 compiled MFU 29 -> 33 %). The CPU keeps its optimizer, so its
    weights stay bit for bit. fp16's GradScaler works with fused (``scaler.step`` hands it
    ``found_inf`` and the kernel skips the step). FSDP2 (``sharded``) keeps foreach: torch shards
    ``_fused_adamw_`` as a pointwise DTensor op, but mixing it with the scaler's plain found_inf
    tensor has failed before (pytorch#126670) and no GPU here can check it."""
    devices = {p.device.type for g in groups for p in g["params"]}
    return {"fused": True} if devices == {"cuda"} and not sharded else {}


def learning_rate(cfg_optim: dict[str, Any], step: int) -> float:
    """lr of optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``, constant."""
    warmup = cfg_optim["warmup_steps"]
    return cfg_optim["lr"] * (min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)
