"""The training objective of a run, in one place: SiT's transport (``objective: sit``, the default)
or DiT's discrete Gaussian diffusion (``objective: ddpm``), both read from the config's
``transport`` section.

* ``sit``: ``path_type / prediction / loss_weight / train_eps / sample_eps`` ->
  :mod:`sit_vit5.transport`; t in [0, 1] (0 = noise), samplers ``ode | sde``.
* ``ddpm``: ``diffusion_steps / noise_schedule / ddpm_variance`` -> :mod:`sit_vit5.diffusion`; the
  backbone receives DiT's integer steps 0 .. T-1 through the same timestep embedder (T-1 = noise),
  samplers ``ddpm | ddim`` on ``num_steps`` respaced steps. ``ddpm_variance: learned`` (DiT) needs a
  2C-channel model (``model.learn_sigma: true``).

"DiT w. ViT" is a SiT backbone with ``objective: ddpm``; ``DiT-*`` model names say so themselves.

Both are an :class:`Objective`: its ``loss``, its ``sampler`` for a ``SampleSpec``, the channels
guidance mixes and the model output mode it reads (``prepare``). Callers hold an ``Objective`` and
never ask which one it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from torch import Tensor, nn

from .diffusion import GaussianDiffusion, create_diffusion
from .diffusion.schedule import NOISE_SCHEDULES
from .errors import SettingError, SitVit5Error
from .models import name_objective
from .sample_spec import SAMPLE_METHODS, SampleSpec
from .transport import TRANSPORT_KEYS, Sampler, Transport, create_transport

OBJECTIVES = ("sit", "ddpm")
#: transport-section keys each objective reads (the others must stay at their defaults' meaning:
#: unused)
DDPM_KEYS = ("diffusion_steps", "noise_schedule", "ddpm_variance")
#: config name -> GaussianDiffusion variance type (DiT: learned = IDDPM's learned range + the hybrid
#: loss)
DDPM_VARIANCES = {
    "learned": "learned_range",
    "fixed_small": "fixed_small",
    "fixed_large": "fixed_large",
}
DDPM_DEFAULTS: dict[str, Any] = {
    "diffusion_steps": 1000,
    "noise_schedule": "linear",
    "ddpm_variance": "learned",
}


class ObjectiveError(SitVit5Error, ValueError):
    """An objective setting that contradicts itself, the model or the sampler (names the keys at
    fault)."""


def objective_name(cfg_transport: Mapping[str, Any] | None) -> str:
    """``transport.objective`` of a config section; sections written before the key existed mean
    ``sit``."""
    name = (cfg_transport or {}).get("objective") or "sit"
    if name not in OBJECTIVES:
        raise ObjectiveError(f"transport.objective={name!r}; valid: {', '.join(OBJECTIVES)}")
    return name


def check_objective(
    cfg_transport: Mapping[str, Any],
    *,
    learn_sigma: bool,
    model_name: str | None = None,
    sample_method: str | None = None,
) -> str:
    """Validate the objective against the model and sampler; returns its name. Raises
    ObjectiveError naming every contradiction at once (so one run shows all keys to set)."""
    name = objective_name(cfg_transport)
    problems: list[str] = []
    implied = name_objective(model_name) if model_name else None
    if implied is not None and implied != name:
        problems.append(
            f"model.name={model_name!r} is the SiT network trained with the {implied} objective: "
            f"set transport.objective={implied}, or use the SiT-* name for transport.objective="
            f"{name}"
        )
    if sample_method is not None and sample_method not in SAMPLE_METHODS[name]:
        problems.append(
            f"sample.method={sample_method!r} does not sample the {name} objective; valid: "
            f"{', '.join(SAMPLE_METHODS[name])}"
        )
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
        problems.append(f"transport.ddpm_variance={variance} has no use for the variance half of a "
                        "model.learn_sigma=true model; set transport.ddpm_variance=learned (DiT) or "
                        "model.learn_sigma=false")
    return problems


def ddpm_settings(cfg_transport: Mapping[str, Any]) -> dict[str, Any]:
    """The ddpm keys of a transport section, missing or None ones at :data:`DDPM_DEFAULTS`."""
    return {
        k: DDPM_DEFAULTS[k] if cfg_transport.get(k) is None else cfg_transport[k] for k in DDPM_KEYS
    }


def transport_kwargs(cfg_transport: Mapping[str, Any]) -> dict[str, Any]:
    """``create_transport`` keywords of a transport section (SiT keys that are set)."""
    return {k: cfg_transport[k] for k in TRANSPORT_KEYS if cfg_transport.get(k) is not None}


def create_ddpm(
    cfg_transport: Mapping[str, Any], timestep_respacing: str = ""
) -> GaussianDiffusion:
    """DiT's ``create_diffusion`` from a transport section ("" = all steps, training; "250",
    "ddim50")."""
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
    """One objective's sampler for one spec: ``sample(z, model_fn, *, generator=None,
    **model_kwargs)`` returns the trajectory ``[x]`` (final sample last, ``(B, C, H, W)``);
    ``counter.last_nfe`` is the model calls of the latest call."""

    sample: Callable[..., list[Tensor]]
    counter: Sampler | DiffusionSampler


class Objective(ABC):
    """What a training objective provides: the loss, a sampler per ``SampleSpec``, the channels
    guidance mixes, and the output mode it reads from the model."""

    name: ClassVar[str]

    @property
    def methods(self) -> tuple[str, ...]:
        """The ``sample.method`` values that sample this objective."""
        return SAMPLE_METHODS[self.name]

    @abstractmethod
    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        """Per-sample loss ``(B,)`` for data ``x`` ``(B, C, H, W)`` and labels ``y`` ``(B,)``;
        t and the noise come from the global RNG, drawn in the order SiT / DiT draw them."""

    @abstractmethod
    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler: ...

    def sampler(self, spec: SampleSpec, *, pixel_space: bool = False) -> BuiltSampler:
        """The sampler ``spec`` describes; ``pixel_space``: the model makes images in [-1, 1]."""
        if spec.method not in self.methods:
            raise SettingError("method", spec.method, f" cannot sample a model trained with the "
                               f"{self.name} objective; valid: {', '.join(self.methods)}")
        return self._sampler(spec, pixel_space)

    def guided_channels(self, cfg_channels: int | None, in_channels: int) -> int | None:
        """Output channels classifier-free guidance mixes (None = all of them)."""
        return cfg_channels

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model set to output what this objective reads (in place; returned for chaining)."""
        return model


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


