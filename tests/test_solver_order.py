"""Fixed-step ODE solvers converge at their order on the exact Gaussian velocity, on uniform and on
SD3-shifted time grids; the shift is the closed form on sigma = 1 - t; a shift <= 0 is one clear line
(issue 39's correctness groundwork)."""

import math
import warnings

import pytest
import torch

import sample
from sit_vit5.errors import SettingError
from sit_vit5.names import ODE_ADAPTIVE_METHODS, ODE_EQUAL_STEP_METHODS, ODE_FIXED_STEP_METHODS, ODE_STEP_NFE
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.transport import create_transport
from sit_vit5.transport.sampler import Sampler, shift_times
from tests.gaussian_target import GaussianTarget
from tests.helpers import one_sample_error

F64 = torch.float64
ORDERS = {"euler": 1, "midpoint": 2, "heun2": 2, "heun3": 3, "rk4": 4, "implicit_adams": 4,
          "fixed_adams": 4}
#: step counts per solver: fine enough to be in the asymptotic range, coarse enough to stay above
#: float64 rounding (rk4's error falls 16x per doubling)
STEPS = {"euler": (16, 32, 64), "rk4": (8, 16, 32)}


OBJECTIVE = create_objective({"path_type": "Linear", "prediction": "velocity"})
TARGET = GaussianTarget(OBJECTIVE.transport.path_sampler, torch.tensor([0.8, -0.4], dtype=F64),
                        torch.tensor([0.6, 1.3], dtype=F64))
Z = torch.randn(64, 2, dtype=F64, generator=torch.Generator().manual_seed(0))


def spec_error(spec: SampleSpec) -> float:
    """Max |x_1 - flow(z)| of the Linear / velocity ODE on a 2-D Gaussian, sampled by ``spec``."""
    x = OBJECTIVE.sampler(spec).sample(Z, TARGET.model("velocity"))[-1]
    return float((x - TARGET.flow(Z, 0.0, 1.0)).abs().max())


def error(method: str, steps: int, shift: float | None) -> float:
    """:func:`spec_error` after ``steps`` steps of ``method`` on a grid shifted by ``shift``."""
    return spec_error(SampleSpec(method="ode", sampling_method=method, num_steps=steps + 1,
                                 time_shift=shift))


def slopes(errors: list[float]) -> list[float]:
    return [math.log2(a / b) for a, b in zip(errors[:-1], errors[1:])]  # error ~ h^order


@pytest.mark.parametrize("shift", [None, 3.0])
@pytest.mark.parametrize("method", list(ORDERS))
def test_fixed_step_solvers_converge_at_their_order(method, shift):
    assert set(ORDERS) == set(ODE_FIXED_STEP_METHODS)  # every one offered has its order here
    if shift is not None and method in ODE_EQUAL_STEP_METHODS:
        with pytest.raises(SettingError) as err:  # Adams coefficients assume equal steps
            SampleSpec(method="ode", sampling_method=method, time_shift=shift)
        assert err.value.key == "time_shift" and method in err.value.reason
        return
    rates = slopes([error(method, n, shift) for n in STEPS.get(method, (8, 16, 32))])
    # at least the solver's order; this linear field lets midpoint and rk4 gain one more at t = 1,
    # and Adams' start-up (rk4 steps) more still, so the Runge-Kutta ones are bounded above too
    assert all(s > ORDERS[method] - 0.35 for s in rates), rates
    if method in ODE_STEP_NFE:
        assert all(s < ORDERS[method] + 1.35 for s in rates), rates


def test_explicit_adams_is_not_offered_its_error_grows_with_the_steps():
    """torchdiffeq's explicit_adams (Adams-Bashforth up to high order, no corrector) on the same
    problem, run through torchdiffeq directly: more steps, more error. If this fails, torchdiffeq
    changed: measure again and offer it."""
    from torchdiffeq import odeint

    field = TARGET.model("velocity")
    errors = []
    for steps in (32, 64):
        grid = torch.linspace(0, 1, steps + 1, dtype=F64)
        x = odeint(lambda t, x: field(x, t.expand(len(x))), Z, grid, method="explicit_adams")[-1]
        errors.append(float((x - TARGET.flow(Z, 0.0, 1.0)).abs().max()))
    assert errors[1] > errors[0], errors
    with pytest.raises(SettingError) as err:
        SampleSpec(method="ode", sampling_method="explicit_adams")
    assert err.value.key == "sampling_method"


@pytest.mark.parametrize("method", ODE_ADAPTIVE_METHODS)
def test_adaptive_solvers_error_follows_the_tolerance(method):
    """Adaptive solvers have no step count to double: tightening atol = rtol 100x cuts the error
    by at least 20x, and at 1e-7 it is below 1e-6."""
    errors = [spec_error(SampleSpec(method="ode", sampling_method=method, num_steps=2, atol=tol,
                                    rtol=tol)) for tol in (1e-5, 1e-7)]
    assert errors[1] < errors[0] / 20 and errors[1] < 1e-6, errors


def test_the_shift_is_sd3s_formula_on_the_noise_level():
    t = torch.linspace(0, 1, 11, dtype=F64)
    for s in (0.5, 1.0, 3.0):
        sigma = 1 - shift_times(t, s)
        expected = s * (1 - t) / (1 + (s - 1) * (1 - t))
        assert torch.allclose(sigma, expected, atol=1e-15)
    assert shift_times(t, None) is t and shift_times(t, 1.0) is t  # uniform: the grid itself
    shifted = shift_times(t, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1 and (shifted.diff() > 0).all()
    assert (shifted[1:-1] < t[1:-1]).all()  # s > 1: every inner point moves towards the noise end


def test_every_transport_solver_honours_the_shift():
    tr = create_transport()
    sampler = Sampler(tr)
    grid = sampler.ode_grid(5, torch.empty(0, dtype=F64), time_shift=3.0)
    assert torch.allclose(grid, shift_times(torch.linspace(0, 1, 5, dtype=F64), 3.0))
    steps = create_objective({}).steps(SampleSpec(method="ode", sampling_method="euler", num_steps=5,
                                                  time_shift=3.0))
    assert torch.allclose(steps.timesteps.double(), grid[:-1], atol=1e-7)
    seen = []  # the SDE evaluates its drift at the shifted times too

    def model(x, t):
        seen.append(float(t[0]))
        return torch.zeros_like(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler.sample_sde(num_steps=5, time_shift=3.0, last_step=None,
                           diffusion_form="sigma")(torch.zeros(2, 2), model)
    t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, sde=True, eval=True,
                               diffusion_form="sigma")
    expected = shift_times(torch.linspace(t0, t1, 5, dtype=F64), 3.0)[:-1].tolist()
    assert seen == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("bad", [0.0, -2.0])
def test_a_shift_that_is_not_positive_is_one_line_and_writes_nothing(bad, tmp_path, capsys):
    with pytest.raises(SettingError) as err:
        SampleSpec(time_shift=bad)
    assert err.value.key == "time_shift" and err.value.value == bad
    with pytest.raises(SettingError) as err:  # integer steps have no noise level to shift
        SampleSpec(method="ddpm", time_shift=2.0)
    assert err.value.key == "time_shift"
    out, ckpt = tmp_path / "out", tmp_path / "model.pt"
    ckpt.write_bytes(b"not read: the flag is refused first")
    with pytest.raises(SystemExit) as exit_:  # refused while parsing, before torch and the checkpoint
        sample.main(["grid", "--ckpt", str(ckpt), "--time-shift", str(bad), "--out", str(out)])
    assert exit_.value.code == 2
    assert "--time-shift" in one_sample_error(capsys, "grid") and not out.exists()
