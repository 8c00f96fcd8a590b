"""diffusers' multistep flow solvers (UniPC, DPM-Solver++ 2M / 3M, DEIS with use_flow_sigmas) drive a
sit-objective model through ``Objective.steps``: the same numbers as diffusers' own loop, converging on the
Gaussian closed form (so the flow's sign is right), and clear refusals (issue 39's groundwork); the ones
offered as ``--sampling-method`` (unipc, dpm++2m, dpm++3m) are those schedulers exactly."""

import pytest
import torch
from diffusers import (
    DDPMScheduler,
    DEISMultistepScheduler,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from sit_vit5.errors import SettingError
from sit_vit5.names import FLOW_SOLVERS
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.sampling import SamplingPipeline
from sit_vit5.transport.sampler import shift_times
from tests.gaussian_target import GaussianTarget

F64 = torch.float64
FLOW = dict(use_flow_sigmas=True, prediction_type="flow_prediction")
SCHEDULERS = {
    "UniPC": lambda: UniPCMultistepScheduler(**FLOW),
    "DPM-Solver++ 2M": lambda: DPMSolverMultistepScheduler(**FLOW, algorithm_type="dpmsolver++",
                                                           solver_order=2),
    "DPM-Solver++ 3M": lambda: DPMSolverMultistepScheduler(**FLOW, algorithm_type="dpmsolver++",
                                                           solver_order=3),
    "DEIS": lambda: DEISMultistepScheduler(**FLOW),
    "FlowMatch Euler": FlowMatchEulerDiscreteScheduler,
}
OBJECTIVE = create_objective({"path_type": "Linear", "prediction": "velocity"})
TARGET = GaussianTarget(OBJECTIVE.transport.path_sampler, torch.tensor([0.8, -0.4], dtype=F64),
                        torch.tensor([0.6, 1.3], dtype=F64))
Z = torch.randn(128, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
LABELS = torch.zeros(len(Z), dtype=torch.long)


def velocity(x, t, y):
    """The exact velocity of the Gaussian target, as a model ``(x, t, y)``."""
    return TARGET.velocity(x, t.to(x.dtype))


def ours(make, num_steps: int) -> torch.Tensor:
    steps = OBJECTIVE.steps(SampleSpec(method="ode", sampling_method="euler", num_steps=num_steps),
                            scheduler=make())
    return SamplingPipeline.denoise(Z.clone(), LABELS, [], steps, velocity)


@pytest.mark.parametrize("name", [n for n in SCHEDULERS if n != "FlowMatch Euler"])
def test_our_interface_is_diffusers_own_loop(name):
    scheduler = SCHEDULERS[name]()
    scheduler.set_timesteps(8)
    x = Z.clone()
    for t in scheduler.timesteps:  # diffusers' loop: sigma = t / 1000 = 1 - our t, flow = -velocity
        x = scheduler.step(-velocity(x, (1 - t / 1000).expand(len(x)), LABELS), t, x).prev_sample
    assert torch.equal(ours(SCHEDULERS[name], 9), x)  # 9 grid points = 8 steps, 8 evaluations


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_flow_schedulers_converge_to_the_exact_flow(name):
    exact = TARGET.flow(Z, 0.0, 1.0)
    errors = [float((ours(SCHEDULERS[name], n).double() - exact).abs().max()) for n in (9, 33)]
    assert errors[1] < errors[0] / 2 and errors[1] < 0.2, errors  # a wrong sign would diverge


def test_what_cannot_run_is_refused_naming_the_setting():
    spec = SampleSpec(method="ode", sampling_method="euler", num_steps=9)
    for scheduler in (DDPMScheduler(), UniPCMultistepScheduler()):  # epsilon prediction: not a flow
        with pytest.raises(SettingError) as err:
            OBJECTIVE.steps(spec, scheduler=scheduler)
        assert (err.value.key, err.value.value) == ("scheduler", type(scheduler).__name__)
    shifted = SampleSpec(method="ode", sampling_method="euler", num_steps=9, time_shift=3.0)
    with pytest.raises(SettingError) as err:  # their own flow_shift spaces their sigmas
        OBJECTIVE.steps(shifted, scheduler=UniPCMultistepScheduler(**FLOW))
    assert err.value.key == "time_shift"
    assert len(OBJECTIVE.steps(shifted, scheduler=FlowMatchEulerDiscreteScheduler()).timesteps) == 8


#: the flow solvers offered as ``--sampling-method`` -> the scheduler above made by hand
BY_NAME = {"unipc": "UniPC", "dpm++2m": "DPM-Solver++ 2M", "dpm++3m": "DPM-Solver++ 3M"}


def test_the_offered_flow_solvers_are_the_schedulers_made_by_hand():
    assert set(BY_NAME) == set(FLOW_SOLVERS)  # a new entry needs its hand-made twin here
    for name, label in BY_NAME.items():
        spec = SampleSpec(method="ode", sampling_method=name, num_steps=9)
        built = OBJECTIVE.sampler(spec)
        whole = built.sample(Z.clone(), velocity, y=LABELS)
        assert whole.shape == (9, *Z.shape) and torch.equal(whole[0], Z)
        assert built.sampler.last_nfe == spec.nfe == 8
        expected = ours(SCHEDULERS[label], 9)  # diffusers' scheduler swapped in by hand
        assert torch.equal(whole[-1], expected), name
        steps = OBJECTIVE.steps(spec)  # step by step without a scheduler argument: the same
        assert torch.equal(SamplingPipeline.denoise(Z.clone(), LABELS, [], steps, velocity), expected)


def test_the_time_shift_of_a_flow_solver_is_its_flow_shift_sd3s_formula():
    shifted = SampleSpec(method="ode", sampling_method="unipc", num_steps=9, time_shift=3.0)
    by_hand = ours(lambda: UniPCMultistepScheduler(**FLOW, flow_shift=3.0), 9)
    built = OBJECTIVE.sampler(shifted)
    assert torch.equal(built.sample(Z.clone(), velocity, y=LABELS)[-1], by_hand)
    assert not torch.equal(by_hand, ours(SCHEDULERS["UniPC"], 9))
    plain, three = UniPCMultistepScheduler(**FLOW), UniPCMultistepScheduler(**FLOW, flow_shift=3.0)
    plain.set_timesteps(8)
    three.set_timesteps(8)
    t = 1 - plain.sigmas.double()  # our t of the unshifted sigmas
    assert torch.allclose(1 - shift_times(t, 3.0), three.sigmas.double(), atol=1e-6)


@pytest.mark.parametrize("num_steps, shift", [(1000, None), (1001, None), (400, 3.0)])
def test_step_counts_whose_integer_timesteps_repeat_are_refused(num_steps, shift):
    """diffusers rounds sigma x 1000 to integer timesteps; repeated ones misplace the first step
    (UniPC at 999 steps fails on its last one), so they are refused before sampling."""
    spec = SampleSpec(method="ode", sampling_method="unipc", num_steps=num_steps, time_shift=shift)
    with pytest.raises(SettingError) as err:
        OBJECTIVE.sampler(spec)
    assert (err.value.key, err.value.value) == ("num_steps", num_steps)
    with pytest.raises(SettingError):  # the same scheduler swapped in by hand
        OBJECTIVE.steps(SampleSpec(method="ode", sampling_method="euler", num_steps=num_steps),
                        scheduler=UniPCMultistepScheduler(**FLOW, flow_shift=shift or 1.0))
    fine = SampleSpec(method="ode", sampling_method="unipc", num_steps=999, time_shift=None)
    assert len(OBJECTIVE.steps(fine).timesteps) == 998
