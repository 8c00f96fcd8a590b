"""The training objective, from the config's ``transport`` section:

* ``sit`` (default): SiT's transport (:mod:`sit_vit5.transport`); t in [0, 1] (0 = noise),
  samplers ``ode | sde``.
* ``ddpm``: DiT's discrete diffusion (:mod:`sit_vit5.diffusion`); integer steps 0 .. T-1
  (T-1 = noise), samplers ``ddpm | ddim`` (each with diffusers' multistep solvers of the same
  SDE / ODE as ``sampling_method``); ``ddpm_variance: learned`` needs ``learn_sigma: true``.

Both are an :class:`Objective`: ``loss``, a whole-trajectory ``sampler``, step-wise ``steps`` and
``evaluations`` per ``SampleSpec``. The model returns its full output; the objective reads what it
needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .diffusion import GaussianDiffusion, create_diffusion
from .diffusion.ddpm_sampler import (
    DiffusionSampler,
    DiffusionSteps,
    SchedulerSteps,
    is_epsilon_scheduler,
    solver_scheduler,
)
from .diffusion.schedule import NOISE_SCHEDULES
from .errors import SettingError, SitVit5Error
from .models import name_objective_conflict
from .sample_spec import SAMPLE_METHODS, SampleSpec
from .stepwise import Steps, denoise
from .transport import TRANSPORT_KEYS, Sampler, Transport, create_transport
from .transport.integrators import ode_method
from .transport.rng import GeneratorLike, resolve_generator
from .transport.sampler import (
    EulerSteps,
    FlowSchedulerSteps,
    flow_scheduler,
    flow_solver_name,
    is_flow_scheduler,
)

OBJECTIVES = ("sit", "ddpm")
#: transport-section keys the ddpm objective reads
DDPM_KEYS = ("diffusion_steps", "noise_schedule", "ddpm_variance")
#: config name -> GaussianDiffusion variance type (DiT: learned = IDDPM's range + hybrid loss)
DDPM_VARIANCES = {"learned": "learned_range", "fixed_small": "fixed_small",
                  "fixed_large": "fixed_large"}
DDPM_DEFAULTS: dict[str, Any] = {"diffusion_steps": 1000, "noise_schedule": "linear",
                                 "ddpm_variance": "learned"}


class ObjectiveError(SitVit5Error, ValueError):
    """An objective setting that contradicts itself, the model or the sampler (names the keys)."""


def objective_keys(name: str) -> tuple[str, ...]:
    """The ``transport`` section keys objective ``name`` reads (besides ``objective``)."""
    return DDPM_KEYS if name == "ddpm" else TRANSPORT_KEYS


def method_conflict(objective: str) -> str:
    """The one wording of "this method cannot sample this objective" (a SettingError reason)."""
    return (f" cannot sample a model trained with the {objective} objective; valid: "
            f"{', '.join(SAMPLE_METHODS[objective])}")


def objective_name(cfg_transport: Mapping[str, Any] | None) -> str:
    """``transport.objective`` of a config section; missing means ``sit``."""
    name = (cfg_transport or {}).get("objective") or "sit"
    if name not in OBJECTIVES:
        raise ObjectiveError(f"transport.objective={name!r}; valid: {', '.join(OBJECTIVES)}")
    return name


def check_objective(cfg_transport: Mapping[str, Any], *, learn_sigma: bool,
                    model_name: str | None = None, sample_method: str | None = None) -> str:
    """Validate the objective against the model and sampler; returns its name. Raises
    ObjectiveError naming every contradiction at once."""
    name = objective_name(cfg_transport)
    problems: list[str] = []
    conflict = name_objective_conflict(model_name, name) if model_name else None
    if conflict:
        problems.append(f"model.name={model_name!r}: {conflict}")
    if sample_method is not None and sample_method not in SAMPLE_METHODS[name]:
        problems.append(f"sample.method={sample_method!r}{method_conflict(name)}")
    if name == "ddpm":
        problems += _ddpm_problems(ddpm_settings(cfg_transport), learn_sigma)
    if problems:
        raise ObjectiveError("; ".join(problems))
    return name


def _ddpm_problems(ddpm: Mapping[str, Any], learn_sigma: bool) -> list[str]:
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


def transport_kwargs(cfg_transport: Mapping[str, Any]) -> dict[str, Any]:
    """``create_transport`` keywords of a transport section (SiT keys that are set)."""
    return {k: cfg_transport[k] for k in TRANSPORT_KEYS if cfg_transport.get(k) is not None}


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


# ----------------------------------------------------------------------------- the interface


@dataclass(frozen=True)
class BuiltSampler:
    """A whole-trajectory sampler: ``sample(z, model_fn, *, generator=None, **model_kwargs)``
    returns the trajectory ``[x]`` (final sample last, ``(B, C, H, W)``); ``sampler.last_nfe`` is
    the latest call's model evaluations."""

    sample: Callable[..., list[Tensor]]
    sampler: Sampler | DiffusionSampler | StepsSampler


