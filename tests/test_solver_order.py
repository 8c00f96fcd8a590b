"""Fixed-step ODE solvers converge at their order on the exact Gaussian velocity, on uniform and on
SD3-shifted time grids; the shift is the closed form on sigma = 1 - t; a shift <= 0 is one clear line
(issue 39's correctness groundwork)."""

import math
import warnings

import pytest
import torch

import sample
from sit_vit5.errors import SettingError
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.transport import create_transport
from sit_vit5.transport.sampler import Sampler, shift_times
from tests.gaussian_target import GaussianTarget
from tests.helpers import one_sample_error

F64 = torch.float64
ORDERS = {"euler": 1, "midpoint": 2, "heun2": 2, "rk4": 4}
#: step counts per solver: fine enough to be in the asymptotic range, coarse enough to stay above
#: float64 rounding (rk4's error falls 16x per doubling)
STEPS = {"euler": (16, 32, 64), "midpoint": (8, 16, 32), "heun2": (8, 16, 32), "rk4": (8, 16, 32)}


def error(method: str, steps: int, shift: float | None) -> float:
    """Max |x_1 - flow(z)| of the Linear / velocity ODE on a 2-D Gaussian after ``steps`` steps."""
    objective = create_objective({"path_type": "Linear", "prediction": "velocity"})
    target = GaussianTarget(objective.transport.path_sampler, torch.tensor([0.8, -0.4], dtype=F64),
                            torch.tensor([0.6, 1.3], dtype=F64))
    z = torch.randn(64, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    spec = SampleSpec(method="ode", sampling_method=method, num_steps=steps + 1, time_shift=shift)
    x = objective.sampler(spec).sample(z, target.model("velocity"))[-1]
    return float((x - target.flow(z, 0.0, 1.0)).abs().max())


@pytest.mark.parametrize("shift", [None, 3.0])
@pytest.mark.parametrize("method", list(ORDERS))
def test_fixed_step_solvers_converge_at_their_order(method, shift):
    errors = [error(method, n, shift) for n in STEPS[method]]
    slopes = [math.log2(a / b) for a, b in zip(errors[:-1], errors[1:])]  # error ~ h^order
    # at least the solver's order (this linear field lets midpoint and rk4 gain one more at t = 1)
    assert all(s > ORDERS[method] - 0.35 for s in slopes), (errors, slopes)
    assert all(s < ORDERS[method] + 1.35 for s in slopes), (errors, slopes)


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
