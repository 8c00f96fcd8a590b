"""SiT's objective: the transport (paths, predictions, loss weights) as an :class:`Objective`,
with the ODE / SDE samplers and their step-wise forms."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from ..names import flow_solver_name
from ..sample_spec import SampleSpec
from ..stepwise import Steps
from ..transport import TRANSPORT_KEYS, Sampler, Transport, create_transport
from ..transport.integrators import ode_method
from ..transport.sampler import EulerSteps
from ..utils.errors import SettingError
from .base import BuiltSampler, Objective


def transport_kwargs(cfg_transport: Mapping[str, Any]) -> dict[str, Any]:
    """``create_transport`` keywords of a transport section (SiT keys that are set)."""
    return {k: cfg_transport[k] for k in TRANSPORT_KEYS if cfg_transport.get(k) is not None}



class SiTObjective(Objective):
    """SiT's transport: continuous t in [0, 1] (0 = noise), ODE / SDE samplers."""

    name = "sit"
    keys = TRANSPORT_KEYS

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @classmethod
    def from_config(cls, cfg_transport: Mapping[str, Any]) -> SiTObjective:
        return cls(create_transport(**transport_kwargs(cfg_transport)))

    def __repr__(self) -> str:
        return repr(self.transport)  # what sample.py prints and bulk runs record

    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        return self.transport.training_losses(model, x, model_kwargs=dict(y=y))["loss"]

    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler:
        sampler = Sampler(self.transport)
        build = sampler.sample_ode if spec.method == "ode" else sampler.sample_sde
        return BuiltSampler(build(**spec.options()), sampler)

    def _steps(self, spec: SampleSpec, pixel_space: bool, scheduler: Any, device: Any) -> Steps:
        solver = flow_solver_name(spec.sampling_method) if spec.method == "ode" else None
        if scheduler is not None or solver is not None:  # diffusers' schedulers: loaded only here
            from ..transport.flow_solvers import (
                FlowSchedulerSteps,
                flow_scheduler,
                is_flow_scheduler,
            )
        if scheduler is not None:
            if not is_flow_scheduler(scheduler):
                raise SettingError("scheduler", type(scheduler).__name__,
                                   ": cannot sample a model trained with the sit objective; use "
                                   "FlowMatchEulerDiscreteScheduler, a multistep scheduler with "
                                   "use_flow_sigmas=True and prediction_type='flow_prediction', "
                                   "or the SiTScheduler")
            return FlowSchedulerSteps(Sampler(self.transport), scheduler, spec.num_steps, device,
                                      spec.time_shift)
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
