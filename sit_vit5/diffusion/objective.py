"""DiT's objective (the platform's ``ddpm``): discrete Gaussian diffusion as an :class:`Objective`.

Integer steps 0 .. T-1 (T-1 = noise); samplers ``ddpm | ddim`` (each with diffusers' multistep
solvers of the same SDE / ODE as ``sampling_method``); ``ddpm_variance: learned`` needs
``learn_sigma: true``. The core imports this module only when a config or checkpoint names
``transport.objective: ddpm``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from ..names import DDPM_DEFAULTS
from ..objective.base import BuiltSampler, Objective, StepsSampler
from ..sample_spec import SampleSpec
from ..stepwise import Steps
from ..utils.errors import SettingError
from .ddpm_sampler import (
    DiffusionSampler,
    DiffusionSteps,
    SchedulerSteps,
    is_epsilon_scheduler,
    solver_scheduler,
)
from .gaussian_diffusion import GaussianDiffusion, create_diffusion
from .schedule import NOISE_SCHEDULES

#: transport-section keys the ddpm objective reads
DDPM_KEYS = ("diffusion_steps", "noise_schedule", "ddpm_variance")
#: config name -> GaussianDiffusion variance type (DiT: learned = IDDPM's range + hybrid loss)
DDPM_VARIANCES = {"learned": "learned_range", "fixed_small": "fixed_small",
                  "fixed_large": "fixed_large"}


def _ddpm_problems(ddpm: Mapping[str, Any], learn_sigma: bool) -> list[str]:
    """What is wrong with the (resolved) ddpm keys ``ddpm`` for a model with or without
    ``learn_sigma``."""
    problems = []
    if ddpm["noise_schedule"] not in NOISE_SCHEDULES:
        problems.append(f"transport.noise_schedule={ddpm['noise_schedule']!r}; valid: "
                        f"{', '.join(NOISE_SCHEDULES)}")
    if not isinstance(ddpm["diffusion_steps"], int) or ddpm["diffusion_steps"] < 2:
        problems.append(f"transport.diffusion_steps={ddpm['diffusion_steps']!r}; need an integer "
                        ">= 2")
    variance = ddpm["ddpm_variance"]
    if variance not in DDPM_VARIANCES:
        problems.append(f"transport.ddpm_variance={variance!r}; valid: {', '.join(DDPM_VARIANCES)}")
    elif variance == "learned" and not learn_sigma:
        problems.append("transport.ddpm_variance=learned (DiT's learned variance and hybrid loss) "
                        "needs model.learn_sigma=true (2C output channels); or choose "
                        "transport.ddpm_variance=fixed_large / fixed_small for a C-channel model")
    elif variance != "learned" and learn_sigma:
        problems.append(f"transport.ddpm_variance={variance} has no use for the variance half "
                        "of a model.learn_sigma=true model; set transport.ddpm_variance=learned "
                        "(DiT) or model.learn_sigma=false")
    return problems


def ddpm_settings(cfg_transport: Mapping[str, Any]) -> dict[str, Any]:
    """The ddpm keys of a transport section, missing or None ones at :data:`DDPM_DEFAULTS`."""
    return {
        k: DDPM_DEFAULTS[k] if cfg_transport.get(k) is None else cfg_transport[k] for k in DDPM_KEYS
    }


def create_ddpm(cfg_transport: Mapping[str, Any],
                timestep_respacing: str = "") -> GaussianDiffusion:
    """DiT's ``create_diffusion`` from a transport section ("" = all steps; "250", "ddim50")."""
    ddpm = ddpm_settings(cfg_transport)
    variance = DDPM_VARIANCES[ddpm["ddpm_variance"]]
    return create_diffusion(
        timestep_respacing,
        noise_schedule=ddpm["noise_schedule"],
        learn_sigma=variance == "learned_range",
        sigma_small=variance == "fixed_small",
        diffusion_steps=ddpm["diffusion_steps"],
    )



class DDPMObjective(Objective):
    """DiT's discrete diffusion: integer steps (T-1 = noise), DDPM / DDIM on respaced steps, or a
    diffusers solver of the same SDE / ODE (``spec.sampling_method``) on its own steps; a learned
    variance makes the model output 2C channels (noise, then variance values)."""

    name = "ddpm"
    keys = DDPM_KEYS

    def __init__(self, diffusion: GaussianDiffusion) -> None:
        self.diffusion = diffusion

    @classmethod
    def from_config(cls, cfg_transport: Mapping[str, Any]) -> DDPMObjective:
        return cls(create_ddpm(cfg_transport))

    @classmethod
    def config_problems(cls, cfg_transport: Mapping[str, Any], learn_sigma: bool) -> list[str]:
        return _ddpm_problems(ddpm_settings(cfg_transport), learn_sigma)

    def __repr__(self) -> str:
        return repr(self.diffusion)

    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        t = self.diffusion.sample_timesteps(len(x), device=x.device)  # DiT: t first, then noise
        return self.diffusion.training_losses(model, x, t, model_kwargs=dict(y=y))["loss"]

    def _solver_steps(self, spec: SampleSpec, pixel_space: bool, device: Any) -> SchedulerSteps:
        scheduler = solver_scheduler(self.diffusion, spec.method, spec.sampling_method, pixel_space)
        return SchedulerSteps(scheduler, spec.num_steps, device)

    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler:
        if spec.sampling_method is not None:
            solver = StepsSampler(self._solver_steps(spec, pixel_space, None))
            return BuiltSampler(solver.build(), solver)
        sampler = DiffusionSampler(self.diffusion, clip_denoised=pixel_space)
        return BuiltSampler(sampler.build(spec.method, **spec.options()), sampler)

    def _steps(self, spec: SampleSpec, pixel_space: bool, scheduler: Any, device: Any) -> Steps:
        if scheduler is None and spec.sampling_method is not None:
            return self._solver_steps(spec, pixel_space, device)
        if scheduler is None:
            return DiffusionSteps(self.diffusion, spec.method, spec.num_steps,
                                  clip_denoised=pixel_space, eta=spec.eta, device=device)
        if not is_epsilon_scheduler(scheduler):
            raise SettingError("scheduler", type(scheduler).__name__,
                               ": cannot sample a model trained with the ddpm objective; use "
                               "DDPMScheduler / DDIMScheduler or the SiTScheduler")
        return SchedulerSteps(scheduler, spec.num_steps, device)
