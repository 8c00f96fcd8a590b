"""diffusers' multistep solvers (UniPC) and FlowMatch schedulers stepping SiT's probability-flow
ODE: their sigma is 1 - t (t = 0 noise), their flow points from data to noise (= -velocity). Loaded
when ``sampling_method`` names one (``names.FLOW_SOLVERS``) or a diffusers scheduler is given."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..names import FLOW_SOLVERS, flow_solver_name
from ..stepwise import refuse_repeated_timesteps
from ..utils.errors import SettingError
from .integrators import index_of
from .rng import GeneratorLike

if TYPE_CHECKING:
    from .sampler import Sampler  # the sampler builds these steps: its grid, its transport


def flow_scheduler(sampling_method: str, time_shift: float | None = None) -> Any:
    """diffusers' multistep scheduler of a ``FLOW_SOLVERS`` name with flow sigmas and velocity
    (``flow_prediction``) output, its sigmas shifted by ``time_shift`` (SD3's shift = diffusers'
    ``flow_shift``; None: uniform)."""
    import diffusers

    name = flow_solver_name(sampling_method)
    if name is None:
        raise SettingError("sampling_method", sampling_method,
                           f": not a diffusers flow solver; valid: {', '.join(FLOW_SOLVERS)}")
    cls, kwargs = FLOW_SOLVERS[name]
    return getattr(diffusers, cls)(use_flow_sigmas=True, prediction_type="flow_prediction",
                                   flow_shift=1.0 if time_shift is None else float(time_shift),
                                   **kwargs)


def is_flow_scheduler(scheduler: Any) -> bool:
    """Whether a diffusers ``scheduler`` steps a flow on sigma = 1 - t: ``FlowMatch*``, or a
    multistep solver (UniPC, DPM-Solver++, DEIS) with ``use_flow_sigmas`` and
    ``prediction_type="flow_prediction"``."""
    config = scheduler.config
    return type(scheduler).__name__.startswith("FlowMatch") or (
        bool(config.get("use_flow_sigmas")) and config.get("prediction_type") == "flow_prediction")


class FlowSchedulerSteps:
    """diffusers' flow ``scheduler`` (:func:`is_flow_scheduler`) stepping our model: its sigma is
    1 - t and its flow points from data to noise (= -velocity). ``FlowMatch*`` steps on our ODE grid
    (``num_steps`` points, shifted by ``time_shift``); the multistep solvers on their own sigmas,
    ``num_steps - 1`` of them (their ``flow_shift`` is the shift: ``time_shift`` is refused). Their
    timesteps are integers (sigma x num_train_timesteps, rounded): a step count at which two of
    them coincide would misplace the first step and is refused (SettingError naming num_steps)."""

    def __init__(self, sampler: Sampler, scheduler: Any, num_steps: int,
                 device: torch.device | str | None = None, time_shift: float | None = None) -> None:
        self.transport, self.scheduler = sampler.transport, scheduler
        cpu = torch.empty(0)  # on cpu: the sigmas go out as numpy
        grid = sampler.ode_grid(num_steps, cpu, time_shift=time_shift)
        name = type(scheduler).__name__
        if float(grid[-1]) != 1.0:
            raise SettingError("scheduler", name,
                               f": ends at sigma 0 (t = 1), but this transport integrates to "
                               f"t = {float(grid[-1])} ({self.transport!r}); keep the SiTScheduler")
        self._exact_sigma = not name.startswith("FlowMatch")  # multistep: integer timesteps
        if not self._exact_sigma:
            sigmas = (1.0 - grid[:-1].double()).numpy()
            self._setup = lambda: scheduler.set_timesteps(sigmas=sigmas, device=device)
        elif time_shift not in (None, 1.0):
            raise SettingError("time_shift", time_shift, f": {name} spaces its own sigmas; set its "
                               "flow_shift instead")
        else:
            self._setup = lambda: scheduler.set_timesteps(num_steps - 1, device=device)
        self._setup()
        self.timesteps = scheduler.timesteps
        self.init_noise_sigma = getattr(scheduler, "init_noise_sigma", 1.0)
        if self._exact_sigma:
            shift = scheduler.config.get("flow_shift", 1.0)
            refuse_repeated_timesteps(
                self.timesteps, num_steps,
                f": {name} rounds its timesteps to integers (sigma x "
                f"{scheduler.config.num_train_timesteps}), and at {num_steps - 1} steps"
                + (f" with flow_shift {shift:g}" if shift != 1 else "") + " two coincide; "
                "use fewer steps")

    def restart(self) -> None:
        self._setup()

    def model_input(self, x: Tensor, t: Tensor) -> Tensor:
        return x

    def model_time(self, t: Tensor, x: Tensor) -> Tensor:
        """Our t = 1 - sigma. A multistep solver's timestep is sigma rounded to an integer (up to
        5e-4 off in t), which leaves UniPC first order below ~4e-3; its exact sigma keeps it
        second order. FlowMatch's timesteps are unrounded (sigma x 1000), read as they are."""
        if self._exact_sigma:
            return (1.0 - self.scheduler.sigmas[index_of(self.timesteps, t)]).to(x).expand(len(x))
        return (1.0 - t / self.scheduler.config.num_train_timesteps).to(x).expand(len(x))

    def step(self, model_output: Tensor, t: Tensor, x: Tensor,
             generator: GeneratorLike = None) -> Tensor:
        """``x`` ``(B, C, H, W)`` at the next timestep (``t``: one of ``timesteps``): the
        scheduler's step on its flow, ``-velocity``."""
        out = self.transport.read_output(model_output, x)
        velocity = self.transport.velocity(out, x, self.model_time(t, x))
        return self.scheduler.step(-velocity, t, x).prev_sample
