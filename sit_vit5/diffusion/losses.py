"""Gaussian KL and the discretised Gaussian decoder likelihood used by the variational bound (DDPM
sec. 3.3).

Both are per element, in nats; callers average over non-batch dims and divide by ``log 2`` for bits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: data in [-1, 1] quantised to 256 levels: each level owns a bin of half-width 1 / 255
BIN_HALF_WIDTH = 1.0 / 255.0
#: edges of the first / last bin, beyond which the bin extends to -inf / +inf
EDGE = 0.999
_LOG_FLOOR = 1e-12


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` per element, in nats (broadcasting)."""
    return 0.5 * (
        logvar2
        - logvar1
        - 1.0
        + torch.exp(logvar1 - logvar2)
        + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def approx_standard_normal_cdf(x: Tensor) -> Tensor:
    """The tanh approximation of the standard normal CDF that ADM/DiT use (|error| < 2e-4); kept,
    not erf, so the VLB term -- and therefore training -- has DiT's numerics."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x: Tensor, *, means: Tensor, log_scales: Tensor) -> Tensor:
    """``log P(bin of x)`` under ``N(means, exp(log_scales)^2)`` for ``x`` on the 8-bit grid in [-1,
    1].

    The bin is ``[x - 1/255, x + 1/255]``, extended to ``-inf`` for ``x < -0.999`` and ``+inf`` for
    ``x > 0.999``. Shapes broadcast; returns natural-log probabilities shaped like ``x``.
    """
    if not x.shape == means.shape == log_scales.shape:
        raise ValueError(
            f"shapes differ: x {tuple(x.shape)}, means {tuple(means.shape)}, "
            f"log_scales {tuple(log_scales.shape)}"
        )
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + BIN_HALF_WIDTH))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - BIN_HALF_WIDTH))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=_LOG_FLOOR))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=_LOG_FLOOR))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=_LOG_FLOOR))
    return torch.where(
        x < -EDGE, log_cdf_plus, torch.where(x > EDGE, log_one_minus_cdf_min, log_delta)
    )
