"""Paths: docs/DESIGN.md §4 numbers, derivatives, drift/diffusion, and velocity <-> score <-> noise conversions."""

import math

import pytest
import torch

from sit_vit5.transport import DIFFUSION_FORMS, PATHS, create_transport
from sit_vit5.transport.paths import GVPCPlan, ICPlan, VPCPlan
from sit_vit5.transport.per_sample import expand_t_like_x
from tests.gaussian_target import GaussianTarget

F64 = torch.float64


def coefficients(path_type: str, t: float) -> tuple[float, float, float, float]:
    """(alpha, alpha_dot, sigma, sigma_dot) written out independently of the library (docs/DESIGN.md §4 table)."""
    if path_type == "Linear":
        return t, 1.0, 1 - t, -1.0
    if path_type == "GVP":
        h = math.pi / 2
        return math.sin(h * t), h * math.cos(h * t), math.cos(h * t), -h * math.sin(h * t)
    smin, smax = 0.1, 20.0
    log_a = -0.25 * (1 - t) ** 2 * (smax - smin) - 0.5 * (1 - t) * smin
    d_log_a = 0.5 * (1 - t) * (smax - smin) + 0.5 * smin
    alpha = math.exp(log_a)
    sigma = math.sqrt(1 - alpha**2)
    return alpha, alpha * d_log_a, sigma, -(alpha**2) * d_log_a / sigma


def path(path_type: str):
    return create_transport(path_type).path_sampler


@pytest.mark.parametrize(
    "path_type, t, expected",
    [
        ("Linear", 0.1, dict(alpha=0.1, d_alpha=1.0, sigma=0.9, d_sigma=-1.0, w=9.0)),
        ("GVP", 0.1, dict(alpha=0.156434, d_alpha=1.551457, sigma=0.987688, d_sigma=-0.245727, w=9.917618)),
        ("VP", 0.5, dict(alpha=0.281183, d_alpha=1.412944, sigma=0.959654, d_sigma=-0.413999)),
    ],
)
def test_design_numbers(path_type, t, expected):
    p = path(path_type)
    tt = torch.tensor([t], dtype=F64)
    alpha, d_alpha = p.compute_alpha_t(tt)
    sigma, d_sigma = p.compute_sigma_t(tt)
    got = dict(alpha=alpha, d_alpha=d_alpha, sigma=sigma, d_sigma=d_sigma)
    got["w"] = p.compute_drift(torch.zeros(1, 3, dtype=F64), tt)[1]
    for key, value in expected.items():
        assert float(got[key].reshape(-1)[0]) == pytest.approx(value, abs=2e-6), key


@pytest.mark.parametrize("path_type", list(PATHS))
def test_coefficients_match_closed_forms_and_derivatives(path_type):
    p = path(path_type)
    ts = torch.linspace(0.02, 0.98, 25, dtype=F64, requires_grad=True)
    alpha, d_alpha = p.compute_alpha_t(ts)
    sigma, d_sigma = p.compute_sigma_t(ts)
    for i, t in enumerate(ts.tolist()):
        assert [alpha[i].item(), d_alpha[i].item(), sigma[i].item(), d_sigma[i].item()] == pytest.approx(
            list(coefficients(path_type, t)), rel=1e-10, abs=1e-12
        )
    # derivatives are the autograd derivatives of the values
    (grad_alpha,) = torch.autograd.grad(alpha.sum(), ts, retain_graph=True)
    (grad_sigma,) = torch.autograd.grad(sigma.sum(), ts)
    torch.testing.assert_close(grad_alpha, d_alpha.detach())
    torch.testing.assert_close(grad_sigma, d_sigma.detach())
    ratio = p.compute_d_alpha_alpha_ratio_t(ts.detach())
    torch.testing.assert_close(ratio, (d_alpha / alpha).detach())


@pytest.mark.parametrize("path_type", list(PATHS))
def test_drift_formula(path_type):
    p = path(path_type)
    x = torch.randn(5, 2, 3, dtype=F64)
    t = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.95], dtype=F64)
    f, w = p.compute_drift(x, t)
    for i, ti in enumerate(t.tolist()):
        a, da, s, ds = coefficients(path_type, ti)
        torch.testing.assert_close(f[i], -(da / a) * x[i])
        assert w[i].item() == pytest.approx((da / a) * s**2 - s * ds, rel=1e-10)  # VP: closed form beta/2 too
    assert w.shape == (5, 1, 1)


@pytest.mark.parametrize("path_type", list(PATHS))
def test_conversions_round_trip(path_type):
    p = path(path_type)
    x = torch.randn(6, 4, 2, 2, dtype=F64)
    v = torch.randn_like(x)
    t = torch.linspace(0.05, 0.95, 6, dtype=F64)
    s = p.get_score_from_velocity(v, x, t)
    eps = p.get_noise_from_velocity(v, x, t)
    torch.testing.assert_close(p.get_velocity_from_score(s, x, t), v)
    sigma = expand_t_like_x(p.compute_sigma_t(t)[0], x)
    torch.testing.assert_close(eps, -sigma * s)  # noise = -sigma * score


