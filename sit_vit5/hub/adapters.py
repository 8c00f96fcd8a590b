"""diffusers' own schedulers on our models: which kind a swapped-in scheduler is, its timesteps for
our settings, the step-wise loop that runs it, and ``diffusers_scheduler`` (diffusers' DDPM / DDIM
set up as our DDPM / DDIM process).

Conventions bridged: flow matching (``FlowMatch*``, sit objective) has sigma = 1 - t (sigma 1 =
noise, our t 0) and a flow pointing from data to noise (= -velocity); the DDPM family (ddpm
objective) steps DiT's integer timesteps on an epsilon prediction.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import DDIMScheduler, DDPMScheduler
from torch import Tensor

from ..diffusion import GaussianDiffusion
from ..errors import SettingError
from ..sampling import SamplingPipeline
from ..transport.integrators import time_grid
from .scheduler import SiTScheduler, ode_interval, respaced


def scheduler_kind(scheduler: Any) -> str:
    """"sit" (ours), "flow" (diffusers' flow-matching schedulers) or "eps" (DDPM family)."""
    if isinstance(scheduler, SiTScheduler):
        return "sit"
    if not (callable(getattr(scheduler, "set_timesteps", None))
            and callable(getattr(scheduler, "step", None))):
        raise TypeError(f"scheduler {type(scheduler).__name__}: not a diffusers scheduler "
                        "(needs set_timesteps / step)")
    if type(scheduler).__name__.startswith("FlowMatch"):
        return "flow"
    if hasattr(scheduler, "alphas_cumprod"):
        prediction = scheduler.config.get("prediction_type", "epsilon")
        if prediction != "epsilon":
            raise ValueError(f"{type(scheduler).__name__} with prediction_type={prediction!r}: our "
                             "ddpm-objective models predict epsilon")
        return "eps"
    raise TypeError(f"scheduler {type(scheduler).__name__}: SiTPipeline runs a SiTScheduler, a "
                    "FlowMatch* scheduler (sit objective) or a DDPM-family one (ddpm objective)")


def set_timesteps(scheduler: Any, pipe: SamplingPipeline) -> int:
    """Set a diffusers ``scheduler``'s timesteps for ``pipe``'s spec (flow matching: sigmas = 1 -
    our time grid, so that its Euler steps are ours); returns how many there are. Raises
    ValueError when the scheduler cannot sample ``pipe``'s objective."""
    kind, objective = scheduler_kind(scheduler), pipe.transport
    name, device = type(scheduler).__name__, pipe.device
    if (kind == "flow") != (objective.name == "sit"):
        wanted = ("FlowMatchEulerDiscreteScheduler" if objective.name == "sit"
                  else "DDPMScheduler / DDIMScheduler") + " or the SiTScheduler"
        raise ValueError(f"{name} cannot sample a model trained with the {objective.name} "
                         f"objective; use {wanted}")
    if kind == "flow":
        t0, t1 = ode_interval(objective)
        if t1 != 1.0:
            raise ValueError(f"{name} ends at sigma 0 (t = 1), but this transport integrates "
                             f"to t = {t1} ({objective.transport!r}); keep the SiTScheduler")
        grid = time_grid(t0, t1, pipe.spec.num_steps, torch.empty(0))  # on cpu: sigmas go out as numpy
        scheduler.set_timesteps(sigmas=(1.0 - grid[:-1].double()).numpy(), device=device)
    else:
        scheduler.set_timesteps(pipe.spec.num_steps, device=device)
    return len(scheduler.timesteps)


def denoise(scheduler: Any, pipe: SamplingPipeline, z: Tensor, y: Tensor,
            gens: list[torch.Generator], bar: Any) -> Tensor:
    """The step-wise loop of a diffusers ``scheduler`` from noise ``z`` ``(B, C, H, W)`` with
    labels ``y`` ``(B,)`` to the final sample (same shape); ``gens``: one generator per image for
    stochastic steps; ``bar`` ticks once per step."""
    kind, channels, batch = scheduler_kind(scheduler), z.shape[1], len(z)
    tr = getattr(pipe.transport, "transport", None)  # the sit objective's (flow matching)
    set_timesteps(scheduler, pipe)
    x = z * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching: none (1)
    stochastic = "generator" in inspect.signature(scheduler.step).parameters  # DDPM: noise
    extra = {"generator": gens} if stochastic else {}
    # DDPM with a learned variance reads both halves of the output (eps, then the variance)
    learned = scheduler.config.get("variance_type") in ("learned", "learned_range")
    scale = getattr(scheduler, "scale_model_input", lambda x, t: x)
    for t in scheduler.timesteps:
        if kind == "flow":
            t_model = (1.0 - t / scheduler.config.num_train_timesteps).to(x).expand(batch)
            out = pipe.model_fn(x, t_model, y)[:, :channels]
            out = -tr.velocity(out, x, t_model)  # diffusers' flow points from data to noise
        else:
            out = pipe.model_fn(scale(x, t), t.to(x.device).expand(batch), y)
            out = out if learned else out[:, :channels]
        x = scheduler.step(out, t, x, **extra).prev_sample
        bar.update()
    return x


def diffusers_scheduler(
    diffusion: GaussianDiffusion, method: str, num_steps: int, pixel_space: bool
) -> DDPMScheduler | DDIMScheduler:
    """diffusers' ``DDPMScheduler`` (method ddpm) or ``DDIMScheduler`` (ddim, eta 0: step with
    ``eta=0, use_clipped_model_output=True``), timesteps set to the respaced steps our sampler uses
    (DiT's ``"num_steps"`` / ``"ddimN"``), with our betas and our float64 cumulative products
    rounded once to float32; ``pixel_space`` clips x0 to [-1, 1]. The same process as ours up to
    float32 rounding (see :class:`~sit_vit5.hub.scheduler.SiTScheduler`). Raises ``SettingError``
    when DDIMScheduler's stride (T // num_steps) is not DiT's."""
    common = dict(num_train_timesteps=diffusion.original_num_steps, prediction_type="epsilon",
                  trained_betas=diffusion.original_betas.tolist(), clip_sample=pixel_space)
    ours = sorted(respaced(diffusion, method, num_steps).timestep_map, reverse=True)
    if method == "ddpm":
        inner = DDPMScheduler(**common, variance_type=diffusion.model_var_type)
        inner.set_timesteps(timesteps=ours)
    else:
        inner = DDIMScheduler(**common, set_alpha_to_one=True, steps_offset=0,
                              timestep_spacing="leading")
        inner.set_timesteps(num_steps)
        if inner.timesteps.tolist() != ours:
            stride = ours[0] - ours[1] if len(ours) > 1 else diffusion.original_num_steps
            raise SettingError("num_steps", num_steps, f": DiT's ddim{num_steps} respacing "
                               f"(stride {stride}) is not DDIMScheduler's (stride "
                               f"{diffusion.original_num_steps // num_steps}); step-wise DDIM "
                               "needs a num_steps with equal strides (e.g. a divisor of "
                               f"{diffusion.original_num_steps}); the pipeline's DDIM has no limit")
    # diffusers multiplies float32 alphas; ours are float64 products, rounded here once
    inner.alphas_cumprod = torch.cumprod(1.0 - diffusion.original_betas, dim=0).float()
    return inner
