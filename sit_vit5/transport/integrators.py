"""Numerical integrators: torchdiffeq for ODEs, Euler-Maruyama / Heun for SDEs, and an NFE counter.

ODE method names are torchdiffeq 0.2.x's, offered from the tables in ``names`` (its registry is
private API): ``FIXED_STEP_METHODS`` take one step per interval of the output grid;
``ADAPTIVE_METHODS`` choose their own steps (the grid only says where the solution is reported).
tests/test_transport_ode.py checks the tables against torchdiffeq's behaviour. ``heun`` is accepted
as an alias of ``heun2`` (explicit trapezoid, 2 evaluations per step).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torchdiffeq import odeint

from ..names import ODE_ADAPTIVE_METHODS as ADAPTIVE_METHODS
from ..names import ODE_ALIASES, choose, ode_solver_name
from ..names import ODE_FIXED_STEP_METHODS as FIXED_STEP_METHODS
from ..names import SDE_STEP_NFE as SDE_STEP_NFE  # model calls per SDE step (progress bars)


def ode_method(name: str) -> str:
    """Canonical torchdiffeq method name for ``name`` (case-insensitive; ``heun`` -> ``heun2``)."""
    key = ode_solver_name(name)
    valid = {k: k for k in (*ADAPTIVE_METHODS, *FIXED_STEP_METHODS)}
    choose({**valid, **ODE_ALIASES}, key, "ODE sampling_method")
    return key


def is_adaptive(method: str) -> bool:
    """True when the torchdiffeq method picks its own steps (the output grid does not set the NFE).
    """
    return ode_method(method) in ADAPTIVE_METHODS


def warn_adaptive(method: str, num_steps: int, stacklevel: int = 3) -> None:
    """Say that an adaptive method's ``num_steps`` sets only the output grid, not the NFE."""
    warnings.warn(
        f"sampling_method={method!r} is adaptive: num_steps={num_steps} only sets the output grid, "
        "not the number of model evaluations (read sampler.last_nfe; tune atol/rtol instead)",
        UserWarning, stacklevel=stacklevel,
    )


class CountingModel:
    """Wrap ``model_fn`` and count its forward calls (one call on a batch = one NFE)."""

    def __init__(self, model_fn: Callable[..., Tensor]) -> None:
        self.model_fn, self.nfe = model_fn, 0

    def __call__(self, *args, **kwargs) -> Tensor:
        self.nfe += 1
        return self.model_fn(*args, **kwargs)


def time_grid(t0: float, t1: float, num_steps: int, like: Tensor) -> Tensor:
    """``linspace(t0, t1, num_steps)`` in float64 for float64 data, else float32, on ``like``'s
    device."""
    if num_steps < 2:
        raise ValueError(
            f"num_steps must be >= 2 (grid points including both ends), got {num_steps}")
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.linspace(t0, t1, num_steps, dtype=dtype, device=like.device)


def batch_time(t: Tensor | float, x: Tensor) -> Tensor:
    """A scalar time as the ``(B,)`` tensor the models expect (dtype of ``x``)."""
    if type(t) in (float, int):  # filled on the device: as_tensor's host copy drains a GPU's stream
        # at every sampler step. Through the default dtype, as as_tensor rounded it
        return torch.full((x.shape[0],), t, device=x.device).to(x.dtype)
    return torch.as_tensor(t, device=x.device).to(x.dtype).reshape(1).repeat(x.shape[0])


def solve_ode(
    drift: Callable[[Tensor, Tensor], Tensor | tuple[Tensor, ...]], y0: Tensor | tuple[Tensor, ...],
    grid: Tensor, method: str, atol: float, rtol: float,
) -> Tensor | tuple[Tensor, ...]:
    """Integrate ``dy/dt = drift(y, t_batch)`` over ``grid``; returns the states on the grid (time
    first)."""
    first = y0[0] if isinstance(y0, tuple) else y0

    def func(t: Tensor, y: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        return drift(y, batch_time(t, first))

    method = ode_method(method)
    n = len(y0) if isinstance(y0, tuple) else 1
    tol = (dict(atol=[atol] * n, rtol=[rtol] * n) if isinstance(y0, tuple)
           else dict(atol=atol, rtol=rtol))
    # adaptive RK steps may overshoot the last grid point (VP is NaN for t > 1): make them land on
    # it
    options = {"step_t": grid[-1:]} if method in ADAPTIVE_METHODS else None
    return odeint(func, y0, grid, method=method, options=options, **tol)


# ---------------------------------------------------------------- SDE steps
# Each step maps (x, t, dt, noise) -> x_next for dX = drift dt + sqrt(2 D) dW; ``noise`` ~ N(0, I)
# like x.
SDEDrift = Callable[[Tensor, Tensor], Tensor]
SDEDiffusion = Callable[[Tensor, Tensor], Tensor]


def euler_maruyama_step(
    x: Tensor, t: float, dt: float, noise: Tensor, drift: SDEDrift, diffusion: SDEDiffusion
) -> Tensor:
    """One Euler-Maruyama step (1 drift evaluation)."""
    t_b = batch_time(t, x)
    return x + drift(x, t_b) * dt + torch.sqrt(2 * diffusion(x, t_b)) * noise * math.sqrt(dt)


def heun_step(
    x: Tensor, t: float, dt: float, noise: Tensor, drift: SDEDrift, diffusion: SDEDiffusion
) -> Tensor:
    """SiT's stochastic Heun step: add the noise first, then a Heun (trapezoid) drift step (2
    evaluations)."""
    t_b = batch_time(t, x)
    x_hat = x + torch.sqrt(2 * diffusion(x, t_b)) * noise * math.sqrt(dt)
    k1 = drift(x_hat, t_b)
    k2 = drift(x_hat + dt * k1, batch_time(t + dt, x))
    return x_hat + 0.5 * dt * (k1 + k2)


SDE_STEPS: dict[str, Callable[..., Tensor]] = {"Euler": euler_maruyama_step, "Heun": heun_step}


def index_of(timesteps: Tensor, timestep: float | Tensor) -> int:
    """Position of ``timestep`` in ``timesteps`` (exact match: they are the grid's own values)."""
    hits = (timesteps == torch.as_tensor(timestep, device=timesteps.device)).nonzero()
    if len(hits) == 0:
        raise ValueError(f"timestep {float(timestep)!r} is not one of the scheduler's timesteps")
    return int(hits[0, 0])
