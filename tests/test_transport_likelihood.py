"""ODE likelihood against the Gaussian closed form; Hutchinson probes; bits/dim; seeding and NFE."""

import math
import warnings

import pytest
import torch

from sit_vit5.transport import PATHS, PREDICTIONS, Sampler, bits_per_dim, create_transport
from tests.gaussian_target import GaussianTarget
from tests.helpers import naming

F64 = torch.float64
M = torch.tensor([0.8, -0.4, 0.3], dtype=F64)
S = torch.tensor([0.6, 1.3, 0.9], dtype=F64)
Q = torch.linalg.qr(torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(0)))[0]
TIGHT = dict(num_steps=2, atol=1e-7, rtol=1e-7)




def likelihood_fn(sampler: Sampler, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dopri5's "num_steps is only the output grid"
        return sampler.sample_ode_likelihood(**kwargs)


def data(n: int, rotation=Q, seed: int = 1) -> torch.Tensor:
    """Draws of N(M, Q diag(S^2) Q^T)."""
    e = torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(seed)) * S
    return M + (e if rotation is None else e @ rotation.T)


def true_log_prob(x: torch.Tensor, rotation=Q) -> torch.Tensor:
    """log N(x; M, Q diag(S^2) Q^T) by torch.distributions (independent of the library)."""
    cov = torch.diag(S**2) if rotation is None else rotation @ torch.diag(S**2) @ rotation.T
    return torch.distributions.MultivariateNormal(M, covariance_matrix=cov).log_prob(x)


def marginal_var(tr, t: float) -> torch.Tensor:
    tt = torch.tensor(t, dtype=F64)
    return tr.path_sampler.compute_alpha_t(tt)[0] ** 2 * S**2 + tr.path_sampler.compute_sigma_t(tt)[0] ** 2


@pytest.mark.parametrize("prediction", list(PREDICTIONS))
@pytest.mark.parametrize("path_type", list(PATHS))
def test_exact_likelihood_matches_the_closed_form(path_type, prediction):
    tr = create_transport(path_type, prediction)
    target = GaussianTarget(tr.path_sampler, M, S, Q)
    sampler = Sampler(tr)
    x = data(128)
    with torch.no_grad():  # the divergence needs autograd inside: must work under no_grad too
        logp, z = likelihood_fn(sampler, divergence="exact", **TIGHT)(x, target.model(prediction))
    t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, eval=True)
    z_exact = target.flow(x, t1, t0)
    torch.testing.assert_close(z, z_exact, atol=1e-6, rtol=0)
    # what the ODE computes exactly: the N(0, I) prior at t0 pushed through the exact (affine) flow to t1,
    # log N(z; 0, I) + log |dz/dx| with |dz/dx| = prod_i c_i(t0) / c_i(t1), c^2 = alpha^2 s^2 + sigma^2
    log_det = 0.5 * torch.log(marginal_var(tr, t0) / marginal_var(tr, t1)).sum()
    torch.testing.assert_close(logp, tr.prior_logp(z_exact) + log_det, atol=1e-5, rtol=0)
    if (t0, t1) == (0.0, 1.0):  # Linear/GVP velocity: p_0 = N(0, I) and t1 = 1, so this is log N(x; M, Sigma)
        torch.testing.assert_close(logp, true_log_prob(x), atol=1e-5, rtol=0)
    else:  # eps ends / VP's alpha_0 = 0.0066 > 0: still within a few 1e-2 nats of the data density
        assert (logp - true_log_prob(x)).abs().max().item() < 0.05


def test_rademacher_is_exact_for_a_diagonal_jacobian():
    tr = create_transport("GVP")
    model = GaussianTarget(tr.path_sampler, M, S).model("velocity")  # no rotation: dv/dx is diagonal
    x = data(64, rotation=None)
    exact, _ = likelihood_fn(Sampler(tr), divergence="exact", **TIGHT)(x, model)
    hutch, _ = likelihood_fn(Sampler(tr), probe="rademacher", **TIGHT)(x, model, generator=3)
    torch.testing.assert_close(hutch, exact, atol=1e-6, rtol=0)
    torch.testing.assert_close(exact, true_log_prob(x, rotation=None), atol=1e-5, rtol=0)


