"""Samplers (SiT API): probability-flow ODE, SDE and ODE likelihood, each counting model calls.

Each ``sample_*`` method returns ``fn(z, model_fn, *, generator=None, **model_kwargs)``;
``model_fn(x, t, **model_kwargs)`` gets ``t`` of shape ``(B,)`` (wrap it in
:class:`~sit_vit5.guidance.ClassifierFreeGuidance` for guidance). ``generator`` (:mod:`.rng`), one
per row, makes the SDE noise and Hutchinson probes depend on each row's seed only. After each call
``sampler.last_nfe`` holds the number of ``model_fn`` calls (a guided doubled batch counts once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..names import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    TRANSPORT_METHODS,
    choose,
    flow_solver_name,
)
from ..stepwise import Steps, denoise
from ..utils.errors import SettingError
from .integrators import (
    SDE_STEPS,
    CountingModel,
    batch_time,
    index_of,
    is_adaptive,
    ode_method,
    solve_ode,
    time_grid,
    warn_adaptive,
)
from .likelihood import ode_likelihood
from .paths import DIFFUSION_FORMS
from .per_sample import expand_t_like_x
from .rng import GeneratorLike, randn_like, resolve_generator
from .transport import Transport

METHODS = TRANSPORT_METHODS  # probability-flow ODE or SDE: the ``method`` of configs and CLIs

HOST_FLOATS = torch.empty(0, dtype=torch.float64)  # on cpu: time_grid's `like` for host-side grids

# Last SDE step from t1 to 1 (size h), given x, v, s, D at t1 and the path's alpha, sigma at t1.
LastStep = Callable[[Tensor, Tensor, Tensor, Tensor, float, Tensor, Tensor], Tensor]
LAST_STEPS: dict[str | None, LastStep | None] = {
    "Mean": lambda x, v, s, D, h, alpha, sigma: x + (v + D * s) * h,  # noise-free SDE step
    "Tweedie": lambda x, v, s, D, h, alpha, sigma: (x + sigma**2 * s) / alpha,  # E[x1 | x_t1]
    "Euler": lambda x, v, s, D, h, alpha, sigma: x + v * h,  # probability-flow ODE step
    None: None,  # stop at t1 (no model evaluation)
    "none": None,
}


def shift_times(t: Tensor, shift: float | None) -> Tensor:
    """SD3's time shift of the noise level ``sigma = 1 - t`` (our t: 0 = noise): ``sigma' = s sigma
    / (1 + (s - 1) sigma)``; s > 1 spends more steps at high noise; None or 1 return ``t`` itself.
    The ends stay put (sigma 0 and 1 are fixed points)."""
    if shift is None or shift == 1.0:
        return t
    sigma = 1.0 - t
    return 1.0 - shift * sigma / (1.0 + (shift - 1.0) * sigma)


class Sampler:
    """Builds sampling functions for a :class:`Transport` (t = 0 noise -> t = 1 data).

    The keyword defaults are SiT's ``Sampler`` API defaults (e.g. SDE diffusion form SBDM), kept for
    SiT-style calls; sampling runs (sample.py, training grids, experiments) take every setting from
    :class:`sit_vit5.sample_spec.SampleSpec`, whose ``options()`` passes all of them explicitly.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.last_nfe: int | None = None  # model evaluations of the most recent sampling call

    def _velocity_fn(
        self, model: Callable[..., Tensor], model_kwargs: dict
    ) -> Callable[[Tensor, Tensor], Tensor]:
        tr = self.transport
        return lambda x, t: tr.velocity(tr.model_output(model, x, t, **model_kwargs), x, t)

    def ode_grid(self, num_steps: int, like: Tensor, reverse: bool = False,
                 time_shift: float | None = None) -> Tensor:
        """The probability-flow ODE's time grid: ``num_steps`` points from t0 to t1 (0 = noise; the
        transport's eps move the ends in), data to noise with ``reverse``, shifted by
        ``time_shift`` (:func:`shift_times`); dtype and device of ``like``."""
        tr = self.transport
        t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, sde=False, eval=True,
                                   reverse=reverse)
        return shift_times(time_grid(t0, t1, num_steps, like), time_shift)

    # ---------------------------------------------------------------- ODE
    def sample_ode(self, *, sampling_method: str = "dopri5", num_steps: int = 50,
                   atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, reverse: bool = False,
                   time_shift: float | None = None) -> Callable[..., Tensor]:
        """Probability-flow ODE from noise ``z`` at t0 to data at t1 (``reverse``: data -> noise).

        Fixed-grid methods take ``num_steps - 1`` steps (NFE = steps x evaluations per step, e.g.
        heun2: 2); adaptive ones (dopri5, ...) report their solution on ``num_steps`` grid points
        and warn about it; diffusers' multistep flow solvers (``FLOW_SOLVERS``: unipc) take
        ``num_steps - 1`` steps of 1 evaluation on their own sigmas, ``time_shift`` being their
        ``flow_shift``. The function returns the trajectory ``(num_steps, *z.shape)``,
        final sample last.
        """
        if flow_solver_name(sampling_method) is not None:
            if reverse:
                raise SettingError("sampling_method", sampling_method,
                                   ": diffusers' flow solvers integrate noise -> data only")
            from .flow_solvers import FlowSchedulerSteps, flow_scheduler  # diffusers: only here

            return self._sample_flow_solver(FlowSchedulerSteps(
                self, flow_scheduler(sampling_method, time_shift), num_steps))
        method = ode_method(sampling_method)
        if is_adaptive(method):
            warn_adaptive(method, num_steps)

        def _sample(z: Tensor, model_fn: Callable[..., Tensor], *,
                    generator: GeneratorLike = None, **model_kwargs):
            # the ODE is deterministic: generator is accepted only for a uniform API
            model = CountingModel(model_fn)
            grid = self.ode_grid(num_steps, z, reverse=reverse, time_shift=time_shift)
            xs = solve_ode(self._velocity_fn(model, model_kwargs), z, grid, method, atol, rtol)
            self.last_nfe = model.nfe
            return xs

        return _sample

    def _sample_flow_solver(self, steps: Steps) -> Callable[..., Tensor]:
        """The whole trajectory of a diffusers flow scheduler's ``steps`` (restarted per call)."""

        def _sample(z: Tensor, model_fn: Callable[..., Tensor], *,
                    generator: GeneratorLike = None, **model_kwargs):
            # deterministic: generator is accepted only for a uniform API
            model, xs = CountingModel(model_fn), []
            with torch.no_grad():
                denoise(steps, z, model, trajectory=xs, **model_kwargs)
            self.last_nfe = model.nfe
            return torch.stack(xs)

        return _sample

    # ---------------------------------------------------------------- SDE
    def sample_sde(
        self, *, sampling_method: str = "Euler", diffusion_form: str = "SBDM",
        diffusion_norm: float = 1.0, last_step: str | None = "Mean", last_step_size: float = 0.04,
        num_steps: int = 250, time_shift: float | None = None, progress: bool = False,
    ) -> Callable[..., list[Tensor]]:
        """SDE ``dX = [v + D s] dt + sqrt(2 D) dW`` on ``linspace(t0, t1, num_steps)`` then a last
        step.

        ``sampling_method``: Euler (Euler-Maruyama, 1 NFE/step) | Heun (2 NFE/step);
        ``diffusion_form``: see ``DIFFUSION_FORMS``; ``last_step``: Mean | Tweedie | Euler | None (1
        NFE, or 0 for None) of size ``last_step_size`` (t1 = 1 - last_step_size). Velocity and score
        come from one model call per drift. The function returns a list of ``num_steps`` states,
        final sample last (as SiT).
        """
        step = choose(SDE_STEPS, sampling_method, "SDE sampling_method")
        choose(DIFFUSION_FORMS, diffusion_form, "diffusion_form")
        last = choose(LAST_STEPS, last_step, "last_step")
        if last is None:
            last_step_size = 0.0
        tr, path = self.transport, self.transport.path_sampler
        t0, t1 = tr.check_interval(
            tr.train_eps, tr.sample_eps, diffusion_form=diffusion_form, sde=True, eval=True,
            last_step_size=last_step_size,
        )
        grid = time_grid(t0, t1, num_steps, HOST_FLOATS)  # float64 on the CPU: the steps' floats
        times = shift_times(grid, time_shift).tolist()
        # uniform: SiT's one dt; shifted: each step its own
        dts = [times[1] - times[0]] * (num_steps - 1) if time_shift in (None, 1.0) else \
            [b - a for a, b in zip(times[:-1], times[1:])]

        def _sample(z: Tensor, model_fn: Callable[..., Tensor], *,
                    generator: GeneratorLike = None, **model_kwargs):
            model, gen = CountingModel(model_fn), resolve_generator(generator, len(z))

            def diffusion(x: Tensor, t: Tensor) -> Tensor:
                return path.compute_diffusion(x, t, form=diffusion_form, norm=diffusion_norm)

            def fields(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                """Velocity, score and D_t from a single model call."""
                out = tr.model_output(model, x, t, **model_kwargs)
                return tr.velocity(out, x, t), tr.score(out, x, t), diffusion(x, t)

            def drift(x: Tensor, t: Tensor) -> Tensor:
                v, s, D = fields(x, t)
                return v + D * s

            xs, x = [], z
            with torch.no_grad():
                for t, dt in tqdm(list(zip(times[:-1], dts)), disable=not progress, leave=False,
                                  desc="SDE"):
                    x = step(x, t, dt, randn_like(x, gen), drift, diffusion)
                    xs.append(x)
                if last is not None:
                    t_b = batch_time(t1, x)
                    v, s, D = fields(x, t_b)
                    t_x = expand_t_like_x(t_b, x)
                    alpha_t, sigma_t = path.compute_alpha_t(t_x)[0], path.compute_sigma_t(t_x)[0]
                    x = last(x, v, s, D, last_step_size, alpha_t, sigma_t)
                xs.append(x)
            self.last_nfe = model.nfe
            return xs

        return _sample

    # ---------------------------------------------------------------- likelihood
    def sample_ode_likelihood(self, **options: Any) -> Callable[..., tuple[Tensor, Tensor]]:
        """Log-likelihood of data by the probability-flow ODE run backwards: the function of
        :func:`~sit_vit5.transport.likelihood.ode_likelihood` for this sampler (its ``options``)."""
        return ode_likelihood(self, **options)


# -------------------------------------------------------- step by step (diffusers' loop API)


class EulerSteps:
    """The probability-flow ODE's Euler steps one at a time on the sampler's grid: ``timesteps`` are
    our t (0 = noise; what the network receives), ``step`` takes the raw network output."""

    init_noise_sigma = 1.0

    def __init__(self, sampler: Sampler, num_steps: int, device: torch.device | str | None = None,
                 time_shift: float | None = None) -> None:
        self.transport = sampler.transport
        like = torch.empty(0, device=device)
        self.grid = sampler.ode_grid(num_steps, like, time_shift=time_shift)
        self.timesteps = self.grid[:-1]

    def restart(self) -> None:
        """Nothing to reset: these steps keep no state between trajectories."""

    def model_input(self, x: Tensor, t: Tensor) -> Tensor:
        return x

    def model_time(self, t: Tensor, x: Tensor) -> Tensor:
        return batch_time(t, x)

    def step(self, model_output: Tensor, t: Tensor, x: Tensor,
             generator: GeneratorLike = None) -> Tensor:
        i = index_of(self.timesteps, t)
        t, t_next = self.grid[i], self.grid[i + 1]
        out = self.transport.read_output(model_output, x)
        return x + (t_next - t) * self.transport.velocity(out, x, batch_time(t, x))
