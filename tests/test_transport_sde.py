"""SDE sampling: Gaussian marginals for every path x method x diffusion form, last steps, NFE, seeding,
and finiteness for every path x prediction x diffusion form (the official code NaNs on SBDM + Linear)."""

import warnings

import pytest
import torch

from sit_vit5.transport import DIFFUSION_FORMS, LAST_STEPS, PATHS, PREDICTIONS, Sampler, create_transport
from tests.gaussian_target import GaussianTarget
from tests.helpers import naming

F64 = torch.float64
M = torch.tensor([0.8, -0.4], dtype=F64)
S = torch.tensor([0.6, 1.3], dtype=F64)
LAST = [k for k in LAST_STEPS if k != "none"]




def marginal(tr, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of p_t for data N(M, S^2): (alpha M, sqrt(alpha^2 S^2 + sigma^2))."""
    tt = torch.tensor(t, dtype=F64)
    alpha, sigma = tr.path_sampler.compute_alpha_t(tt)[0], tr.path_sampler.compute_sigma_t(tt)[0]
    return alpha * M, (alpha**2 * S**2 + sigma**2).sqrt()


def noise(n: int, dims: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dims, dtype=F64, generator=torch.Generator().manual_seed(seed))


# Euler: every path x form; Heun (twice the cost): every form on GVP and SBDM on the other paths
SDE_CASES = [(p, "Euler", f) for p in PATHS for f in DIFFUSION_FORMS]
SDE_CASES += [("GVP", "Heun", f) for f in DIFFUSION_FORMS] + [(p, "Heun", "SBDM") for p in ("Linear", "VP")]


@pytest.mark.parametrize("path_type, method, form", SDE_CASES)
def test_sde_with_exact_score_samples_the_marginal(path_type, method, form):
    """No last step: the chain ends at t1 and must follow p_t1. N = 8192: standard errors 0.011 (mean / std)
    and 0.008 (std ratio); measured discretisation bias at 100 steps <= 0.01 / 0.014."""
    tr = create_transport(path_type, "score")
    target = GaussianTarget(tr.path_sampler, M, S)
    sampler = Sampler(tr)
    fn = sampler.sample_sde(sampling_method=method, diffusion_form=form, last_step=None, num_steps=100)
    x = fn(noise(8192), target.model("score"), generator=1)[-1]
    _, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, diffusion_form=form, sde=True, eval=True)
    mean, std = marginal(tr, t1)
    assert ((x.mean(0) - mean) / std).abs().max().item() < 0.05
    assert (x.std(0) / std - 1).abs().max().item() < 0.04
    assert sampler.last_nfe == 99 * (2 if method == "Heun" else 1)


@pytest.mark.parametrize("prediction", list(PREDICTIONS))
@pytest.mark.parametrize("path_type", ["Linear", "GVP"])
def test_default_sde_reaches_the_data(path_type, prediction):
    """SiT's defaults (Euler, SBDM, Mean last step of 0.04, 250 steps) from every prediction type."""
    tr = create_transport(path_type, prediction)
    sampler = Sampler(tr)
    x = sampler.sample_sde()(noise(4096), GaussianTarget(tr.path_sampler, M, S).model(prediction), generator=2)[-1]
    assert ((x.mean(0) - M) / S).abs().max().item() < 0.07  # standard error 0.016
    assert (x.std(0) / S - 1).abs().max().item() < 0.05  # standard error 0.011
    assert sampler.last_nfe == 250


@pytest.mark.parametrize("last_step", LAST)
@pytest.mark.parametrize("path_type", list(PATHS))
def test_last_step_formulas(path_type, last_step):
    """The last step from t1 = 1 - h, checked against its formula on the exact Gaussian fields."""
    tr = create_transport(path_type)
    target, sampler, h = GaussianTarget(tr.path_sampler, M, S), Sampler(tr), 0.05
    xs = sampler.sample_sde(last_step=last_step, last_step_size=h, num_steps=20)(
        noise(64), target.model("velocity"), generator=0
    )
    assert len(xs) == 20
    x, out = xs[-2], xs[-1]
    t1 = 1 - h if last_step is not None else 1 - max(tr.sample_eps, 1e-3)
    t = torch.full((64,), t1, dtype=F64)
    v, s = target.velocity(x, t), target.score(x, t)
    alpha, sigma = (
        c.item() for c in (tr.path_sampler.compute_alpha_t(t[:1])[0], tr.path_sampler.compute_sigma_t(t[:1])[0])
    )
    D = tr.path_sampler.compute_diffusion(x, t, form="SBDM")
    expected = {
        "Mean": x + (v + D * s) * h,
        "Euler": x + v * h,
        "Tweedie": M + alpha * S**2 / (alpha**2 * S**2 + sigma**2) * (x - alpha * M),  # E[x1 | x_t1]
        None: x,
    }[last_step]
    torch.testing.assert_close(out, expected)
    assert sampler.last_nfe == 19 + (last_step is not None)


def test_heun_nfe_and_none_alias():
    sampler = Sampler(create_transport())
    calls = []
    model = lambda x, t: calls.append(1) or -x  # noqa: E731
    sampler.sample_sde(sampling_method="Heun", num_steps=11)(noise(4), model)
    assert sampler.last_nfe == len(calls) == 2 * 10 + 1
    sampler.sample_sde(sampling_method="Heun", num_steps=11, last_step="none")(noise(4), model)
    assert sampler.last_nfe == 20


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(sampling_method="euler"), ("sampling_method", "'euler'", "'Euler'", "'Heun'")),
        (dict(diffusion_form="increasing_decreasing"),
         ("diffusion_form", "'increasing_decreasing'", "'increasing-decreasing'")),
        (dict(last_step="mean"), ("last_step", "'mean'", "'Mean'", "'Tweedie'", "'Euler'", "None")),
        (dict(num_steps=1), ("num_steps", ">= 2", "got 1")),
    ],
)
def test_bad_sde_options(kwargs, names):
    with pytest.raises(ValueError, match=naming(*names)):
        Sampler(create_transport()).sample_sde(**kwargs)


