"""diffusers' multistep flow solvers (UniPC, DPM-Solver++ 2M / 3M, DEIS with use_flow_sigmas) drive a
sit-objective model through ``Objective.steps``: the same numbers as diffusers' own loop fed the exact
sigma, converging on the Gaussian closed form (so the flow's sign is right), and clear refusals (issue
39's groundwork). The ones offered as ``--sampling-method`` (unipc) are those schedulers exactly and
converge at their order; DPM-Solver++ is not offered, for the reason pinned below."""

import math

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
from sit_vit5.stepwise import denoise
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
    return denoise(steps, Z.clone(), velocity, y=LABELS)


@pytest.mark.parametrize("name", [n for n in SCHEDULERS if n != "FlowMatch Euler"])
def test_our_interface_is_diffusers_own_loop(name):
    scheduler = SCHEDULERS[name]()
    scheduler.set_timesteps(8)
    x = Z.clone()
    for sigma, t in zip(scheduler.sigmas, scheduler.timesteps):  # our t = 1 - sigma, flow = -velocity
        x = scheduler.step(-velocity(x, (1 - sigma).expand(len(x)), LABELS), t, x).prev_sample
    assert torch.equal(ours(SCHEDULERS[name], 9), x)  # 9 grid points = 8 steps, 8 evaluations


def max_error(make, steps: int, model_time=lambda sigma, t: 1 - sigma) -> float:
    """Max |x_1 - flow(z)| after diffusers' own loop of ``steps`` steps, the model fed
    ``model_time(sigma, timestep)``."""
    scheduler = make()
    scheduler.set_timesteps(steps)
    x = Z.clone()
    for sigma, t in zip(scheduler.sigmas, scheduler.timesteps):
        x = scheduler.step(-velocity(x, model_time(sigma, t).expand(len(x)), LABELS), t, x).prev_sample
    return float((x - TARGET.flow(Z, 0.0, 1.0)).abs().max())


def slopes(errors: list[float]) -> list[float]:
    return [math.log2(a / b) for a, b in zip(errors[:-1], errors[1:])]  # error ~ h^order


#: the order each offered flow solver must reach (a new FLOW_SOLVERS entry needs its order here)
ORDERS = {"unipc": 2}


@pytest.mark.parametrize("shift", [None, 3.0])
@pytest.mark.parametrize("name", list(ORDERS))
def test_offered_flow_solvers_converge_at_their_order(name, shift):
    assert set(ORDERS) == set(FLOW_SOLVERS)
    exact = TARGET.flow(Z, 0.0, 1.0)
    errors = []
    for steps in (8, 16, 32, 64, 128):
        spec = SampleSpec(method="ode", sampling_method=name, num_steps=steps + 1, time_shift=shift)
        x = OBJECTIVE.sampler(spec).sample(Z.clone(), velocity, y=LABELS)[-1]
        errors.append(float((x - exact).abs().max()))
    # the order over the whole range (multistep start-up makes single doublings uneven: 1.5-2.9
    # with shift 3), and no doubling that stalls the way an error floor does
    overall = math.log2(errors[0] / errors[-1]) / (len(errors) - 1)
    assert overall > ORDERS[name] - 0.2 and min(slopes(errors)) > 1.3, (errors, slopes(errors))


def test_the_rounded_integer_timestep_would_cost_unipc_its_order():
    """What diffusers' pipelines feed the model (1 - timestep / 1000, up to 5e-4 off) floors the
    error; the exact sigma, which our steps feed, does not."""
    rounded = [max_error(SCHEDULERS["UniPC"], n, lambda sigma, t: 1 - t / 1000) for n in (32, 64)]
    exact = [max_error(SCHEDULERS["UniPC"], n) for n in (32, 64)]
    assert slopes(rounded)[0] < 1.2 and slopes(exact)[0] > 1.65, (rounded, exact)


def test_dpm_solver_is_not_offered_it_starts_below_sigma_1_and_stops_converging():
    """diffusers 0.42's DPM-Solver++ flow sigmas start at 1 - 1/1000: given noise (sigma 1) its error
    stops falling near the 1e-3 offset; against the flow from t = 1e-3 it converges. If this fails,
    diffusers changed: measure again and offer it."""
    make = SCHEDULERS["DPM-Solver++ 3M"]
    scheduler = make()
    scheduler.set_timesteps(8)
    assert float(scheduler.sigmas[0]) == pytest.approx(0.999, abs=1e-6)
    errors = [max_error(make, n) for n in (32, 64, 128)]
    assert errors[-1] > 2e-3 and slopes(errors)[-1] < 1, errors
    assert not any(name.startswith("dpm") for name in FLOW_SOLVERS)


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
BY_NAME = {"unipc": "UniPC"}


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
        assert torch.equal(denoise(steps, Z.clone(), velocity, y=LABELS), expected)


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
