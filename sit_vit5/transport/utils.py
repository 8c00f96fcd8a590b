"""Small shared helpers for the transport package: broadcasting, reductions, registry look-up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

V = TypeVar("V")


def expand_t_like_x(t: Tensor | float, x: Tensor) -> Tensor:
    """Reshape time to broadcast against ``x``: ``(B,)``, ``(B, 1, ...)`` or a scalar -> ``(B, 1, ..., 1)``.

    Idempotent (an already expanded ``t`` passes through), so path methods may call each other freely.
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


def choose(registry: Mapping[Any, V], key: Any, what: str) -> V:
    """``registry[key]``, or a ValueError that names the bad ``what`` value and lists the valid ones."""
    try:
        return registry[key]
    except (KeyError, TypeError):
        valid = ", ".join(repr(k) for k in registry)
        raise ValueError(f"unknown {what} {key!r}; valid options: {valid}") from None
