"""Sampling DiT's objective: whole DDPM / DDIM trajectories (:class:`DiffusionSampler`), the same
steps one at a time (:class:`DiffusionSteps`), diffusers' DDPM / DDIM schedulers driven step by step
(:class:`SchedulerSteps`) and set up as our process (:func:`diffusers_scheduler`), and diffusers'
multistep solvers of the same ODE / SDE (:func:`solver_scheduler`).

``num_steps`` respaced steps of the trained process: DDPM keeps them evenly spread with both ends
(DiT's ``"250"``), DDIM takes them on an integer stride (ADM's ``"ddim50"``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..names import DIFFUSION_SOLVERS
from ..stepwise import refuse_repeated_timesteps
from ..transport.integrators import index_of
from ..transport.rng import GeneratorLike, randn_like, resolve_generator
from ..utils.errors import SettingError
from .gaussian_diffusion import GaussianDiffusion

#: numpy 2's DeprecationWarning when diffusers' multistep schedulers call np.array on a torch tensor
NUMPY_COPY_NOTICE = ".*__array__ implementation doesn't accept a copy keyword"


def respaced(diffusion: GaussianDiffusion, method: str, num_steps: int) -> GaussianDiffusion:
    """The process the DDPM (``"num_steps"``, both ends kept) or DDIM (``"ddimN"``) sampler runs."""
    return diffusion.respace(str(num_steps) if method == "ddpm" else f"ddim{num_steps}")


class DiffusionSampler:
    """Whole DDPM / DDIM trajectories, shaped like :class:`~sit_vit5.transport.Sampler`:
    :meth:`build` returns ``fn(z, model_fn, *, generator=None, **model_kwargs) -> [x]`` (final
    sample last) and ``last_nfe`` counts the model calls of the latest call.

    ``clip_denoised``: clamp each step's x0 prediction to [-1, 1], the data range of pixel-space
    models (ADM samples images so); DiT's latents are unbounded, so DiT samples without it.
    Unclipped, the first step of the cosine schedule (alpha_bar_T ~ 2e-9) scales the eps error by
    ~630 on 50 respaced steps."""

    def __init__(self, diffusion: GaussianDiffusion, clip_denoised: bool = False) -> None:
        self.diffusion = diffusion
        self.clip_denoised = clip_denoised
        self._spaced: GaussianDiffusion | None = None

    @property
    def last_nfe(self) -> int | None:
        return None if self._spaced is None else self._spaced.last_nfe

    def build(self, method: str, num_steps: int, eta: float = 0.0, progress: bool = False
              ) -> Callable[..., list[Tensor]]:
        """The sampling function of ``method`` ddpm (ancestral) or ddim (``eta`` 0: deterministic).
        """
        spaced = self._spaced = respaced(self.diffusion, method, num_steps)
        loop = (spaced.p_sample_loop if method == "ddpm"
                else partial(spaced.ddim_sample_loop, eta=eta))

        def _sample(z: Tensor, model_fn: Callable[..., Tensor], *, generator: GeneratorLike = None,
                    **model_kwargs: Any) -> list[Tensor]:
            return [loop(model_fn, z.shape, z, clip_denoised=self.clip_denoised,
                         model_kwargs=model_kwargs, progress=progress, generator=generator)]

        return _sample


class DiffusionSteps:
    """Our DDPM / DDIM step on a given network output: ``timesteps`` are DiT's original integer
    steps, noisiest first (what the network receives); ``step`` is exactly one step of
    :class:`DiffusionSampler`'s loop (a learned variance reads both halves of the 2C-channel
    output)."""

    init_noise_sigma = 1.0

    def __init__(self, diffusion: GaussianDiffusion, method: str, num_steps: int, *,
                 clip_denoised: bool, eta: float = 0.0,
                 device: torch.device | str | None = None) -> None:
        self.spaced = respaced(diffusion, method, num_steps)
        self.clip_denoised = clip_denoised
        kind = (self.spaced.p_sample if method == "ddpm"
                else partial(self.spaced.ddim_sample, eta=eta))
        self._step = kind
        self.timesteps = torch.tensor(self.spaced.timestep_map[::-1], device=device)

    def restart(self) -> None:
        """Nothing to reset: these steps keep no state between trajectories."""

    def model_input(self, x: Tensor, t: Tensor) -> Tensor:
        return x

    def model_time(self, t: Tensor, x: Tensor) -> Tensor:
        return t.to(x.device).expand(len(x))

    def step(self, model_output: Tensor, t: Tensor, x: Tensor, generator: Any = None) -> Tensor:
        index = len(self.timesteps) - 1 - index_of(self.timesteps, t)
        t_index = torch.full((len(x),), index, dtype=torch.long, device=x.device)
        out = self._step(lambda *args, **kwargs: model_output, x, t_index,
                         clip_denoised=self.clip_denoised, generator=generator)
        return out["sample"]


class SchedulerSteps:
    """diffusers' DDPM-family ``scheduler`` (epsilon prediction) stepping our model: its own
    timesteps for ``num_steps``; a learned-variance scheduler reads both halves of the output,
    others the first C. An SDE solver (DPM-Solver++ ``sde-*``) gets its noise from ``generator``
    by our per-image rule (:mod:`~sit_vit5.transport.rng`), as our DDPM step does. SettingError
    naming num_steps when two of the scheduler's integer timesteps coincide."""

    def __init__(self, scheduler: Any, num_steps: int,
                 device: torch.device | str | None = None) -> None:
        prediction = scheduler.config.get("prediction_type", "epsilon")
        if prediction != "epsilon":
            raise SettingError("scheduler", type(scheduler).__name__, f" with prediction_type="
                               f"{prediction!r}: our ddpm-objective models predict epsilon")
        self.scheduler = scheduler

        def setup() -> None:
            with warnings.catch_warnings():  # UniPC / DPM-Solver run np.array(tensor): numpy 2's
                warnings.filterwarnings("ignore", message=NUMPY_COPY_NOTICE)  # harmless notice
                scheduler.set_timesteps(num_steps, device=device)

        self._setup = setup
        self._setup()
        self.timesteps = scheduler.timesteps
        self.init_noise_sigma = getattr(scheduler, "init_noise_sigma", 1.0)
        self.learned = scheduler.config.get("variance_type") in ("learned", "learned_range")
        self.stochastic = "generator" in inspect.signature(scheduler.step).parameters  # DDPM: noise
        self.sde_noise = str(scheduler.config.get("algorithm_type", "")).startswith("sde")
        refuse_repeated_timesteps(self.timesteps, num_steps,
                                  f": {type(scheduler).__name__}'s integer timesteps repeat at "
                                  f"{num_steps} steps of {scheduler.config.num_train_timesteps}; "
                                  "use fewer steps")

    def restart(self) -> None:
        self._setup()

    def model_input(self, x: Tensor, t: Tensor) -> Tensor:
        scale = getattr(self.scheduler, "scale_model_input", None)
        return x if scale is None else scale(x, t)

    def model_time(self, t: Tensor, x: Tensor) -> Tensor:
        return t.to(x.device).expand(len(x))

    def step(self, model_output: Tensor, t: Tensor, x: Tensor, generator: Any = None) -> Tensor:
        out = model_output if self.learned else model_output[:, : x.shape[1]]
        if self.sde_noise:
            extra = {"variance_noise": randn_like(x, resolve_generator(generator, len(x)))}
        else:
            extra = {"generator": generator} if self.stochastic else {}
        return self.scheduler.step(out, t, x, **extra).prev_sample


