"""Divergence estimators for the probability-flow likelihood, and bits/dim.

The likelihood is the density of the data *in the space the model sees* (e.g. VAE latents, or images
scaled to [-1, 1]) as a continuous variable: no dequantization noise and no offset for 8-bit pixels
is added.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .rng import Resolved, rademacher_like, randn_like

#: Hutchinson probe distributions (both have E[e e^T] = I); Rademacher has the lower variance
PROBES: dict[str, Callable[[Tensor, Resolved], Tensor]] = {
    "rademacher": rademacher_like,
    "gaussian": randn_like,
}


def exact_divergence(v: Tensor, x: Tensor) -> Tensor:
    """``sum_i d v_i / d x_i`` per sample, ``(B,)``: one backward pass per dimension (small data
    only)."""
    flat_v = v.flatten(1)
    div = torch.zeros(len(x), dtype=x.dtype, device=x.device)
    for i in range(flat_v.shape[1]):
        grad = torch.autograd.grad(flat_v[:, i].sum(), x, retain_graph=True)[0]
        div = div + grad.flatten(1)[:, i]
    return div


def hutchinson_divergence(v: Tensor, x: Tensor, probes: Tensor) -> Tensor:
    """Unbiased ``mean_k e_k^T (dv/dx) e_k`` per sample, ``(B,)``; ``probes`` has shape ``(K,
    *x.shape)``."""
    total = torch.zeros(len(x), dtype=x.dtype, device=x.device)
    for e in probes:
        grad = torch.autograd.grad(v, x, grad_outputs=e, retain_graph=True)[0]
        total = total + (grad * e).flatten(1).sum(dim=1)
    return total / len(probes)


def bits_per_dim(logp: Tensor, dims: int | tuple[int, ...] | torch.Size) -> Tensor:
    """``-logp / (D ln 2)`` for a log-likelihood in nats; ``dims`` is D or the per-sample shape."""
    d = dims if isinstance(dims, int) else math.prod(dims)
    return -logp / (d * math.log(2))
