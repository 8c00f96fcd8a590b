"""Closed-form transport for Gaussian data: the exact fields a perfect model would output.

For data ``x1 ~ N(m, S)`` with ``S = Q diag(s^2) Q^T`` the marginal of the path is
``p_t = N(alpha m, Q diag(c^2) Q^T)`` with ``c^2 = alpha^2 s^2 + sigma^2``, and the exact velocity is
``v*(x, t) = alpha_dot m + Q diag((alpha_dot alpha s^2 + sigma_dot sigma) / c^2) Q^T (x - alpha m)``
(``Q = I`` gives the isotropic/diagonal formula). The tests' ground truth for the samplers and
likelihoods of ``sit_vit5.transport`` (a test oracle, not part of the package). Data are ``(B, D)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sit_vit5.transport.paths import Path
from sit_vit5.transport.per_sample import expand_t_like_x


class GaussianTarget:
    """``N(mean, Q diag(std^2) Q^T)`` in D dims; ``mean``, ``std``: ``(D,)``; ``rotation``: ``(D, D)``."""

    def __init__(self, path: Path, mean: Tensor, std: Tensor, rotation: Tensor | None = None) -> None:
        self.path, self.mean, self.std = path, mean, std
        self.rotation = rotation

    def _coefficients(self, t: Tensor, x: Tensor) -> tuple[Tensor, ...]:
        t = expand_t_like_x(t, x)
        alpha, d_alpha = self.path.compute_alpha_t(t)
        sigma, d_sigma = self.path.compute_sigma_t(t)
        var = alpha**2 * self.std**2 + sigma**2  # (B, D) eigenvalues of Cov p_t
        return alpha, d_alpha, sigma, d_sigma, var

    def _in_basis(self, diag: Tensor, y: Tensor) -> Tensor:
        """``Q diag Q^T y`` row-wise."""
        if self.rotation is None:
            return diag * y
        return ((y @ self.rotation) * diag) @ self.rotation.T

    def velocity(self, x: Tensor, t: Tensor) -> Tensor:
        alpha, d_alpha, sigma, d_sigma, var = self._coefficients(t, x)
        gain = (d_alpha * alpha * self.std**2 + d_sigma * sigma) / var
        return d_alpha * self.mean + self._in_basis(gain, x - alpha * self.mean)

    def score(self, x: Tensor, t: Tensor) -> Tensor:
        alpha, _, _, _, var = self._coefficients(t, x)
        return -self._in_basis(1 / var, x - alpha * self.mean)

    def noise(self, x: Tensor, t: Tensor) -> Tensor:
        """``E[x0 | x_t] = -sigma * score``."""
        sigma = self._coefficients(t, x)[2]
        return -sigma * self.score(x, t)

    def model(self, prediction: str):
        """A ``model(x, t, **kwargs)`` returning the exact ``prediction`` (velocity | score | noise)."""
        field = {"velocity": self.velocity, "score": self.score, "noise": self.noise}[prediction]
        return lambda x, t, **kwargs: field(x, t)

    def log_prob(self, x: Tensor, t: float) -> Tensor:
        """``log p_t(x)`` in nats, ``(B,)``."""
        alpha, _, _, _, var = self._coefficients(torch.tensor(float(t), dtype=x.dtype, device=x.device), x)
        y = x - alpha * self.mean
        y = y if self.rotation is None else y @ self.rotation
        return -0.5 * (y**2 / var + torch.log(2 * math.pi * var)).sum(dim=1)

    def flow(self, z: Tensor, t_from: float, t_to: float) -> Tensor:
        """Exact probability-flow map from time ``t_from`` to ``t_to`` (affine for Gaussians)."""
        a0, _, _, _, var0 = self._coefficients(torch.tensor(float(t_from), dtype=z.dtype, device=z.device), z)
        a1, _, _, _, var1 = self._coefficients(torch.tensor(float(t_to), dtype=z.dtype, device=z.device), z)
        return a1 * self.mean + self._in_basis((var1 / var0).sqrt(), z - a0 * self.mean)


def drawn_targets(path: Path, count: int = 6, seed: int = 55) -> list[GaussianTarget]:
    """``count`` 2-D diagonal Gaussian targets on ``path`` from a seeded generator: each mean
    coordinate uniform in [-2, 2], each sd log-uniform in [0.3, 3] (a 10x range of scales), float64.
    The solver-order tests run on all of them, not on one hand-picked target."""
    gen = torch.Generator().manual_seed(seed)
    targets = []
    for _ in range(count):
        mean = 4 * torch.rand(2, generator=gen, dtype=torch.float64) - 2
        log_std = math.log(0.3) + math.log(10) * torch.rand(2, generator=gen, dtype=torch.float64)
        targets.append(GaussianTarget(path, mean, torch.exp(log_std)))
    return targets