class StepsSampler:
    """Whole trajectories of step-wise ``steps`` (:func:`denoise`), shaped like
    :class:`~sit_vit5.diffusion.DiffusionSampler`: :meth:`build` returns ``fn(z, model_fn, *,
    generator=None, **model_kwargs) -> [x]``; ``last_nfe`` counts the latest call's evaluations."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.last_nfe: int | None = None

    def build(self) -> Callable[..., list[Tensor]]:
        def _sample(z: Tensor, model_fn: Callable[..., Tensor], *,
                    generator: GeneratorLike = None, **model_kwargs: Any) -> list[Tensor]:
            gen = resolve_generator(generator, len(z))  # once: each stream advances along the way
            with torch.no_grad():
                x = denoise(self.steps, z, model_fn, gen, **model_kwargs)
            self.last_nfe = len(self.steps.timesteps)
            return [x]

        return _sample


class Objective(ABC):
    """A training objective: the loss, samplers per ``SampleSpec`` (whole or step-wise) and the
    model evaluations a spec costs."""

    name: ClassVar[str]

    @property
    def methods(self) -> tuple[str, ...]:
        """The ``sample.method`` values that sample this objective (the first is the default)."""
        return SAMPLE_METHODS[self.name]

    @abstractmethod
    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        """Per-sample loss ``(B,)`` for data ``x`` ``(B, C, H, W)`` and labels ``y`` ``(B,)``;
        t and the noise come from the global RNG, drawn in the order SiT / DiT draw them."""

    def evaluations(self, spec: SampleSpec) -> int | None:
        """Model evaluations per batch of the whole-trajectory sampler (None: adaptive):
        ``spec.nfe``, the one count of the sampler tables."""
        return spec.nfe

    @abstractmethod
    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler: ...

    @abstractmethod
    def _steps(self, spec: SampleSpec, pixel_space: bool, scheduler: Any, device: Any) -> Steps: ...

    def check_method(self, spec: SampleSpec) -> None:
        """Raise SettingError naming ``method`` when ``spec`` cannot sample this objective."""
        if spec.method not in self.methods:
            raise SettingError("method", spec.method, method_conflict(self.name))

    def sampler(self, spec: SampleSpec, *, pixel_space: bool = False) -> BuiltSampler:
        """``spec``'s whole-trajectory sampler; ``pixel_space``: the model outputs images."""
        self.check_method(spec)
        return self._sampler(spec, pixel_space)

    def steps(self, spec: SampleSpec, *, pixel_space: bool = False, scheduler: Any = None,
              device: torch.device | str | None = None) -> Steps:
        """``spec``'s sampler one step at a time: ours, or a diffusers ``scheduler``'s (set up for
        ``spec.num_steps``). SettingError when this objective cannot be sampled so."""
        self.check_method(spec)
        if scheduler is not None and not (callable(getattr(scheduler, "set_timesteps", None))
                                          and callable(getattr(scheduler, "step", None))):
            raise SettingError("scheduler", type(scheduler).__name__,
                               ": not a diffusers scheduler (needs set_timesteps / step)")
        return self._steps(spec, pixel_space, scheduler, device)


class SiTObjective(Objective):
    """SiT's transport: continuous t in [0, 1] (0 = noise), ODE / SDE samplers."""

    name = "sit"

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def __repr__(self) -> str:
        return repr(self.transport)  # what sample.py prints and bulk runs record

    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        return self.transport.training_losses(model, x, model_kwargs=dict(y=y))["loss"]

    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler:
        sampler = Sampler(self.transport)
        build = sampler.sample_ode if spec.method == "ode" else sampler.sample_sde
        return BuiltSampler(build(**spec.options()), sampler)

    def _steps(self, spec: SampleSpec, pixel_space: bool, scheduler: Any, device: Any) -> Steps:
        if scheduler is not None:
            if not is_flow_scheduler(scheduler):
                raise SettingError("scheduler", type(scheduler).__name__,
                                   ": cannot sample a model trained with the sit objective; use "
                                   "FlowMatchEulerDiscreteScheduler, a multistep scheduler with "
                                   "use_flow_sigmas=True and prediction_type='flow_prediction', "
                                   "or the SiTScheduler")
            return FlowSchedulerSteps(Sampler(self.transport), scheduler, spec.num_steps, device,
                                      spec.time_shift)
        solver = flow_solver_name(spec.sampling_method) if spec.method == "ode" else None
        if solver is not None:  # diffusers' multistep solver, its flow_shift = our time shift
            return FlowSchedulerSteps(Sampler(self.transport),
                                      flow_scheduler(solver, spec.time_shift), spec.num_steps,
                                      device)
        if spec.method != "ode" or ode_method(spec.sampling_method) != "euler":
            raise SettingError("method", f"{spec.method}/{spec.sampling_method}",
                               ": step-wise sampling covers ode/euler and diffusers' flow solvers "
                               "(and ddpm, ddim); the SDE and the other ODE solvers run whole "
                               "trajectories (SiTPipeline.__call__)")
        return EulerSteps(Sampler(self.transport), spec.num_steps, device, spec.time_shift)


class DDPMObjective(Objective):
    """DiT's discrete diffusion: integer steps (T-1 = noise), DDPM / DDIM on respaced steps, or a
    diffusers solver of the same SDE / ODE (``spec.sampling_method``) on its own steps; a learned
    variance makes the model output 2C channels (noise, then variance values)."""

    name = "ddpm"

    def __init__(self, diffusion: GaussianDiffusion) -> None:
        self.diffusion = diffusion

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


def create_objective(cfg_transport: Mapping[str, Any]) -> Objective:
    """The objective of a ``transport`` section: SiT's transport or DiT's full-step diffusion."""
    if objective_name(cfg_transport) == "ddpm":
        return DDPMObjective(create_ddpm(cfg_transport))
    return SiTObjective(create_transport(**transport_kwargs(cfg_transport)))


def as_objective(objective: Objective | Transport | GaussianDiffusion) -> Objective:
    """An :class:`Objective` from itself or the SiT Transport / DiT GaussianDiffusion it wraps."""
    if isinstance(objective, Objective):
        return objective
    if isinstance(objective, GaussianDiffusion):
        return DDPMObjective(objective)
    return SiTObjective(objective)