class DDPMObjective(Objective):
    """DiT's discrete diffusion: integer steps (T-1 = noise), DDPM / DDIM samplers on respaced
    steps; a learned variance makes the model output 2C channels and guidance mix the first C."""

    name = "ddpm"

    def __init__(self, diffusion: GaussianDiffusion) -> None:
        self.diffusion = diffusion

    def __repr__(self) -> str:
        return repr(self.diffusion)

    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        t = self.diffusion.sample_timesteps(len(x), device=x.device)  # DiT: t first, then noise
        return self.diffusion.training_losses(model, x, t, model_kwargs=dict(y=y))["loss"]

    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler:
        sampler = DiffusionSampler(self.diffusion, clip_denoised=pixel_space)
        return BuiltSampler(sampler.build(spec.method, spec.num_steps), sampler)

    def guided_channels(self, cfg_channels: int | None, in_channels: int) -> int | None:
        # "all" means the C noise channels, never the variance half (DiT guides eps only)
        return in_channels if cfg_channels is None else cfg_channels

    def prepare(self, model: nn.Module) -> nn.Module:
        if getattr(model, "learn_sigma", False):  # SiT's forward drops the sigma half otherwise
            model.return_sigma = True
        return model


def create_objective(cfg_transport: Mapping[str, Any]) -> Objective:
    """The objective of a config's ``transport`` section: SiT's transport or DiT's full-step
    diffusion."""
    if objective_name(cfg_transport) == "ddpm":
        return DDPMObjective(create_ddpm(cfg_transport))
    return SiTObjective(create_transport(**transport_kwargs(cfg_transport)))


def as_objective(objective: Objective | Transport | GaussianDiffusion) -> Objective:
    """An :class:`Objective` from itself or from the SiT / DiT object it wraps (their public
    APIs, ``create_transport`` / ``create_diffusion``, return those)."""
    if isinstance(objective, Objective):
        return objective
    if isinstance(objective, GaussianDiffusion):
        return DDPMObjective(objective)
    return SiTObjective(objective)


def respaced(diffusion: GaussianDiffusion, method: str, num_steps: int) -> GaussianDiffusion:
    """The process our DDPM / DDIM sampler runs: DiT's ``"num_steps"`` respacing for ddpm (both
    ends kept), ADM's ``"ddimN"`` (an integer stride) for ddim."""
    return diffusion.respace(str(num_steps) if method == "ddpm" else f"ddim{num_steps}")


class DiffusionSampler:
    """DDPM / DDIM sampling of a ddpm-objective model, shaped like
    :class:`~sit_vit5.transport.Sampler`: :meth:`build` returns ``fn(z, model_fn, *, generator=None,
    **model_kwargs) -> [x]`` (final sample last) and ``last_nfe`` counts the model calls of the
    latest call. ``num_steps`` respaced steps of the trained process: DDPM keeps them evenly spread
    with both ends (DiT's ``"250"``), DDIM on an integer stride (ADM's ``"ddim50"``).

    ``clip_denoised``: clamp each step's x0 prediction to [-1, 1], the data range of pixel-space
    models (ADM / IDDPM sample images so); DiT's latents are unbounded, so DiT samples without it.
    Unclipped, the first step of the cosine schedule (alpha_bar_T ~ 2e-9) scales the eps error by
    sqrt(alpha_bar_{t-1} / alpha_bar_t) ~ 630 on 50 respaced steps."""

    def __init__(self, diffusion: GaussianDiffusion, clip_denoised: bool = False) -> None:
        self.diffusion = diffusion
        self.clip_denoised = clip_denoised
        self._spaced: GaussianDiffusion | None = None

    @property
    def last_nfe(self) -> int | None:
        return None if self._spaced is None else self._spaced.last_nfe

    def build(
        self, method: str, num_steps: int, eta: float = 0.0, progress: bool = False
    ) -> Callable[..., Any]:
        if method not in SAMPLE_METHODS["ddpm"]:
            raise SettingError("method", method, " does not sample the ddpm objective; valid: "
                               + ", ".join(SAMPLE_METHODS["ddpm"]))
        spaced = self._spaced = respaced(self.diffusion, method, num_steps)

        # DDPM: ancestral steps; DDIM: deterministic at eta = 0 (DiT's two samplers)
        loop = spaced.p_sample_loop if method == "ddpm" else partial(spaced.ddim_sample_loop, eta=eta)

        def _sample(
            z: Tensor, model_fn: Callable[..., Tensor], *, generator=None, **model_kwargs
        ) -> list[Tensor]:
            x = loop(model_fn, z.shape, z, clip_denoised=self.clip_denoised,
                     model_kwargs=model_kwargs, progress=progress, generator=generator)
            return [x]

        return _sample