def solver_scheduler(diffusion: GaussianDiffusion, method: str, sampling_method: str,
                     pixel_space: bool) -> Any:
    """diffusers' multistep solver ``DIFFUSION_SOLVERS[method][sampling_method]`` of our process:
    its trained betas (the original, unrespaced ones), epsilon prediction, its own timesteps (999
    first) and last step to sigma 0. ``pixel_space`` clips each x0 prediction to [-1, 1] (diffusers'
    thresholding with its maximum at 1 is exactly that clip), as our DDPM / DDIM do."""
    import diffusers

    solvers = DIFFUSION_SOLVERS.get(method, {})
    if sampling_method not in solvers:
        raise SettingError("sampling_method", sampling_method,
                           f": not a method={method} solver; valid: {', '.join(solvers)}")
    cls, kwargs = solvers[sampling_method]
    clip = {"thresholding": True, "sample_max_value": 1.0} if pixel_space else {}
    return getattr(diffusers, cls)(
        num_train_timesteps=diffusion.original_num_steps, prediction_type="epsilon",
        trained_betas=diffusion.original_betas.tolist(), **clip, **kwargs)


def is_epsilon_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler`` is of diffusers' DDPM family (it keeps ``alphas_cumprod``)."""
    return hasattr(scheduler, "alphas_cumprod")


def diffusers_scheduler(
    diffusion: GaussianDiffusion, method: str, num_steps: int, pixel_space: bool
) -> Any:
    """diffusers' ``DDPMScheduler`` (method ddpm) or ``DDIMScheduler`` (ddim, eta 0) set up as our
    process: our betas, our float64 cumulative products rounded once to float32, the respaced steps
    our sampler uses; ``pixel_space`` clips x0 to [-1, 1]. Equal to ours up to float32 rounding
    (~3e-4 after 10 cosine steps, whose first step amplifies rounding ~600x). Raises
    ``SettingError`` when DDIMScheduler's stride (T // num_steps) is not DiT's."""
    from diffusers import DDIMScheduler, DDPMScheduler

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
            theirs = diffusion.original_num_steps // num_steps
            raise SettingError("num_steps", num_steps,
                               f": DiT's ddim{num_steps} respacing (stride {stride}) "
                               f"is not DDIMScheduler's (stride {theirs}); "
                               "step-wise DDIM needs equal strides (e.g. a divisor of "
                               f"{diffusion.original_num_steps}); the pipeline's DDIM has no limit")
    inner.alphas_cumprod = torch.cumprod(1.0 - diffusion.original_betas, dim=0).float()
    return inner
