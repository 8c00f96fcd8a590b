"""Sampling one step at a time, diffusers' way: the :class:`Steps` interface every step-wise
sampler offers (ours and diffusers' schedulers wrapped), and :func:`denoise`, the one loop over it.

A leaf module: both the transport (flow schedulers) and the objective (pipeline, DiT solvers) loop
through here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

from .utils.errors import SettingError


class Steps(Protocol):
    """Sampling one step at a time (diffusers' loop): ``restart()``, then from ``x = z *
    init_noise_sigma``, for each ``t`` of ``timesteps``: ``out = model(model_input(x, t),
    model_time(t, x), y)``, then ``x = step(out, t, x, generator)`` (``generator``: one per image
    for stochastic steps). ``restart`` readies a diffusers scheduler, which keeps state along a
    trajectory. Optional: ``model_kwargs(t)``, extra model keywords of the step at ``t`` (MeanFlow's
    ``interval``); :func:`denoise` passes them when a sampler defines it."""

    timesteps: Tensor
    init_noise_sigma: float

    def restart(self) -> None: ...
    def model_input(self, x: Tensor, t: Tensor) -> Tensor: ...
    def model_time(self, t: Tensor, x: Tensor) -> Tensor: ...
    def step(self, model_output: Tensor, t: Tensor, x: Tensor, generator: Any = None) -> Tensor: ...


def denoise(steps: Steps, z: Tensor, model_fn: Callable[..., Tensor], generator: Any = None,
            trajectory: list[Tensor] | None = None, **model_kwargs: Any) -> Tensor:
    """The one step-wise loop (diffusers' API): from noise ``z`` ``(B, C, H, W)`` to the final
    sample, one ``model_fn(x, t, **model_kwargs)`` call and one ``steps.step`` per timestep;
    ``generator`` goes to every step as it is (resolved: one per image). ``trajectory``, when
    given, receives every state, ``z * init_noise_sigma`` first and the final sample last."""
    steps.restart()
    x = z * steps.init_noise_sigma
    if trajectory is not None:
        trajectory.append(x)
    extra = getattr(steps, "model_kwargs", None)  # per-step keywords (MeanFlow's interval)
    for t in steps.timesteps:
        step_kwargs = model_kwargs if extra is None else {**extra(t), **model_kwargs}
        out = model_fn(steps.model_input(x, t), steps.model_time(t, x), **step_kwargs)
        x = steps.step(out, t, x, generator)
        if trajectory is not None:
            trajectory.append(x)
    return x


def refuse_repeated_timesteps(timesteps: Tensor, num_steps: int, why: str) -> None:
    """SettingError naming ``num_steps`` when two of a scheduler's integer ``timesteps`` coincide:
    the repeated step would be taken at the wrong noise level. ``why`` ends the message."""
    if len(set(timesteps.tolist())) < len(timesteps):
        raise SettingError("num_steps", num_steps, why)