@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
def test_hutchinson_is_unbiased_and_probes_average(probe):
    tr = create_transport("Linear")
    model = GaussianTarget(tr.path_sampler, M, S, Q).model("velocity")
    x = data(512)
    exact, _ = likelihood_fn(Sampler(tr), divergence="exact", **TIGHT)(x, model)
    errors = {}
    for k in (1, 16):
        est, _ = likelihood_fn(Sampler(tr), probe=probe, num_probes=k, **TIGHT)(x, model, generator=list(range(512)))
        errors[k] = est - exact
    err = errors[1]
    assert err.std().item() > 0.05  # a non-diagonal Jacobian: single probes are noisy ...
    assert abs(err.mean().item()) < 4 * err.std().item() / math.sqrt(len(err))  # ... but unbiased
    assert errors[16].std().item() < 0.5 * err.std().item()  # 16 probes: ~1/4 of the spread


def test_bits_per_dim():
    logp = torch.tensor([-10.0, 3.0])
    torch.testing.assert_close(bits_per_dim(logp, 5), -logp / (5 * math.log(2)))
    torch.testing.assert_close(bits_per_dim(logp, (1, 2, 2)), -logp / (4 * math.log(2)))
    # a standard normal in D dims: expected -log p = D/2 log(2 pi e) nats -> 2.047 bits/dim
    assert bits_per_dim(torch.tensor(-0.5 * math.log(2 * math.pi * math.e)), 1).item() == pytest.approx(
        2.0471, abs=1e-4
    )


def test_image_shaped_input():
    tr = create_transport("VP")
    target = GaussianTarget(tr.path_sampler, torch.zeros(4, dtype=F64), torch.full((4,), 0.5, dtype=F64))
    x = torch.randn(8, 4, dtype=F64) * 0.5
    flat, _ = likelihood_fn(Sampler(tr), divergence="exact", **TIGHT)(x, target.model("velocity"))
    img_model = lambda x, t: target.velocity(x.flatten(1), t).view_as(x)  # noqa: E731
    img, z = likelihood_fn(Sampler(tr), divergence="exact", **TIGHT)(x.view(8, 1, 2, 2), img_model)
    assert z.shape == (8, 1, 2, 2)
    torch.testing.assert_close(img, flat)


def test_seeded_probes_reproduce_and_do_not_depend_on_the_batch():
    sampler = Sampler(create_transport("GVP"))
    fn = sampler.sample_ode_likelihood(sampling_method="euler", num_steps=11, probe="gaussian")
    field = lambda x, t: torch.sin(2 * x) * t[:, None] - x  # noqa: E731  (row-wise, batch-invariant)
    x = torch.randn(5, 3, dtype=F64)
    full, z_full = fn(x, field, generator=[0, 1, 2, 3, 4])
    assert sampler.last_nfe == 10
    part, z_part = fn(x[[4, 2]], field, generator=[4, 2])
    assert torch.equal(part, full[[4, 2]]) and torch.equal(z_part, z_full[[4, 2]])
    again, _ = fn(x, field, generator=[0, 1, 2, 3, 4])
    other, _ = fn(x, field, generator=[5, 6, 7, 8, 9])
    assert torch.equal(again, full) and not torch.allclose(other, full)


def test_dopri5_nfe_is_counted():
    sampler = Sampler(create_transport())
    with pytest.warns(UserWarning, match=naming("dopri5", "num_steps=50")):
        fn = sampler.sample_ode_likelihood()
    calls = []
    fn(torch.randn(4, 2), lambda x, t: calls.append(1) or -x)
    assert sampler.last_nfe == len(calls) > 2


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(divergence="trace"), ("divergence", "'trace'", "'hutchinson'", "'exact'")),
        (dict(probe="sphere"), ("probe", "'sphere'", "'rademacher'", "'gaussian'")),
        (dict(num_probes=0), ("num_probes", ">= 1", "got 0")),
        (dict(sampling_method="rk45"), ("ODE", "sampling_method", "'rk45'", "'dopri5'")),
    ],
)
def test_bad_likelihood_options(kwargs, names):
    with pytest.raises(ValueError, match=naming(*names)):
        likelihood_fn(Sampler(create_transport()), **kwargs)
