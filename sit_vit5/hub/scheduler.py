"""``SiTScheduler``: a diffusers scheduler holding how to sample (the transport, the sampler
settings, the latents' VAE), saved as ``scheduler/scheduler_config.json``, with diffusers'
step-wise API (``set_timesteps`` / ``step``) for ODE Euler, DDPM and DDIM."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from diffusers import ConfigMixin, SchedulerMixin
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerOutput
from torch import Tensor

from ..diffusion import GaussianDiffusion
from ..errors import SettingError
from ..objective import Objective, create_objective, respaced
from ..sample_spec import SampleSpec
from ..transport.integrators import batch_time, ode_method, time_grid
from ..vae import vae_enabled

#: the scheduler-config sections that describe how to sample (kept when a scheduler is swapped)
SETTINGS = ("transport", "sampler", "vae")


def ode_interval(objective: Objective) -> tuple[float, float]:
    """``(t0, t1)``: the time interval a sit objective's ODE integrates (0 = noise, 1 = data;
    the transport's train / sample eps move the ends in)."""
    tr = objective.transport  # type: ignore[attr-defined]  # the sit objective
    return tr.check_interval(tr.train_eps, tr.sample_eps, sde=False, eval=True)


class SiTScheduler(SchedulerMixin, ConfigMixin):
    """How to sample: ``transport`` (the objective's config section: ``objective`` sit with
    ``create_transport`` keywords path_type, prediction, ..., or ddpm with DiT's diffusion keys) and
    ``sampler`` (``SampleSpec`` fields: method, sampling_method, num_steps, cfg_scale, ...), plus
    where the latents come from (``vae``: the decoder's source id and scaling factor).

    ``SiTPipeline`` runs the whole trajectory with the transport's integrators (what sample.py
    runs: ODE, SDE, adaptive solvers, DDPM / DDIM). For a hand-written diffusers loop,
    :meth:`set_timesteps` / :meth:`step` cover the ODE Euler path (``timesteps`` = our t in [0, 1),
    0 = noise; ``step`` takes the raw network output and converts it to the transport's velocity)
    and, for the ddpm objective, DDPM / DDIM on DiT's respaced steps (``timesteps`` = DiT's integer
    steps; ``step`` takes the raw output, 2C channels for a learned variance: set
    ``transformer.return_sigma = True``). The DDPM / DDIM steps are our diffusion's, bit-identical
    to the pipeline's: diffusers' ``DDPMScheduler`` / ``DDIMScheduler`` compute the same formulas
    in another float32 order (:func:`~sit_vit5.hub.adapters.diffusers_scheduler` builds them; up
    to ~3e-4 apart after 10 cosine-schedule steps, whose first step amplifies rounding ~600x)::

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
        self,
        transport: dict[str, Any] | None = None,
        sampler: dict[str, Any] | None = None,
        vae: dict[str, Any] | None = None,
    ) -> None:
        # fail now, naming the field, rather than at the first call (an export that cannot sample)
        spec, objective = self.spec(), self.transport()
        if spec.method not in objective.methods:
            raise SettingError("sampler.method", spec.method, f" cannot sample a model trained "
                               f"with the {objective.name} objective (scheduler transport: "
                               f"{dict(transport or {})}); valid: {', '.join(objective.methods)}")
        self.timesteps: Tensor | None = None
        self.num_inference_steps: int | None = None
        self._grid: Tensor | None = None  # the ODE time grid (timesteps + the end point)
        self._spaced: GaussianDiffusion | None = None  # DDPM / DDIM: the respaced process
        self._clip = False
        self._objective: Objective | None = None
        self._method: str | None = None

    def spec(self, **overrides: Any) -> SampleSpec:
        """The sampler settings as a ``SampleSpec``, with ``overrides`` (None values ignored)
        applied."""
        settings = {
            **(self.config.sampler or {}),
            **{k: v for k, v in overrides.items() if v is not None},
        }
        return SampleSpec(**settings)

    def transport(self) -> Objective:
        """The objective the model was trained with: SiT's ``Transport`` or DiT's diffusion."""
        return create_objective(self.config.transport or {})

    def scale_model_input(self, sample: Tensor, timestep: Any = None) -> Tensor:
        """Identity (diffusers' loop API: our model takes x_t as it is)."""
        return sample

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        pixel_space: bool | None = None,
    ) -> None:
        """Prepare ``timesteps`` for :meth:`step`. ``num_inference_steps``: the sampler's num_steps
        (None = the exported default; ODE: grid points, so num_steps - 1 Euler steps). Covers
        method ode with sampling_method euler, ddpm and ddim; ``pixel_space`` (None: the ``vae``
        section says "none") clips DDPM / DDIM x0 predictions to [-1, 1] as the pipeline does."""
        spec = self.spec(num_steps=num_inference_steps)
        objective = self._objective = self.transport()
        self._method, self._spaced = spec.method, None
        if spec.method == "ode" and ode_method(spec.sampling_method) == "euler":
            t0, t1 = ode_interval(objective)
            self._grid = time_grid(t0, t1, spec.num_steps, torch.empty(0, device=device))
            self.timesteps = self._grid[:-1]
        elif spec.method in ("ddpm", "ddim"):
            if pixel_space is None:
                pixel_space = self.config.vae is not None and not vae_enabled(
                    self.config.vae.get("name"))
            diffusion = objective.diffusion  # type: ignore[attr-defined]  # the ddpm objective
            self._spaced = respaced(diffusion, spec.method, spec.num_steps)
            self._clip = pixel_space
            # the network's steps: DiT's original integer steps, noisiest first
            self.timesteps = torch.tensor(self._spaced.timestep_map[::-1], device=device)
        else:
            raise SettingError("method", f"{spec.method}/{spec.sampling_method}",
                               ": step-wise sampling (set_timesteps / step) covers ode/euler, ddpm "
                               "and ddim; the SDE and the other ODE solvers run whole trajectories "
                               "in SiTPipeline.__call__")
        self.num_inference_steps = len(self.timesteps)

    def step(
        self,
        model_output: Tensor,
        timestep: float | Tensor,
        sample: Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None,
        return_dict: bool = True,
    ) -> SchedulerOutput | tuple[Tensor]:
        """``x`` at the next entry of ``timesteps`` from the raw network output at ``timestep``
        (one of ``timesteps``) and ``sample`` ``(B, C, H, W)``. ODE: an Euler step ``x + (t_next -
        t) v`` with the transport's velocity; DDPM / DDIM (eta 0): DiT's step (``generator``: the
        DDPM noise, a list = one per image, as in diffusers)."""
        if self.timesteps is None:
            raise RuntimeError("SiTScheduler.step: call set_timesteps first")
        if self._spaced is None:
            i = _index_of(self.timesteps, timestep)
            t, t_next = self._grid[i], self._grid[i + 1]
            out = model_output[:, : sample.shape[1]]  # learn-sigma output: the transport reads half
            tr = self._objective.transport  # type: ignore[union-attr]
            prev = sample + (t_next - t) * tr.velocity(out, sample, batch_time(t, sample))
        else:
            # our DiT step on the given output: exactly what the whole-trajectory loop computes
            index = len(self.timesteps) - 1 - _index_of(self.timesteps, timestep)
            t = torch.full((len(sample),), index, dtype=torch.long, device=sample.device)
            step = self._spaced.p_sample if self._method == "ddpm" else self._spaced.ddim_sample
            prev = step(lambda *args, **kwargs: model_output, sample, t, clip_denoised=self._clip,
                        generator=generator)["sample"]
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)


def _index_of(timesteps: Tensor, timestep: float | Tensor) -> int:
    """Position of ``timestep`` in ``timesteps`` (exact match: they are the grid's own values)."""
    hits = (timesteps == torch.as_tensor(timestep, device=timesteps.device)).nonzero()
    if len(hits) == 0:
        raise ValueError(f"timestep {float(timestep)!r} is not one of scheduler.timesteps")
    return int(hits[0, 0])


def scheduler_from(
    transport: dict[str, Any], spec: SampleSpec, vae: dict[str, Any] | None = None
) -> SiTScheduler:
    """A ``SiTScheduler`` holding ``transport`` (the objective's config section) and every field of
    ``spec``."""
    sampler = dataclasses.asdict(spec)
    return SiTScheduler(transport=dict(transport), sampler=sampler, vae=dict(vae) if vae else None)
