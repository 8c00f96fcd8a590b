"""Divergence estimators for the probability-flow likelihood, and bits/dim.

The likelihood is the density of the data *in the space the model sees* (e.g. VAE latents, or images
scaled to [-1, 1]) as a continuous variable: no dequantization noise and no offset for 8-bit pixels
is added.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..names import DEFAULT_ATOL, DEFAULT_RTOL, choose
from .integrators import CountingModel, is_adaptive, ode_method, solve_ode, warn_adaptive
from .rng import GeneratorLike, Resolved, rademacher_like, randn_like, resolve_generator

if TYPE_CHECKING:
    from .sampler import Sampler  # the ODE's grid, velocity and transport

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


def ode_likelihood(
    sampler: Sampler, *, sampling_method: str = "dopri5", num_steps: int = 50,
    atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, divergence: str = "hutchinson",
    probe: str = "rademacher", num_probes: int = 1,
) -> Callable[..., tuple[Tensor, Tensor]]:
    """Log-likelihood of data ``x``: the ODE from t1 back to t0 with ``d logp = -div v dt``
    (``sampler.sample_ode_likelihood``; the model calls are counted in ``sampler.last_nfe``).

    ``divergence``: hutchinson (``num_probes`` probes of kind ``probe``: rademacher | gaussian,
    drawn once per call so adaptive solvers see a deterministic ODE) | exact (one backward pass
    per dimension: small data only). The function returns ``(logp, z)``: ``log p_t1(x)`` in nats
    ``(B,)`` under an N(0, I) prior at t0, and the noise-side points ``z``. Bits/dim:
    :func:`bits_per_dim` (no dequantization offset is added).
    """
    method = ode_method(sampling_method)
    if is_adaptive(method):
        warn_adaptive(method, num_steps, stacklevel=4)
    choose({"hutchinson": None, "exact": None}, divergence, "divergence")
    draw_probe = choose(PROBES, probe, "probe")
    if num_probes < 1:
        raise ValueError(f"num_probes must be >= 1, got {num_probes}")
    tr = sampler.transport

    def _likelihood(
        x: Tensor, model_fn: Callable[..., Tensor], *, generator: GeneratorLike = None,
        **model_kwargs,
    ) -> tuple[Tensor, Tensor]:
        model, gen = CountingModel(model_fn), resolve_generator(generator, len(x))
        velocity = sampler._velocity_fn(model, model_kwargs)
        probes = None
        if divergence == "hutchinson":
            probes = torch.stack([draw_probe(x, gen) for _ in range(num_probes)])

        def drift(state: tuple[Tensor, Tensor], t: Tensor) -> tuple[Tensor, Tensor]:
            with torch.enable_grad():
                y = state[0].detach().requires_grad_(True)
                v = velocity(y, t)
                div = (exact_divergence(v, y) if probes is None
                       else hutchinson_divergence(v, y, probes))
            return v.detach(), div.detach()

        init = (x, torch.zeros(len(x), dtype=x.dtype, device=x.device))
        grid = sampler.ode_grid(num_steps, x, reverse=True)
        ys, delta = solve_ode(drift, init, grid, method, atol, rtol)
        z = ys[-1]
        # integrating t1 -> t0 gives delta = -int_{t0}^{t1} div v dt, so log p_t1(x) = log N(z)
        # + delta
        sampler.last_nfe = model.nfe
        return tr.prior_logp(z) + delta[-1], z

    return _likelihood
