"""Transport: eps defaults, time intervals, option errors, and training losses against their formulas."""

import math

import pytest
import torch

from sit_vit5.transport import PATHS, PREDICTIONS, create_transport
from sit_vit5.transport.transport import SDE_MIN_EPS
from tests.helpers import naming

from .test_transport_paths import coefficients

F64 = torch.float64
COMBOS = [(p, q) for p in PATHS for q in PREDICTIONS]
# loss weights apply to score / noise only (as in SiT)
LOSS_CASES = [(p, q, w) for p, q in COMBOS for w in ([None] if q == "velocity" else [None, "velocity", "likelihood"])]


# ---------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "path_type, prediction, train_eps, sample_eps",
    [
        ("Linear", "velocity", 0.0, 0.0),
        ("GVP", "velocity", 0.0, 0.0),
        ("Linear", "score", 1e-3, 1e-3),
        ("GVP", "noise", 1e-3, 1e-3),
        ("VP", "velocity", 1e-5, 1e-3),
        ("VP", "noise", 1e-5, 1e-3),
    ],
)
def test_eps_defaults(path_type, prediction, train_eps, sample_eps):
    tr = create_transport(path_type, prediction)
    assert (tr.train_eps, tr.sample_eps) == (train_eps, sample_eps)


def test_eps_defaults_are_independent():
    """The official code leaves sample_eps = None when only train_eps is given."""
    tr = create_transport("VP", train_eps=1e-4)
    assert (tr.train_eps, tr.sample_eps) == (1e-4, 1e-3)
    tr = create_transport("Linear", "noise", sample_eps=5e-3)
    assert (tr.train_eps, tr.sample_eps) == (1e-3, 5e-3)


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        (dict(path_type="linear"), "path_type 'linear'.*'Linear', 'GVP', 'VP'"),
        (dict(prediction="eps"), "prediction 'eps'.*'velocity', 'score', 'noise'"),
        (dict(prediction="noise", loss_weight="snr"), "loss_weight 'snr'.*'velocity', 'likelihood'"),
        (dict(train_eps=0.7), naming("train_eps", "[0, 0.5)", "0.7")),
    ],
)
def test_unknown_options_name_the_valid_ones(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        create_transport(**kwargs)


def test_loss_weight_with_velocity_warns():
    with pytest.warns(UserWarning, match=naming("loss_weight='likelihood'", "prediction='velocity'")):
        create_transport(loss_weight="likelihood")


# ---------------------------------------------------------------------------- intervals


@pytest.mark.parametrize(
    "path_type, prediction, kwargs, expected",
    [
        ("Linear", "velocity", dict(), (0.0, 1.0)),
        ("Linear", "noise", dict(), (1e-3, 1 - 1e-3)),
        ("VP", "velocity", dict(), (0.0, 1 - 1e-5)),
        ("VP", "velocity", dict(eval=True), (0.0, 1 - 1e-3)),
        ("VP", "score", dict(eval=True, reverse=True), (1 - 1e-3, 0.0)),
        ("GVP", "score", dict(eval=True, reverse=True), (1 - 1e-3, 1e-3)),
        ("Linear", "velocity", dict(eval=True, sde=True, last_step_size=0.04), (SDE_MIN_EPS, 0.96)),
        ("Linear", "velocity", dict(eval=True, sde=True, diffusion_form="sigma", last_step_size=0.04), (0.0, 0.96)),
        ("Linear", "velocity", dict(eval=True, sde=True, diffusion_form="sigma"), (0.0, 1 - SDE_MIN_EPS)),
        ("VP", "velocity", dict(eval=True, sde=True, last_step_size=0.04), (0.0, 0.96)),
        ("Linear", "noise", dict(eval=True, sde=True, last_step_size=0.04), (1e-3, 0.96)),
    ],
)
def test_check_interval(path_type, prediction, kwargs, expected):
    tr = create_transport(path_type, prediction)
    got = tr.check_interval(tr.train_eps, tr.sample_eps, **kwargs)
    assert got == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------------------- training losses


def true_target(prediction, x0, x1, t, path_type):
    """Target of each prediction written out: velocity u_t, noise x0, score -x0 / sigma."""
    rows = [coefficients(path_type, ti) for ti in t.tolist()]
    col = (x1.dim() - 1) * [1]
    da = torch.tensor([r[1] for r in rows], dtype=x1.dtype).view(-1, *col)
    s = torch.tensor([r[2] for r in rows], dtype=x1.dtype).view(-1, *col)
    ds = torch.tensor([r[3] for r in rows], dtype=x1.dtype).view(-1, *col)
    return {"velocity": da * x1 + ds * x0, "noise": x0, "score": -x0 / s}[prediction]


@pytest.mark.parametrize("path_type, prediction, loss_weight", LOSS_CASES)
def test_loss_is_zero_for_the_true_target(path_type, prediction, loss_weight):
    tr = create_transport(path_type, prediction, loss_weight)
    x1 = torch.randn(16, 2, 3, 3, dtype=F64)
    t, x0, _ = tr.sample(x1, generator=torch.Generator().manual_seed(5))  # the draws the loss will make

    def oracle(xt, t_in, **kwargs):
        assert torch.equal(t_in, t)
        return true_target(prediction, x0, x1, t, path_type)

    out = tr.training_losses(oracle, x1, generator=torch.Generator().manual_seed(5))
    assert out["loss"].shape == (16,)
    assert out["loss"].abs().max().item() < 1e-20
    # and a wrong answer is not free
    wrong = tr.training_losses(lambda xt, t, **kw: xt, x1, generator=torch.Generator().manual_seed(5))
    assert (wrong["loss"] > 1e-6).all()


@pytest.mark.parametrize("path_type, prediction, loss_weight", LOSS_CASES)
def test_loss_matches_formula_on_fixed_draws(path_type, prediction, loss_weight):
    tr = create_transport(path_type, prediction, loss_weight)
    x1 = torch.randn(8, 3, 2, 2, dtype=F64)
    pred = torch.randn(8, 3, 2, 2, dtype=F64)
    t, x0, _ = tr.sample(x1, generator=torch.Generator().manual_seed(1))
    got = tr.training_losses(lambda xt, t, **kw: pred, x1, generator=torch.Generator().manual_seed(1))["loss"]
    for i, ti in enumerate(t.tolist()):
        a, da, s, ds = coefficients(path_type, ti)
        w = (da / a) * s**2 - s * ds
        weight = {None: 1.0, "velocity": (w / s) ** 2, "likelihood": w / s**2}[loss_weight]
        if prediction == "velocity":
            err = pred[i] - (da * x1[i] + ds * x0[i])
        elif prediction == "noise":
            err = pred[i] - x0[i]
        else:
            err = s * pred[i] + x0[i]
        assert got[i].item() == pytest.approx(weight * err.pow(2).mean().item(), rel=1e-9)


def test_default_draws_use_global_rng_in_sit_order():
    """x0 = randn_like(x1) first, then t = rand(B) on the CPU (so seeded runs draw what SiT draws)."""
    tr = create_transport("Linear", "velocity")
    x1 = torch.randn(32, 4)
    seen = {}

    def model(xt, t, y):
        seen.update(xt=xt, t=t, y=y)
        return torch.zeros_like(xt)

    torch.manual_seed(123)
    loss = tr.training_losses(model, x1, model_kwargs=dict(y=torch.arange(32)))["loss"]
    torch.manual_seed(123)
    x0 = torch.randn_like(x1)
    t = torch.rand(32)
    torch.testing.assert_close(seen["t"], t)
    torch.testing.assert_close(seen["xt"], t[:, None] * x1 + (1 - t[:, None]) * x0)
    torch.testing.assert_close(loss, (x1 - x0).pow(2).mean(dim=1))
    assert torch.equal(seen["y"], torch.arange(32))


def test_training_times_respect_eps():
    tr = create_transport("GVP", "noise", train_eps=0.2)
    t, _, _ = tr.sample(torch.zeros(4096, 1), generator=torch.Generator().manual_seed(0))
    assert 0.2 <= t.min().item() < 0.21 and 0.79 < t.max().item() <= 0.8


def test_generator_makes_losses_reproducible_and_ignores_global_rng():
    tr = create_transport("VP", "score", "likelihood")
    x1 = torch.randn(8, 2, 4, 4)
    model = lambda x, t: x * t.view(-1, 1, 1, 1)  # noqa: E731
    torch.manual_seed(0)
    a = tr.training_losses(model, x1, generator=7)["loss"]
    torch.manual_seed(1)
    b = tr.training_losses(model, x1, generator=torch.Generator().manual_seed(7))["loss"]
    c = tr.training_losses(model, x1, generator=8)["loss"]
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_learn_sigma_output_is_cut_to_the_first_half():
    tr = create_transport()
    x1 = torch.randn(4, 3, 2, 2)
    half = torch.randn(4, 3, 2, 2)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    plain = tr.training_losses(lambda x, t: half, x1, generator=gen())
    doubled = tr.training_losses(lambda x, t: torch.cat([half, 1e6 * torch.ones_like(half)], 1), x1, generator=gen())
    assert torch.equal(plain["loss"], doubled["loss"]) and torch.equal(doubled["pred"], half)


def test_wrong_output_shape_is_an_error():
    with pytest.raises(ValueError, match=naming("(4, 5)", "(4, 3)")):
        create_transport().training_losses(lambda x, t: torch.zeros(4, 5), torch.zeros(4, 3))


def test_prior_logp():
    z = torch.randn(5, 2, 3, dtype=F64)
    expected = torch.distributions.Normal(0.0, 1.0).log_prob(z).flatten(1).sum(1)
    torch.testing.assert_close(create_transport().prior_logp(z), expected)
    assert create_transport().prior_logp(torch.zeros(1, 6)).item() == pytest.approx(-3 * math.log(2 * math.pi))
