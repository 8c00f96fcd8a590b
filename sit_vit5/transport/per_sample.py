"""Per-sample tensor helpers of the transport package: a time per sample broadcast against a batch,
and a mean per sample."""

from __future__ import annotations

import torch
from torch import Tensor


def expand_t_like_x(t: Tensor | float, x: Tensor) -> Tensor:
    """Reshape time to broadcast against ``x``: ``(B,)``, ``(B, 1, ...)`` or a scalar -> ``(B, 1,
    ..., 1)``.

    Idempotent (an already expanded ``t`` passes through), so path methods may call each other
    freely.
    """
    t = torch.as_tensor(t, device=x.device)
    if not t.is_floating_point():
        t = t.to(x.dtype)
    if t.dim() == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.dim() - 1)))


def mean_flat(x: Tensor) -> Tensor:
    """Mean over every non-batch dimension: ``(B, ...) -> (B,)``."""
    return x.mean(dim=tuple(range(1, x.dim())))
