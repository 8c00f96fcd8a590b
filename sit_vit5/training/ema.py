"""Exponential moving average of the weights (DiT/SiT ``update_ema``), kept in fp32."""

from __future__ import annotations

import copy

import torch
from torch import nn


def create_ema(model: nn.Module) -> nn.Module:
    """An fp32 copy of ``model`` in eval mode without gradients."""
    ema = copy.deepcopy(model).float().eval()
    ema.requires_grad_(False)
    return ema


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """``ema_p ← decay·ema_p + (1 − decay)·p`` for every parameter (frozen too, as DiT),
    read as fp32 from the unwrapped ``model``; buffers copied."""
    ema_params = dict(ema.named_parameters())
    params = dict(model.named_parameters())
    if params.keys() != ema_params.keys():
        differ = sorted(params.keys() ^ ema_params.keys())[:5]
        raise KeyError(f"EMA and model parameters differ: {differ}")
    targets = [ema_params[name] for name in params]
    sources = [p.detach().to(torch.float32) for p in params.values()]
    # same arithmetic as DiT's mul_(decay).add_(p, alpha=1 - decay), grouped into a few kernels
    torch._foreach_mul_(targets, decay)
    torch._foreach_add_(targets, sources, alpha=1.0 - decay)
    ema_buffers = dict(ema.named_buffers())
    for name, buffer in model.named_buffers():
        ema_buffers[name].copy_(buffer)
