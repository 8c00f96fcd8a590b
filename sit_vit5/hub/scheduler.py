"""``SiTScheduler``: a diffusers scheduler holding how to sample (the objective, the sampler
settings, the latents' VAE), saved as ``scheduler/scheduler_config.json``, with diffusers' step-wise
API (``set_timesteps`` / ``step``) over the objective's own steps (ODE Euler, DDPM, DDIM, and the
diffusers solvers a ``sampling_method`` names)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from diffusers import ConfigMixin, SchedulerMixin
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerOutput
from torch import Tensor

from ..objective import Objective, create_objective
from ..sample_spec import SampleSpec
from ..stepwise import Steps
from ..utils.errors import SettingError
from ..vae import vae_enabled

#: the scheduler-config sections that describe how to sample (kept when a scheduler is swapped)
SETTINGS = ("transport", "sampler", "vae")


class SiTScheduler(SchedulerMixin, ConfigMixin):
    """How to sample: ``transport`` (the objective's config section: ``objective`` sit with
    ``create_transport`` keywords path_type, prediction, ..., or ddpm with DiT's diffusion keys) and
    ``sampler`` (``SampleSpec`` fields: method, sampling_method, num_steps, cfg_scale, ...), plus
    where the latents come from (``vae``: the decoder's source id and scaling factor).

    ``SiTPipeline`` runs the whole trajectory with the objective's sampler (ODE, SDE, adaptive
    solvers, DDPM / DDIM). In a hand-written diffusers loop, :meth:`set_timesteps` / :meth:`step`
    run ``Objective.steps``: ODE Euler (``timesteps`` = our t in [0, 1), 0 = noise) or DDPM / DDIM
    on DiT's respaced integer steps; ``step`` takes the model's full output (2C channels with a
    learned variance). The DDPM / DDIM steps are bit-identical to the pipeline's; diffusers'
    schedulers (:func:`~sit_vit5.diffusion.ddpm_sampler.diffusers_scheduler`) compute the same
    formulas in another float32 order::

        scheduler.set_timesteps(num_steps)
        for t in scheduler.timesteps:
            x = scheduler.step(transformer(x, t.expand(len(x)), y), t, x).prev_sample
    """

    config_name = "scheduler_config.json"
    _compatibles = ["FlowMatchEulerDiscreteScheduler", "DDPMScheduler", "DDIMScheduler"]
    order = 1
    init_noise_sigma = 1.0

    @register_to_config
    def __init__(
        self, transport: dict[str, Any] | None = None, sampler: dict[str, Any] | None = None,
        vae: dict[str, Any] | None = None,
    ) -> None:
        # fail now, naming the field, rather than at the first call (an export that cannot sample)
        try:
            self.objective().check_method(self.spec())
        except SettingError as err:
            raise SettingError(f"sampler.{err.key}", err.value, err.reason) from None
        self.timesteps: Tensor | None = None
        self.num_inference_steps: int | None = None
        self._steps: Steps | None = None

    def spec(self, **overrides: Any) -> SampleSpec:
        """The sampler settings as a ``SampleSpec``, with ``overrides`` (None values ignored)
        applied."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return SampleSpec(**{**(self.config.sampler or {}), **given})

    def objective(self) -> Objective:
        """The objective the model was trained with: SiT's transport or DiT's diffusion."""
        return create_objective(self.config.transport or {})

    def pixel_space(self) -> bool:
        """Whether the model makes images itself (the ``vae`` section says "none")."""
        return self.config.vae is not None and not vae_enabled(self.config.vae.get("name"))

    def scale_model_input(self, sample: Tensor, timestep: Any = None) -> Tensor:
        """Identity (diffusers' loop API: our model takes x_t as it is)."""
        return sample

    def set_timesteps(self, num_inference_steps: int | None = None,
                      device: str | torch.device | None = None,
                      pixel_space: bool | None = None) -> None:
        """Prepare ``timesteps`` for :meth:`step`. ``num_inference_steps``: the sampler's num_steps
        (None = the exported default; ODE: grid points, so num_steps - 1 Euler steps).
        ``pixel_space`` (None: the ``vae`` section says "none") clips DDPM / DDIM x0 predictions to
        [-1, 1] as the pipeline does."""
        pixel_space = self.pixel_space() if pixel_space is None else pixel_space
        spec = self.spec(num_steps=num_inference_steps)
        self._steps = self.objective().steps(spec, pixel_space=pixel_space, device=device)
        self.timesteps = self._steps.timesteps
        self.num_inference_steps = len(self.timesteps)

    def step(
        self, model_output: Tensor, timestep: float | Tensor, sample: Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None, return_dict: bool = True,
    ) -> SchedulerOutput | tuple[Tensor]:
        """``x`` at the next entry of ``timesteps`` from the model's full output at ``timestep``
        (one of ``timesteps``) and ``sample`` ``(B, C, H, W)``; ``generator``: the DDPM noise (a
        list = one per image, as in diffusers)."""
        if self._steps is None:
            raise RuntimeError("SiTScheduler.step: call set_timesteps first")
        prev = self._steps.step(model_output, torch.as_tensor(timestep), sample, generator)
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)


def scheduler_from(
    transport: dict[str, Any], spec: SampleSpec, vae: dict[str, Any] | None = None
) -> SiTScheduler:
    """A ``SiTScheduler`` holding ``transport`` (the objective's config section) and every field of
    ``spec``."""
    sampler = dataclasses.asdict(spec)
    return SiTScheduler(transport=dict(transport), sampler=sampler, vae=dict(vae) if vae else None)