# ---------------------------------------------------------------------------- reproducibility


def small_field(dims: int = 3, seed: int = 0):
    """A random smooth field (B, dims), (B,) -> (B, dims): stands in for an untrained network."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(dims + 1, 16), torch.nn.Tanh(), torch.nn.Linear(16, dims)).double()
    for p in net.parameters():
        p.requires_grad_(False)
    return lambda x, t, **kw: net(torch.cat([x, t[:, None]], dim=1))


@pytest.mark.parametrize("method", ["Euler", "Heun"])
def test_seeded_sde_reproduces_exactly(method):
    fn = Sampler(create_transport("GVP")).sample_sde(sampling_method=method, num_steps=20)
    z, field = noise(6, 3), small_field()
    torch.manual_seed(1)
    a = fn(z, field, generator=5)[-1]
    torch.manual_seed(2)  # global RNG state must not matter
    state = torch.get_rng_state()
    b = fn(z, field, generator=torch.Generator().manual_seed(5))[-1]
    assert torch.equal(torch.get_rng_state(), state)  # and is not consumed
    c = fn(z, field, generator=6)[-1]
    assert torch.equal(a, b) and not torch.allclose(a, c)
    torch.manual_seed(3)
    d = fn(z, field)[-1]  # no generator: the global RNG, reproducible by seeding it
    torch.manual_seed(3)
    assert torch.equal(d, fn(z, field)[-1])


@pytest.mark.parametrize("method", ["Euler", "Heun"])
def test_per_row_generators_make_samples_independent_of_the_batch(method):
    fn = Sampler(create_transport("Linear")).sample_sde(sampling_method=method, num_steps=20)
    z = noise(5, 3)
    # row-wise field: a matmul is not bit-for-bit batch-invariant
    field = lambda x, t: torch.sin(3 * x) * t[:, None] - x  # noqa: E731
    full = fn(z, field, generator=[10, 11, 12, 13, 14])[-1]
    part = fn(z[[3, 1]], field, generator=[torch.Generator().manual_seed(13), 11])[-1]
    assert torch.equal(part, full[[3, 1]])
    single = fn(z, field, generator=10)[-1]
    assert not torch.allclose(single[1:], full[1:])
    with pytest.raises(ValueError, match=naming("generator", "3", "5")):
        fn(z, field, generator=[1, 2, 3])


# ---------------------------------------------------------------------------- finiteness


@pytest.mark.parametrize("prediction", list(PREDICTIONS))
@pytest.mark.parametrize("path_type", list(PATHS))
def test_every_sde_and_ode_configuration_is_finite(path_type, prediction):
    """Default eps with a random field: every diffusion form x SDE method x last step, and the ODE."""
    sampler = Sampler(create_transport(path_type, prediction))
    z, field = noise(16, 3), small_field(seed=1)
    for i, form in enumerate(DIFFUSION_FORMS):
        for method in ("Euler", "Heun"):
            last = LAST[i % len(LAST)]
            xs = sampler.sample_sde(sampling_method=method, diffusion_form=form, last_step=last, num_steps=20)(
                z, field, generator=0
            )
            assert all(torch.isfinite(x).all() for x in xs), (form, method, last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("euler", "heun2", "dopri5"):
            xs = sampler.sample_ode(sampling_method=method, num_steps=10, atol=1e-4, rtol=1e-3)(z, field)
            assert torch.isfinite(xs).all(), method
