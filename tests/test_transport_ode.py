"""ODE sampling against the Gaussian closed form, reverse integration, method names and NFE counts."""

import re
import warnings

import pytest
import torch
from torchdiffeq import odeint

from sit_vit5.names import ODE_STEP_NFE as FIXED_STEP_NFE
from sit_vit5.transport import PATHS, PREDICTIONS, Sampler, create_transport
from sit_vit5.transport.integrators import ADAPTIVE_METHODS, FIXED_STEP_METHODS, is_adaptive, ode_method
from tests.gaussian_target import GaussianTarget
from tests.helpers import naming

F64 = torch.float64
M = torch.tensor([0.8, -0.4], dtype=F64)
S = torch.tensor([0.6, 1.3], dtype=F64)
# (grid points, extra kwargs, max per-sample error vs the exact flow, max |std/s - 1|); measured errors are
# ~6.5e-2 / 1.4e-2 (euler), 6.5e-3 / 2.5e-3 (heun2), 5e-5 / 1e-4 (dopri5)
METHODS = {
    "euler": (101, {}, 0.1, 0.02),
    "heun2": (26, {}, 0.01, 0.005),
    "dopri5": (5, dict(atol=1e-6, rtol=1e-5), 2e-4, 0.005),
}




def standard_noise(n: int = 4096, dims: int = 2, seed: int = 0) -> torch.Tensor:
    """N(0, I) draws standardised to exactly mean 0 / std 1 per dim, so mean/std checks see the solver only."""
    z = torch.randn(n, dims, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return (z - z.mean(0)) / z.std(0)


def quiet_ode(sampler: Sampler, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sampler.sample_ode(**kwargs)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("prediction", list(PREDICTIONS))
@pytest.mark.parametrize("path_type", list(PATHS))
def test_ode_samples_gaussian(path_type, prediction, method):
    steps, kwargs, flow_tol, std_tol = METHODS[method]
    tr = create_transport(path_type, prediction)
    target = GaussianTarget(tr.path_sampler, M, S)
    sampler = Sampler(tr)
    z = standard_noise()
    xs = quiet_ode(sampler, sampling_method=method, num_steps=steps, **kwargs)(z, target.model(prediction))
    assert xs.shape == (steps, *z.shape) and torch.equal(xs[0], z)
    x = xs[-1]
    assert (x.mean(0) - M).abs().max().item() < 0.01  # eps ends (and VP's alpha_0 = 0.0066) shift it by < 4e-3
    assert (x.std(0) / S - 1).abs().max().item() < std_tol
    t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, eval=True)
    assert (x - target.flow(z, t0, t1)).abs().max().item() < flow_tol


@pytest.mark.parametrize("path_type", list(PATHS))
def test_reverse_ode_maps_data_back_to_noise(path_type):
    tr = create_transport(path_type)
    target = GaussianTarget(tr.path_sampler, M, S)
    sampler = Sampler(tr)
    z = standard_noise(256)
    t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, eval=True)
    x = target.flow(z, t0, t1)  # exact data for these noises
    back = quiet_ode(sampler, num_steps=3, atol=1e-8, rtol=1e-8, reverse=True)(x, target.model("velocity"))
    assert torch.equal(back[0], x)
    torch.testing.assert_close(back[-1], z, atol=1e-5, rtol=0)
    fwd = quiet_ode(sampler, num_steps=3, atol=1e-8, rtol=1e-8)(back[-1], target.model("velocity"))
    torch.testing.assert_close(fwd[-1], x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method, per_step", [("euler", 1), ("midpoint", 2), ("heun2", 2), ("heun3", 3), ("rk4", 4)])
def test_fixed_step_nfe(method, per_step):
    calls = []

    def model(x, t):
        calls.append(t)
        assert t.shape == (len(x),) and t.dtype == x.dtype
        return -x

    sampler = Sampler(create_transport())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fixed-step methods do not warn
        fn = sampler.sample_ode(sampling_method=method, num_steps=7)
    fn(torch.randn(3, 2), model)
    assert sampler.last_nfe == len(calls) == 6 * per_step


def test_adaptive_nfe_counts_actual_calls_and_warns_about_num_steps():
    sampler = Sampler(create_transport("GVP"))
    with pytest.warns(UserWarning, match=naming("dopri5", "num_steps=10")):
        fn = sampler.sample_ode(sampling_method="dopri5", num_steps=10)
    calls = []
    fn(torch.randn(8, 2), lambda x, t: calls.append(1) or -x)
    assert sampler.last_nfe == len(calls) > 10


def test_euler_ode_is_the_plain_euler_recursion():
    """An independent check of the grid and step: x_{k+1} = x_k + h v(x_k, t_k) on linspace(0, 1, N)."""
    tr = create_transport("GVP")
    field = lambda x, t: torch.sin(3 * x) * t[:, None] - x  # noqa: E731
    z = torch.randn(5, 3, dtype=F64)
    out = Sampler(tr).sample_ode(sampling_method="euler", num_steps=11)(z, field)
    x, h = z, 0.1
    for k in range(10):
        x = x + h * field(x, torch.full((5,), k * h, dtype=F64))
    torch.testing.assert_close(out[-1], x)


def test_method_names_alias_and_errors():
    sampler = Sampler(create_transport())
    z = torch.randn(4, 2, dtype=F64)
    field = lambda x, t: -x * t[:, None]  # noqa: E731
    a = sampler.sample_ode(sampling_method="heun", num_steps=5)(z, field)
    b = sampler.sample_ode(sampling_method="heun2", num_steps=5)(z, field)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=naming("ODE", "sampling_method", "'heun5'", "'dopri5'", "'heun2'", "'rk4'")):
        sampler.sample_ode(sampling_method="heun5")


