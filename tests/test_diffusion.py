"""DiT's Gaussian diffusion against closed forms: schedule, q moments, Bayes posterior, VLB of an oracle,
the discretised decoder likelihood, respacing, samplers on 1-D Gaussian data, per-sample seeding."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import integrate

from sit_vit5.diffusion import (
    create_diffusion,
    discretized_gaussian_log_likelihood,
    named_betas,
    space_timesteps,
)
from tests.helpers import naming

DATA_MEAN, DATA_STD = 0.5, 0.3


def test_linear_betas_are_ddpm_scaled_by_step_count():
    betas = named_betas("linear", 1000)
    assert betas.dtype == torch.float64 and len(betas) == 1000
    assert betas[0].item() == pytest.approx(1e-4, abs=1e-15) and betas[-1].item() == pytest.approx(
        0.02, abs=1e-15
    )
    half = named_betas("linear", 500)  # DiT scales both ends by 1000 / T
    assert half[0].item() == pytest.approx(2e-4) and half[-1].item() == pytest.approx(0.04)
    assert torch.allclose(
        betas.diff(), torch.full((999,), (0.02 - 1e-4) / 999, dtype=torch.float64)
    )


def test_q_moments_follow_the_markov_chain():
    d = create_diffusion("", learn_sigma=False)
    x0 = torch.tensor([[-1.3], [0.2], [2.0]], dtype=torch.float64)
    # independent recursion: x_t = sqrt(1 - beta_t) x_{t-1} + sqrt(beta_t) z
    mean, var = x0.clone(), torch.zeros_like(x0)
    for step, beta in enumerate(d.betas.tolist()):
        mean, var = math.sqrt(1 - beta) * mean, (1 - beta) * var + beta
        if step in (0, 10, 500, 999):
            t = torch.full((3,), step)
            q_mean, q_var, q_log_var = d.q_mean_variance(x0, t)
            assert torch.allclose(q_mean, mean, rtol=1e-10) and torch.allclose(
                q_var, var, rtol=1e-10
            )
            assert torch.allclose(q_log_var, var.log(), rtol=1e-10)
    # q_sample draws from those moments
    x0 = torch.full((20000, 1), 0.7, dtype=torch.float64)
    t = torch.full((20000,), 300)
    xt = d.q_sample(x0, t, generator=0)
    ab = d.alphas_cumprod[300].item()
    assert xt.mean().item() == pytest.approx(math.sqrt(ab) * 0.7, abs=0.02)
    assert xt.std().item() == pytest.approx(math.sqrt(1 - ab), rel=0.02)


def test_posterior_is_the_bayes_product_of_gaussians():
    d = create_diffusion("", learn_sigma=False)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    xt = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    t = torch.tensor([1, 2, 50, 400, 998, 999])
    mean, var, log_var = d.q_posterior_mean_variance(x0, xt, t)
    for row, step in enumerate(t.tolist()):
        beta = d.betas[step].item()
        ab_prev = d.alphas_cumprod[step - 1].item()
        # likelihood q(x_t | x_{t-1}) = N(sqrt(1 - beta) x_{t-1}, beta);
        # prior q(x_{t-1} | x_0) = N(sqrt(ab') x0, 1 - ab')
        precision = (1 - beta) / beta + 1 / (1 - ab_prev)
        bayes_mean = (
            math.sqrt(1 - beta) * xt[row] / beta + math.sqrt(ab_prev) * x0[row] / (1 - ab_prev)
        ) / precision
        assert torch.allclose(mean[row], bayes_mean, rtol=1e-9, atol=1e-12)
        assert var[row].item() == pytest.approx(1 / precision, rel=1e-9)
        assert log_var[row].item() == pytest.approx(math.log(1 / precision), rel=1e-9)
    # t = 0: q(x_{-1} | x_0, x_1) is a point mass at x_0 (variance 0; the log is clipped to beta~_1)
    mean0, var0, log_var0 = d.q_posterior_mean_variance(x0, xt, torch.zeros(6, dtype=torch.long))
    assert torch.allclose(mean0, x0) and var0.abs().max().item() < 1e-15
    assert log_var0[0].item() == pytest.approx(d.posterior_variance[1].log().item())


def _std_normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _oracle(d, x0: torch.Tensor, v: float = -1.0):
    """The model that knows x_0: exact noise, variance channel v (-1 = beta~_t, the true posterior variance)."""

    def model(x, t_model):
        ab = d.alphas_cumprod[t_model].reshape(-1, *([1] * (x.dim() - 1)))
        eps = (x - ab.sqrt() * x0) / (1 - ab).sqrt()
        return torch.cat([eps, torch.full_like(eps, v)], dim=1)

    return model


def test_vlb_of_a_perfect_model_is_prior_plus_decoder():
    d = create_diffusion("", diffusion_steps=100)
    x0 = torch.tensor([[-1.0, -0.2], [1.0, 0.5]], dtype=torch.float64)
    x0 = torch.round((x0 + 1) * 127.5) / 127.5 - 1  # on the 8-bit grid
    bpd = d.calc_bpd_loop(_oracle(d, x0), x0, generator=0)
    # every KL term with the exact posterior mean and variance vanishes
    assert bpd["vb"][:, 1:].abs().max().item() < 1e-9
    # prior: KL(N(sqrt(ab) x0, 1 - ab) || N(0, 1)) per dim, in bits
    ab = d.alphas_cumprod[-1].item()
    prior = (0.5 * (ab * x0**2 + (1 - ab) - 1 - math.log(1 - ab))).mean(1) / math.log(2)
    assert torch.allclose(bpd["prior_bpd"], prior, rtol=1e-9)
    # decoder: mean = x0 exactly (t = 0 coefficients 1, 0), std = sqrt(beta~_1); bins of half-width 1/255
    sigma = math.sqrt(d.posterior_variance[1].item())
    h = 1 / 255
    expected = []
    for row in x0.tolist():
        nll = []
        for x in row:
            if x < -0.999 or x > 0.999:
                nll.append(-math.log(_std_normal_cdf(h / sigma)))
            else:
                nll.append(-math.log(_std_normal_cdf(h / sigma) - _std_normal_cdf(-h / sigma)))
        expected.append(sum(nll) / len(nll) / math.log(2))
    assert bpd["vb"][:, 0].tolist() == pytest.approx(expected, rel=2e-3)  # tanh CDF approximation
    assert torch.allclose(bpd["total_bpd"], bpd["prior_bpd"] + bpd["vb"][:, 0], atol=1e-9)


def test_discretized_gaussian_loglik_matches_numerical_integral():
    grid = torch.linspace(-1, 1, 256, dtype=torch.float64)
    x = grid[[0, 1, 40, 128, 200, 254, 255]]
    means = torch.tensor([-0.9, -0.95, -0.7, 0.1, 0.5, 0.95, 0.8], dtype=torch.float64)
    log_scales = torch.log(
        torch.tensor([0.05, 0.02, 0.3, 0.05, 0.2, 0.1, 0.1], dtype=torch.float64)
    )
    logp = discretized_gaussian_log_likelihood(x, means=means, log_scales=log_scales)
    for xi, mu, sd, lp in zip(x.tolist(), means.tolist(), log_scales.exp().tolist(), logp.tolist()):
        lo = -math.inf if xi < -0.999 else xi - 1 / 255
        hi = math.inf if xi > 0.999 else xi + 1 / 255
        def pdf(u, mu=mu, sd=sd):
            return math.exp(-0.5 * ((u - mu) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))

        mass = integrate.quad(
            pdf,
            lo,
            hi,
            points=None if math.isinf(lo) or math.isinf(hi) else [mu],
            epsabs=1e-13,
            epsrel=1e-11,
        )[0]
        assert lp == pytest.approx(math.log(mass), abs=1e-3, rel=3e-3)
    # the 256 bins tile the real line: probabilities sum to one for any Gaussian
    for mu, sd in ((0.3, 0.05), (-0.99, 0.5), (2.0, 0.4)):
        p = discretized_gaussian_log_likelihood(
            grid, means=torch.full_like(grid, mu), log_scales=torch.full_like(grid, math.log(sd))
        ).exp()
        assert p.sum().item() == pytest.approx(1.0, abs=1e-9)


def test_space_timesteps_sections_and_ddim_strides():
    assert space_timesteps(10, "4") == [0, 3, 6, 9]
    assert space_timesteps(10, "2,3") == [0, 4, 5, 7, 9]  # sections [0..4] and [5..9]
    assert space_timesteps(10, [2, 3]) == [0, 4, 5, 7, 9]
    assert space_timesteps(11, "1,1") == [0, 6]  # the first section gets the extra step
    assert space_timesteps(10, "ddim3") == [0, 4, 8]
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    steps = space_timesteps(1000, "250")
    assert len(steps) == 250 and steps[0] == 0 and steps[-1] == 999
    assert all(3 <= b - a <= 5 for a, b in zip(steps, steps[1:]))
    assert space_timesteps(1000, "1000") == list(range(1000))
    for bad in ("ddim7", "abc", "5,x"):
        with pytest.raises(ValueError, match="timestep_respacing"):
            space_timesteps(10, bad)
    with pytest.raises(ValueError, match=naming("timestep_respacing", "5", "6")):
        space_timesteps(10, "6,1")


@pytest.mark.parametrize("respacing", ["250", "ddim50", "10,20,30", "7"])
def test_respacing_keeps_alpha_bar_and_feeds_original_steps(respacing):
    base = create_diffusion("")
    spaced = create_diffusion(respacing)
    keep = space_timesteps(1000, respacing)
    assert spaced.num_timesteps == len(keep) and spaced.timestep_map == keep
    assert torch.allclose(spaced.alphas_cumprod, base.alphas_cumprod[keep], rtol=1e-12)
    seen = []

    def model(x, t):
        seen.append(t.clone())
        assert t.dtype == torch.long
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])

    spaced.p_sample_loop(model, (2, 1, 2, 2), generator=0)
    assert spaced.last_nfe == len(keep)
    assert [int(t[0]) for t in seen] == keep[::-1]  # noise (largest original step) first
    t = torch.tensor([0, len(keep) - 1])
    spaced.training_losses(model, torch.zeros(2, 1, 2, 2), t)
    assert seen[-1].tolist() == [keep[0], keep[-1]]


def _gaussian_eps_model(base, learned_v: float | None):
    """Exact E[eps | x_t] for 1-D data N(m, s^2): sqrt(1 - ab) (x - sqrt(ab) m) / (ab s^2 + 1 - ab)."""

    def model(x, t_model):
        ab = base.alphas_cumprod[t_model].reshape(-1, 1).to(x)
        eps = (1 - ab).sqrt() * (x - ab.sqrt() * DATA_MEAN) / (ab * DATA_STD**2 + 1 - ab)
        return (
            eps if learned_v is None else torch.cat([eps, torch.full_like(eps, learned_v)], dim=1)
        )

    return model


@pytest.mark.parametrize(
    "respacing, learn_sigma, v, sampler",
    [
        ("", False, None, "ddpm"),
        ("250", True, 1.0, "ddpm"),
        ("250", True, 0.0, "ddpm"),
        ("ddim250", True, 0.0, "ddim"),
    ],
)
def test_samplers_recover_gaussian_data_with_exact_eps(respacing, learn_sigma, v, sampler):
    base = create_diffusion("", learn_sigma=False)
    d = create_diffusion(respacing, learn_sigma=learn_sigma)
    model = _gaussian_eps_model(base, v)
    n = 8000
    z = torch.randn(n, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if sampler == "ddpm":
        x = d.p_sample_loop(model, (n, 1), noise=z, generator=4)
    else:
        x = d.ddim_sample_loop(model, (n, 1), noise=z)
    assert x.mean().item() == pytest.approx(DATA_MEAN, abs=0.015)
    assert x.std().item() == pytest.approx(DATA_STD, abs=0.012)


def test_ddim_eta0_is_deterministic_and_ddpm_is_seeded_per_sample():
    d = create_diffusion("ddim20")
    base = create_diffusion("", learn_sigma=False)
    model = _gaussian_eps_model(base, 0.3)
    z = torch.randn(4, 1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        d.ddim_sample_loop(model, (4, 1), noise=z), d.ddim_sample_loop(model, (4, 1), noise=z)
    )
    seeds = [11, 12, 13, 14]
    for loop, kwargs in ((d.p_sample_loop, {}), (d.ddim_sample_loop, {"eta": 1.0})):
        batch = loop(model, (4, 1), generator=seeds, **kwargs)
        alone = loop(model, (1, 1), generator=[seeds[2]], **kwargs)
        assert torch.equal(
            batch[2:3], alone
        )  # initial noise and every step's noise come from row 2's seed
        other = loop(model, (4, 1), generator=[11, 12, 99, 14], **kwargs)
        assert torch.equal(other[[0, 1, 3]], batch[[0, 1, 3]]) and not torch.equal(
            other[2], batch[2]
        )


def test_training_losses_hybrid_with_stop_gradient_on_the_mean():
    d = create_diffusion("")
    x0 = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0, 10, 999])
    weight = torch.zeros(1, 4, 1, 1, requires_grad=True)

    def model(x, t_model):
        return x.repeat(1, 2, 1, 1) * (1 + weight)

    terms = d.training_losses(model, x0, t, noise=noise)
    xt = d.q_sample(x0, t, noise)
    assert torch.allclose(terms["mse"], ((noise - xt) ** 2).mean(dim=(1, 2, 3)))
    assert set(terms) == {"loss", "mse", "vb", "pred"}
    assert torch.allclose(terms["loss"], terms["mse"] + terms["vb"])
    # vb reaches only the variance channels; mse only the mean channels
    (grad_vb,) = torch.autograd.grad(terms["vb"].sum(), weight, retain_graph=True)
    assert grad_vb[0, :2].abs().max().item() == 0 and grad_vb[0, 2:].abs().max().item() > 0
    (grad_mse,) = torch.autograd.grad(terms["mse"].sum(), weight)
    assert grad_mse[0, 2:].abs().max().item() == 0 and grad_mse[0, :2].abs().max().item() > 0
    # vb equals the VLB term of the same output, computed on its own
    frozen = terms["pred"].detach()
    ref = d.vb_terms_bpd(lambda x, tt: frozen, x0, xt, t)["output"]
    assert torch.allclose(terms["vb"], ref)


def test_learned_sigma_needs_two_c_outputs_and_fixed_needs_c():
    x0 = torch.zeros(2, 3, 4, 4)
    t = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="learn_sigma=True"):
        create_diffusion("").training_losses(lambda x, tt: x, x0, t)
    with pytest.raises(ValueError, match=naming("(2, 6, 4, 4)", "(2, 3, 4, 4)", "learn_sigma=True")):
        create_diffusion("", learn_sigma=False).training_losses(
            lambda x, tt: x.repeat(1, 2, 1, 1), x0, t
        )
    terms = create_diffusion("", learn_sigma=False).training_losses(lambda x, tt: x, x0, t)
    assert set(terms) == {"loss", "mse", "pred"} and torch.equal(terms["loss"], terms["mse"])
    with pytest.raises(ValueError, match="noise_schedule"):
        create_diffusion("", noise_schedule="quadratic")


def test_sample_timesteps_cover_the_range_and_follow_seeds():
    d = create_diffusion("", diffusion_steps=50)
    t = d.sample_timesteps(5000, generator=0)
    assert t.dtype == torch.long and t.min().item() == 0 and t.max().item() == 49
    with pytest.raises(ValueError, match=naming("'linear'", "diffusion_steps=10", "2")):
        create_diffusion("", diffusion_steps=10)
    assert torch.equal(
        d.sample_timesteps(3, generator=[5, 6, 7])[1:2], d.sample_timesteps(1, generator=[6])
    )
