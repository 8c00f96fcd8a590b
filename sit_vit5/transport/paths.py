"""Interpolation paths ``x_t = alpha_t * x1 + sigma_t * x0`` (t = 0 noise, t = 1 data), SiT
conventions.

A path is one small class that defines ``compute_alpha_t`` and ``compute_sigma_t`` (each returns the
value and its time derivative); the shared base class derives the SDE drift, diffusion forms,
conversions between velocity / score / noise and the training plan. Method names and signatures
follow SiT's ``transport/path.py`` so SiT code can call them unchanged. ``t`` may be a scalar,
``(B,)`` or already broadcast ``(B, 1, ..., 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..names import choose
from .per_sample import expand_t_like_x


class Path:
    """Shared machinery for a path ``(alpha_t, sigma_t)``; subclasses define the two coefficient
    functions."""

    #: alpha_0 == 0, so alpha_dot / alpha (and thus the SBDM diffusion and score -> velocity) blow
    #: up at t = 0
    alpha_vanishes_at_noise: bool = True

    def compute_alpha_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """Data coefficient ``(alpha_t, d alpha_t / dt)``, each shaped like ``t``."""
        raise NotImplementedError

    def compute_sigma_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """Noise coefficient ``(sigma_t, d sigma_t / dt)``, each shaped like ``t``."""
        raise NotImplementedError

    def compute_d_alpha_alpha_ratio_t(self, t: Tensor) -> Tensor:
        """``alpha_dot / alpha`` (subclasses override with a numerically stable closed form)."""
        alpha_t, d_alpha_t = self.compute_alpha_t(t)
        return d_alpha_t / alpha_t

    def compute_drift(self, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Score-parametrised SDE pieces ``(f, w)``: ``f = -(alpha_dot/alpha) x`` of shape
        ``x.shape`` and ``w = (alpha_dot/alpha) sigma^2 - sigma sigma_dot`` of shape ``(B, 1, ...,
        1)``; ``v = w s - f``."""
        t = expand_t_like_x(t, x)
        ratio = self.compute_d_alpha_alpha_ratio_t(t)
        sigma_t, d_sigma_t = self.compute_sigma_t(t)
        return -ratio * x, ratio * sigma_t**2 - sigma_t * d_sigma_t

    def compute_diffusion(
        self, x: Tensor, t: Tensor, form: str = "constant", norm: float = 1.0
    ) -> Tensor:
        """Diffusion coefficient ``D_t``, shape ``(B, 1, ..., 1)``, for ``form`` (see
        ``DIFFUSION_FORMS``)."""
        t = expand_t_like_x(t, x)
        return choose(DIFFUSION_FORMS, form, "diffusion_form")(self, x, t, norm)

    def _ratio(self, t: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(r, sigma_t, sigma_dot_t)`` with ``r = alpha / alpha_dot``, shaped like ``x``."""
        t = expand_t_like_x(t, x)
        alpha_t, d_alpha_t = self.compute_alpha_t(t)
        sigma_t, d_sigma_t = self.compute_sigma_t(t)
        return alpha_t / d_alpha_t, sigma_t, d_sigma_t

    def get_score_from_velocity(self, velocity: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """``s = (r v - x) / (sigma^2 - r sigma_dot sigma)``, ``r = alpha / alpha_dot``; shape
        ``x.shape``."""
        r, sigma_t, d_sigma_t = self._ratio(t, x)
        return (r * velocity - x) / (sigma_t**2 - r * d_sigma_t * sigma_t)

    def get_noise_from_velocity(self, velocity: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """``eps = (r v - x) / (r sigma_dot - sigma)`` (the x0 that produced x_t); shape
        ``x.shape``."""
        r, sigma_t, d_sigma_t = self._ratio(t, x)
        return (r * velocity - x) / (r * d_sigma_t - sigma_t)

    def get_velocity_from_score(self, score: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """``v = w s - f`` (probability-flow velocity from the score); shape ``x.shape``."""
        f, w = self.compute_drift(x, t)
        return w * score - f

    def compute_mu_t(self, t: Tensor, x0: Tensor, x1: Tensor) -> Tensor:
        """Point on the path: ``alpha_t x1 + sigma_t x0``."""
        t = expand_t_like_x(t, x1)
        return self.compute_alpha_t(t)[0] * x1 + self.compute_sigma_t(t)[0] * x0

    def compute_xt(self, t: Tensor, x0: Tensor, x1: Tensor) -> Tensor:
        """Sample of ``p_t`` given the pair ``(x0, x1)`` (the path is deterministic given the pair).
        """
        return self.compute_mu_t(t, x0, x1)

    def compute_ut(self, t: Tensor, x0: Tensor, x1: Tensor, xt: Tensor) -> Tensor:
        """Conditional target velocity ``alpha_dot x1 + sigma_dot x0``."""
        t = expand_t_like_x(t, x1)
        return self.compute_alpha_t(t)[1] * x1 + self.compute_sigma_t(t)[1] * x0

    def plan(self, t: Tensor, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(t, x_t, u_t)`` for training; ``t`` is returned unchanged, ``(B,)``."""
        xt = self.compute_xt(t, x0, x1)
        return t, xt, self.compute_ut(t, x0, x1, xt)


class LinearPath(Path):
    """Linear interpolant (rectified flow): ``alpha = t``, ``sigma = 1 - t``."""

    def compute_alpha_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        return t, torch.ones_like(t)

    def compute_sigma_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        return 1 - t, -torch.ones_like(t)

    def compute_d_alpha_alpha_ratio_t(self, t: Tensor) -> Tensor:
        return 1 / t


class GVPPath(Path):
    """Generalised variance-preserving path: ``alpha = sin(pi t/2)``, ``sigma = cos(pi t/2)``."""

    def compute_alpha_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        return torch.sin(t * math.pi / 2), math.pi / 2 * torch.cos(t * math.pi / 2)

    def compute_sigma_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cos(t * math.pi / 2), -math.pi / 2 * torch.sin(t * math.pi / 2)

    def compute_d_alpha_alpha_ratio_t(self, t: Tensor) -> Tensor:
        return math.pi / (2 * torch.tan(t * math.pi / 2))


class VPPath(Path):
    """VP-SDE path (Song et al. linear beta schedule, reversed in time): ``alpha = exp(L)``,
    ``sigma = sqrt(1 - exp(2L))``, ``L(t) = -1/4 (1-t)^2 (smax - smin) - 1/2 (1-t) smin``."""

    alpha_vanishes_at_noise = False  # alpha_0 = exp(-5.025) > 0: everything is finite at t = 0

    def __init__(self, sigma_min: float = 0.1, sigma_max: float = 20.0) -> None:
        self.sigma_min, self.sigma_max = sigma_min, sigma_max

    def log_mean_coeff(self, t: Tensor) -> Tensor:
        span = self.sigma_max - self.sigma_min
        return -0.25 * (1 - t) ** 2 * span - 0.5 * (1 - t) * self.sigma_min

    def d_log_mean_coeff(self, t: Tensor) -> Tensor:
        return 0.5 * (1 - t) * (self.sigma_max - self.sigma_min) + 0.5 * self.sigma_min

    def compute_alpha_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        alpha_t = torch.exp(self.log_mean_coeff(t))
        return alpha_t, alpha_t * self.d_log_mean_coeff(t)

    def compute_sigma_t(self, t: Tensor) -> tuple[Tensor, Tensor]:
        alpha_sq = torch.exp(2 * self.log_mean_coeff(t))
        sigma_t = torch.sqrt(1 - alpha_sq)
        return sigma_t, -alpha_sq * self.d_log_mean_coeff(t) / sigma_t

    def compute_d_alpha_alpha_ratio_t(self, t: Tensor) -> Tensor:
        return self.d_log_mean_coeff(t)

    def compute_drift(self, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        # closed form f = -beta/2 x, w = beta/2 (= the generic formula, but exact near t = 1 where
        # sigma -> 0)
        t = expand_t_like_x(t, x)
        beta_t = self.sigma_min + (1 - t) * (self.sigma_max - self.sigma_min)
        return -0.5 * beta_t * x, beta_t / 2


PATHS: dict[str, type[Path]] = {"Linear": LinearPath, "GVP": GVPPath, "VP": VPPath}

# SiT class names, so code written against SiT's transport.path keeps working
ICPlan, GVPCPlan, VPCPlan = LinearPath, GVPPath, VPPath

DiffusionForm = Callable[[Path, Tensor, Tensor, float], Tensor]

#: D_t of the sampling SDE dX = [v + D s] dt + sqrt(2D) dW; arguments (path, x, t_expanded, norm)
DIFFUSION_FORMS: dict[str, DiffusionForm] = {
    "constant": lambda path, x, t, norm: torch.full_like(t, norm),
    "SBDM": lambda path, x, t, norm: norm * path.compute_drift(x, t)[1],
    "sigma": lambda path, x, t, norm: norm * path.compute_sigma_t(t)[0],
    "linear": lambda path, x, t, norm: norm * (1 - t),
    "decreasing": lambda path, x, t, norm: 0.25 * (norm * torch.cos(math.pi * t) + 1) ** 2,
    "increasing-decreasing": lambda path, x, t, norm: norm * torch.sin(math.pi * t) ** 2,
}