@pytest.mark.parametrize("path_type", list(PATHS))
def test_conversions_agree_with_gaussian_closed_form(path_type):
    p = path(path_type)
    target = GaussianTarget(p, torch.tensor([0.7, -1.2], dtype=F64), torch.tensor([0.4, 1.5], dtype=F64))
    x = torch.randn(64, 2, dtype=F64)
    t = torch.rand(64, dtype=F64) * 0.9 + 0.05
    v = target.velocity(x, t)
    torch.testing.assert_close(p.get_score_from_velocity(v, x, t), target.score(x, t))
    torch.testing.assert_close(p.get_noise_from_velocity(v, x, t), target.noise(x, t))
    torch.testing.assert_close(p.get_velocity_from_score(target.score(x, t), x, t), v)


def test_gaussian_target_velocity_is_the_issue_formula():
    """v*(x, t) = a' m + (a' a s^2 + o' o) / (a^2 s^2 + o^2) (x - a m), written out for the GVP path."""
    m, s = 0.3, 0.8
    target = GaussianTarget(path("GVP"), torch.tensor([m], dtype=F64), torch.tensor([s], dtype=F64))
    x, t = torch.tensor([[1.7]], dtype=F64), 0.37
    a, da, o, do = coefficients("GVP", t)
    expected = da * m + (da * a * s**2 + do * o) / (a**2 * s**2 + o**2) * (1.7 - a * m)
    assert target.velocity(x, torch.tensor([t], dtype=F64)).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("path_type", list(PATHS))
def test_plan(path_type):
    p = path(path_type)
    x0, x1 = torch.randn(4, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    t = torch.tensor([0.1, 0.4, 0.6, 0.9], dtype=F64)
    t_out, xt, ut = p.plan(t, x0, x1)
    assert t_out is t
    for i, ti in enumerate(t.tolist()):
        a, da, s, ds = coefficients(path_type, ti)
        torch.testing.assert_close(xt[i], a * x1[i] + s * x0[i])
        torch.testing.assert_close(ut[i], da * x1[i] + ds * x0[i])
    torch.testing.assert_close(p.compute_mu_t(t, x0, x1), xt)


@pytest.mark.parametrize("path_type", list(PATHS))
def test_diffusion_forms(path_type):
    p, norm, t = path(path_type), 2.0, 0.3
    x = torch.randn(2, 3, dtype=F64)
    tt = torch.full((2,), t, dtype=F64)
    a, da, s, ds = coefficients(path_type, t)
    expected = {
        "constant": norm,
        "SBDM": norm * ((da / a) * s**2 - s * ds),
        "sigma": norm * s,
        "linear": norm * (1 - t),
        "decreasing": 0.25 * (norm * math.cos(math.pi * t) + 1) ** 2,
        "increasing-decreasing": norm * math.sin(math.pi * t) ** 2,
    }
    assert set(expected) == set(DIFFUSION_FORMS)
    for form, value in expected.items():
        d = p.compute_diffusion(x, tt, form=form, norm=norm)
        assert d.shape == (2, 1)
        assert d[0].item() == pytest.approx(value, rel=1e-10), form


def test_sbdm_is_singular_at_t0_on_linear_and_gvp_but_not_vp():
    """Why the SBDM SDE must not start at t = 0 (the official code's NaN) on Linear/GVP."""
    x, t0 = torch.ones(1, 2, dtype=F64), torch.zeros(1, dtype=F64)
    for path_type in ("Linear", "GVP"):
        assert torch.isinf(path(path_type).compute_diffusion(x, t0, form="SBDM")).all()
    assert torch.isfinite(path("VP").compute_diffusion(x, t0, form="SBDM")).all()


def test_unknown_diffusion_form_lists_valid_names():
    with pytest.raises(ValueError, match="inccreasing-decreasing.*'increasing-decreasing'"):
        path("Linear").compute_diffusion(torch.ones(1, 2), torch.ones(1) * 0.5, form="inccreasing-decreasing")


def test_expand_t_like_x_is_idempotent_and_accepts_scalars():
    x = torch.zeros(3, 4, 5, 6)
    t = torch.tensor([0.1, 0.2, 0.3])
    once = expand_t_like_x(t, x)
    assert once.shape == (3, 1, 1, 1)
    assert torch.equal(expand_t_like_x(once, x), once)
    assert expand_t_like_x(0.5, x).shape == (3, 1, 1, 1)


def test_sit_class_names_are_aliases():
    assert (ICPlan, GVPCPlan, VPCPlan) == (PATHS["Linear"], PATHS["GVP"], PATHS["VP"])