def test_learn_sigma_output_and_model_kwargs():
    sampler = Sampler(create_transport())
    z = torch.randn(4, 3, 2, 2)

    def model(x, t, y, scale):
        v = -x * scale + y.view(-1, 1, 1, 1)
        return torch.cat([v, torch.full_like(v, 1e6)], dim=1)  # learn-sigma: second half must be ignored

    fn = sampler.sample_ode(sampling_method="euler", num_steps=4)
    out = fn(z, model, generator=0, y=torch.arange(4.0), scale=2.0)  # generator is not passed to the model
    ref = fn(z, lambda x, t: -x * 2.0 + torch.arange(4.0).view(-1, 1, 1, 1))
    assert torch.equal(out, ref)


def _odeint_nfe(method: str, grid_points: int) -> int:
    """Evaluations torchdiffeq's public ``odeint`` makes for dy/dt = -y on a grid of ``grid_points``."""
    calls = []

    def f(t, y):
        calls.append(t)
        return -y

    grid = torch.linspace(0, 1, grid_points, dtype=torch.float64)
    odeint(f, torch.ones(3, dtype=torch.float64), grid, method=method, atol=1e-6, rtol=1e-6)
    return len(calls)


@pytest.mark.parametrize("method", [*FIXED_STEP_METHODS, *ADAPTIVE_METHODS])
def test_method_tables_match_torchdiffeq_behaviour(method):
    """Fixed-step methods step on the output grid (RK: exactly FIXED_STEP_NFE per interval); adaptive
    ones choose their steps, so a finer output grid costs no extra evaluations."""
    coarse, fine = _odeint_nfe(method, 3), _odeint_nfe(method, 41)
    assert is_adaptive(method) == (method in ADAPTIVE_METHODS)
    if method in ADAPTIVE_METHODS:
        assert fine == coarse
    else:
        assert fine > 4 * coarse  # 20x the intervals; Adams start-up steps blur the exact ratio
    if method in FIXED_STEP_NFE:
        assert (coarse, fine) == (2 * FIXED_STEP_NFE[method], 40 * FIXED_STEP_NFE[method])


def test_method_tables_cover_torchdiffeq():
    """Every method torchdiffeq accepts (as its public error message lists them) is in one table."""
    with pytest.raises(ValueError, match=naming('"rk45"')) as err:
        odeint(lambda t, y: -y, torch.ones(1), torch.linspace(0, 1, 3), method="rk45")
    listed = set(re.findall(r'"(\w+)"', str(err.value))) - {"rk45"}
    # not offered: scipy_solver (scipy's solvers, on the CPU) and explicit_adams (it does not
    # converge: tests/test_solver_order.py)
    assert listed - {"scipy_solver", "explicit_adams"} == set(FIXED_STEP_METHODS) | set(ADAPTIVE_METHODS)
    with pytest.raises(ValueError, match="rk45"):
        ode_method("rk45")
