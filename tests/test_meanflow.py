"""MeanFlow (objective/meanflow.py) against closed forms: for Gaussian data the flow map of the
linear path is affine, so the average velocity is known exactly; the JVP target against central
finite differences on both backbones; r = t against SiT's flow-matching loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from sit_vit5.config import ConfigError, load_config
from sit_vit5.models import create_model
from sit_vit5.objective import create_objective
from sit_vit5.objective.meanflow import MeanFlowObjective, MeanFlowSettings
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.utils.errors import SettingError

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (1, 2, 2)  # (C, H, W): four independent Gaussian coordinates
MEAN = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64).view(SHAPE)
STD = torch.tensor([0.3, 1.0, 2.0, 0.1], dtype=torch.float64).view(SHAPE)


def exact_u(z: Tensor, t: Tensor, r: Tensor) -> Tensor:
    """The average velocity over [t, r] (ours: t = 0 noise) for data N(MEAN, STD^2): with m_t =
    t·MEAN, σ_t² = t²·STD² + (1 - t)², the flow map is z -> m_r + σ_r/σ_t·(z - m_t), so u = MEAN +
    k·(z - m_t), k = (σ_r - σ_t) / ((r - t) σ_t) = ((r + t)·STD² - (2 - r - t)) / ((σ_r + σ_t)·σ_t)
    (no division by r - t: at r = t it is the instantaneous velocity)."""
    t, r = t.view(-1, 1, 1, 1), r.view(-1, 1, 1, 1)
    sig_t = (t**2 * STD**2 + (1 - t) ** 2).sqrt()
    sig_r = (r**2 * STD**2 + (1 - r) ** 2).sqrt()
    k = ((r + t) * STD**2 - (2 - r - t)) / ((sig_r + sig_t) * sig_t)
    return MEAN + k * (z - t * MEAN)


class ExactModel(nn.Module):
    """``a·u_exact + b``: the exact average velocity at a = 1, b = 0 (the test's two parameters),
    with the backbone's call signature."""

    def __init__(self, a: float = 1.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(b, dtype=torch.float64))

    def forward(self, x: Tensor, t: Tensor, y: Tensor, interval: Tensor | float | None = None,
                force_drop_ids: Tensor | None = None) -> Tensor:
        t = torch.as_tensor(t, dtype=x.dtype).reshape(-1).expand(len(x))
        h = torch.zeros_like(t) if interval is None else torch.as_tensor(interval, dtype=x.dtype)
        return self.a * exact_u(x, t, t + h.reshape(-1).expand(len(x))) + self.b


def plain_objective(**settings: float | str) -> MeanFlowObjective:
    """No adaptive weight, no guidance, no label dropout (the closed-form tests' loss)."""
    base = dict(norm_p=0.0, omega=1.0, kappa=0.0, class_dropout=0.0)
    return MeanFlowObjective(MeanFlowSettings(**{**base, **settings}))


def gaussian_draws(n: int, objective: MeanFlowObjective, seed: int = 0) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = MEAN + STD * torch.randn(n, *SHAPE, generator=gen, dtype=torch.float64)
    t, r = objective.sample_times(n, generator=gen)
    noise = torch.randn(n, *SHAPE, generator=gen, dtype=torch.float64)
    return x, torch.zeros(n, dtype=torch.long), t.double(), r.double(), noise


def per_sample_grads(model: ExactModel, objective: MeanFlowObjective, draws: tuple[Tensor, ...]
                     ) -> tuple[Tensor, Tensor]:
    """(B, 2): each sample's gradient of its loss w.r.t. (a, b), in closed form from the residual
    (loss = Σ (a·u + b - target)²); and autograd's gradient of the batch mean, to tie the two."""
    out = objective.losses_at(model, *draws)
    out["loss"].mean().backward()
    residual = (out["u"] - out["target"]).detach()
    x, _, t, r, noise = draws
    z = t.view(-1, 1, 1, 1) * x + (1 - t.view(-1, 1, 1, 1)) * noise
    u0 = exact_u(z, t, r)
    grads = torch.stack([2 * (residual * u0).flatten(1).sum(1), 2 * residual.flatten(1).sum(1)], 1)
    return grads, torch.stack([model.a.grad, model.b.grad])


@pytest.mark.parametrize("ratio,tangent", [(0.25, "conditional"), (1.0, "conditional"), (1.0, "predicted")])
def test_loss_gradient_at_the_exact_average_velocity_vanishes_in_expectation(ratio, tangent):
    objective = plain_objective(ratio=ratio, tangent=tangent)
    draws = gaussian_draws(40_000, objective)
    grads, autograd = per_sample_grads(ExactModel(), objective, draws)
    mean, se = grads.mean(0), grads.std(0) / len(grads) ** 0.5
    torch.testing.assert_close(autograd, mean, rtol=1e-9, atol=1e-12)  # the loss's real gradient
    assert (mean.abs() < 4 * se).all(), (mean, se)
    # the test has power: 5 % off in scale or a 0.05 offset is many standard errors away
    for wrong in (ExactModel(a=1.05), ExactModel(b=0.05)):
        grads = per_sample_grads(wrong, objective, draws)[0]
        mean, se = grads.mean(0), grads.std(0) / len(grads) ** 0.5
        assert (mean.abs() > 8 * se).any(), (mean, se)


@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_steps_from_noise_with_the_exact_u_give_the_target_gaussian(num_steps):
    objective = plain_objective()
    built = objective.sampler(SampleSpec(method="meanflow", num_steps=num_steps))
    n = 40_000
    z = torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = built.sample(z, ExactModel(), y=torch.zeros(n, dtype=torch.long))[-1]
    assert built.sampler.last_nfe == num_steps
    mean, var = x.mean(0), x.var(0)
    assert ((mean - MEAN).abs() < 5 * STD / n**0.5).all(), (mean, MEAN)
    assert ((var - STD**2).abs() < 5 * STD**2 * (2 / n) ** 0.5).all(), (var, STD**2)
    # a sign slip (the jump taken backwards) lands elsewhere
    wrong = z - ExactModel()(z, torch.zeros(n, dtype=torch.float64), None, interval=1.0)
    assert ((wrong.mean(0) - MEAN).abs() > 0.2).any()


def _tiny(name: str, seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    model = create_model(name, depth=2, hidden_size=64, num_heads=4, input_size=8, in_channels=1,
                         num_classes=10, learn_sigma=False, interval_embed=True, **overrides)
    with torch.no_grad():  # leave adaLN-zero's init: every path must carry a signal
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("name,tangent", [("SiT-S/2", "conditional"), ("ViT5-S/2", "conditional"),
                                          ("ViT5-S/2", "predicted")])
def test_jvp_target_matches_central_finite_differences(name, tangent):
    model = _tiny(name)
    objective = plain_objective(ratio=1.0, tangent=tangent)
    gen = torch.Generator().manual_seed(2)
    x, noise = torch.randn(6, 1, 8, 8, generator=gen), torch.randn(6, 1, 8, 8, generator=gen)
    y = torch.arange(6)
    t, r = objective.sample_times(6, generator=gen)
    target = objective.losses_at(model, x, y, t, r, noise)["target"]
    tx = t.view(-1, 1, 1, 1)
    z, v = tx * x + (1 - tx) * noise, x - noise

    def u(z_: Tensor, t_: Tensor) -> Tensor:
        with torch.no_grad():
            return model(z_, t_, y, interval=r - t_)

    # the direction z moves in: the sample's v, or the model's own velocity at r = t
    with torch.no_grad():
        predicted = model(z, t, y, interval=torch.zeros_like(t))
    dzdt, other = (v, predicted) if tangent == "conditional" else (predicted, v)

    def fd_target(d: float, direction: Tensor) -> Tensor:
        dudt = (u(z + d * direction, t + d) - u(z - d * direction, t - d)) / (2 * d)
        return v + (r - t).view(-1, 1, 1, 1) * dudt

    def rel(d: float, direction: Tensor = dzdt) -> float:
        return float((fd_target(d, direction) - target).norm() / (target - v).norm())

    assert rel(1e-2) < 2e-3, rel(1e-2)
    assert rel(1e-2, other) > 20 * rel(1e-2)  # the other tangent is far off: the test can tell them
    if tangent == "conditional":  # central differences converge as d^2 (above float32's floor)
        assert rel(1e-1) > 5 * rel(1e-2)


def test_r_equal_t_reduces_the_loss_to_flow_matching():
    model = _tiny("ViT5-S/2", seed=3)
    gen = torch.Generator().manual_seed(4)
    x, noise = torch.randn(8, 1, 8, 8, generator=gen), torch.randn(8, 1, 8, 8, generator=gen)
    y, t = torch.arange(8) % 10, torch.rand(8, generator=gen)
    flow = create_objective({"objective": "sit"}).transport.losses_at(model, t, noise, x,
                                                                      dict(y=y))["loss"]
    dims = x[0].numel()  # SiT averages over C·H·W, MeanFlow sums
    for tangent in ("conditional", "predicted"):  # at r = t the JVP term has weight 0
        mean_flow = plain_objective(tangent=tangent).losses_at(model, x, y, t, t, noise)
        torch.testing.assert_close(mean_flow["loss"], flow * dims, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mean_flow["target"], x - noise)
    # and the r != t part of the loss is not flow matching (the comparison can tell)
    other = plain_objective().losses_at(model, x, y, t, torch.clamp(t + 0.5, max=1.0), noise)
    assert not torch.allclose(other["loss"], flow * dims, rtol=1e-3)


def test_the_interval_embedding_starts_at_zero_and_vanishes_at_r_equal_t():
    torch.manual_seed(0)
    flow = create_model("ViT5-S/2", depth=2, hidden_size=64, num_heads=4, input_size=8,
                        in_channels=1, num_classes=10, learn_sigma=False)
    torch.manual_seed(0)
    mean_flow = create_model("ViT5-S/2", depth=2, hidden_size=64, num_heads=4, input_size=8,
                             in_channels=1, num_classes=10, learn_sigma=False, interval_embed=True)
    assert flow.h_embedder is None and not any("h_embedder" in k for k in flow.state_dict())
    shared = mean_flow.state_dict()
    for key, value in flow.state_dict().items():  # same draws: the new module is initialised last
        assert torch.equal(value, shared[key]), key
    with torch.no_grad():
        for p in mean_flow.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mean_flow.eval()
    x, t, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.arange(3)
    with torch.no_grad():
        plain = mean_flow(x, t, y)
        assert torch.equal(mean_flow(x, t, y, interval=0.0), plain)  # r = t: the (t, y) function
        assert not torch.allclose(mean_flow(x, t, y, interval=0.5), plain)
    with pytest.raises(ValueError, match="no interval embedding"):
        flow(x, t, y, interval=0.5)


class Wrapper(nn.Module):
    """A DDP-like wrapper: the model as ``.module``, its forward called through."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs) -> Tensor:
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("route", ["checkpointing", "wrapped"])
def test_the_two_pass_route_gives_the_one_pass_gradients(route):
    """Gradient checkpointing and wrappers (DDP's forward fails under torch.func.jvp) take the JVP
    without a graph on the bare module, then a plain forward: the same gradients."""
    objective = MeanFlowObjective(MeanFlowSettings(kappa=0.0, ratio=1.0))
    grads = []
    for two_pass in (False, True):
        model = _tiny("ViT5-S/2", seed=5).train()
        model.set_grad_checkpointing(two_pass and route == "checkpointing")
        called = Wrapper(model) if two_pass and route == "wrapped" else model
        torch.manual_seed(6)
        objective.loss(called, torch.randn(4, 1, 8, 8), torch.arange(4)).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_bf16_autocast_and_guidance_train_a_step():
    model = _tiny("SiT-S/2", seed=7).train()
    objective = create_objective({"objective": "meanflow", "meanflow_kappa": 0.5,
                                  "meanflow_omega": 1.5})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objective.loss(model, torch.randn(8, 1, 8, 8), torch.arange(8) % 10)
    loss.mean().backward()
    assert loss.shape == (8,) and bool(torch.isfinite(loss).all())
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def test_configs_pair_the_objective_with_the_interval_embedding():
    cfg = load_config("demo-meanflow", ["train.out_dir=/tmp/unused"])
    assert cfg["transport"]["objective"] == "meanflow" and cfg["model"]["interval_embed"] is True
    assert cfg["sample"]["method"] == "meanflow" and cfg["sample"]["num_steps"] == 1
    with pytest.raises(ConfigError, match="interval_embed=true"):
        load_config("demo-meanflow", ["model.interval_embed=false"])
    with pytest.raises(ConfigError, match="interval_embed=false"):
        load_config("demo", ["model.interval_embed=true"])
    with pytest.raises(ConfigError, match="learn_sigma"):
        load_config("demo-meanflow", ["model.learn_sigma=true"])
    with pytest.raises(ConfigError, match="meanflow_ratio"):
        load_config("demo-meanflow", ["transport.meanflow_ratio=1.5"])
    with pytest.raises(ConfigError, match="meanflow_tangent='marginal'; valid: conditional, predicted"):
        load_config("demo-meanflow", ["transport.meanflow_tangent=marginal"])
    with pytest.raises(SettingError, match="meanflow_tangent='marginal'; valid: conditional, predicted"):
        MeanFlowSettings(tangent="marginal")  # built directly, without a config


def test_method_meanflow_is_refused_for_flow_models_naming_the_objective():
    spec = SampleSpec(method="meanflow", num_steps=2)
    assert spec.nfe == 2 and spec.with_nfe(1).num_steps == 1
    with pytest.raises(SettingError, match="sit objective.*valid: ode, sde"):
        create_objective({"objective": "sit"}).sampler(spec)
    with pytest.raises(SettingError, match="meanflow objective.*valid: meanflow"):
        create_objective({"objective": "meanflow"}).sampler(SampleSpec(method="ode"))


def test_a_meanflow_objective_loads_only_its_own_platform_file():
    code = ("import sys; from sit_vit5.objective import create_objective; "
            "create_objective({'objective': 'meanflow'}); "
            "print('\\n'.join(m for m in sys.modules if m.startswith('sit_vit5.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    assert "sit_vit5.objective.meanflow" in out
    assert not [m for m in out if m.startswith(("sit_vit5.diffusion", "sit_vit5.training.repa",
                                                "sit_vit5.hub", "sit_vit5.pipeline"))], out


def test_times_are_drawn_in_meanflows_convention_and_converted_once():
    """Two logit-normals in MeanFlow's convention (t = 1 noise), ordered there, then t -> 1 - t:
    ours has t <= r, and the medians of max / min of two draws map to r / t as 1 - sigmoid(...)."""
    settings = MeanFlowSettings(time_mean=-0.4, time_std=1.0, ratio=1.0)
    t, r = MeanFlowObjective(settings).sample_times(40_000, generator=torch.Generator().manual_seed(8))
    assert bool((t <= r).all())
    q = 0.5449  # Φ^-1(1 / sqrt(2)): the median of the larger of two standard normals
    torch.testing.assert_close(t.median(), 1 - torch.sigmoid(torch.tensor(-0.4 + q)), atol=0.01,
                               rtol=0)
    torch.testing.assert_close(r.median(), 1 - torch.sigmoid(torch.tensor(-0.4 - q)), atol=0.01,
                               rtol=0)
    quarter = MeanFlowObjective(MeanFlowSettings(ratio=0.25)).sample_times(40_000)
    assert abs(float((quarter[0] != quarter[1]).float().mean()) - 0.25) < 0.01


def test_r_drawn_from_its_own_logit_normal_matches_the_ordered_pairs_closed_form():
    """With r's own (mean, std), MeanFlow's times are max / min of two independent logit-normals:
    P(max <= x) = F_t(x)·F_r(x), P(min <= x) = 1 - (1 - F_t(x))(1 - F_r(x)), F the normal CDF of
    logit(x). Ours are 1 - those. Unset, r's draw is t's, bit for bit."""
    settings = MeanFlowSettings(time_mean=-0.6, time_std=1.6, r_mean=-4.0, r_std=1.6, ratio=1.0)
    t, r = MeanFlowObjective(settings).sample_times(40_000, generator=torch.Generator().manual_seed(3))
    normal = torch.distributions.Normal(0.0, 1.0)
    for x in (0.02, 0.1, 0.3, 0.6, 0.9):  # in MeanFlow's convention
        logit = torch.logit(torch.tensor(x))
        f_t, f_r = normal.cdf((logit + 0.6) / 1.6), normal.cdf((logit + 4.0) / 1.6)
        # ours: t = 1 - max, r = 1 - min, so P(t >= 1 - x) = P(max <= x)
        assert abs(float((t >= 1 - x).float().mean()) - float(f_t * f_r)) < 0.01, x
        assert abs(float((r >= 1 - x).float().mean()) - float(1 - (1 - f_t) * (1 - f_r))) < 0.01, x
    same = MeanFlowSettings(time_mean=-0.4, time_std=1.0, r_mean=-0.4, r_std=1.0)
    drawn = [MeanFlowObjective(s).sample_times(64, generator=torch.Generator().manual_seed(5))
             for s in (MeanFlowSettings(), same)]
    assert all(torch.equal(a, b) for a, b in zip(*drawn, strict=True))
    with pytest.raises(ConfigError, match="transport.meanflow_r_std"):
        load_config("demo-meanflow", ["transport.meanflow_r_std=0"])
    assert load_config("demo-meanflow", ["transport.meanflow_r_mean=-3.0"])["transport"]["meanflow_r_mean"] == -3.0


def test_the_bench_times_both_steps_and_writes_the_ratio(tmp_path):
    from bench import meanflow_step

    out = tmp_path / "mf.json"
    meanflow_step.main(["--device", "cpu", "--threads", "1", "--sizes", "S", "--depth", "1",
                        "--input-size", "8", "--batch-size", "2", "--num-classes", "10", "--warmup",
                        "0", "--steps", "1", "--rounds", "1", "--tangents", "conditional", "predicted",
                        "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["model"], r["tangent"]) for r in rows) == [
        ("SiT", "conditional"), ("SiT", "predicted"), ("ViT5", "conditional"), ("ViT5", "predicted")]
    assert all(r["meanflow_over_flow"] > 1 for r in rows)  # a JVP is never free


def test_guidance_is_folded_into_the_target_except_where_labels_are_dropped():
    """v_g = ω·v + κ·u(z, t, t | y) + (1 - ω - κ)·u(z, t, t | ∅), with the model told which calls
    are unconditional; a dropped label keeps the plain v."""

    def stub(x: Tensor, t: Tensor, y: Tensor, interval=None, force_drop_ids=None) -> Tensor:
        assert interval is None  # the instantaneous velocity (r = t)
        null = force_drop_ids.view(-1, 1, 1, 1).to(x.dtype)
        return 10.0 * null + 3.0 * (1 - null) + 0 * x  # u(·|∅) = 10, u(·|y) = 3

    objective = MeanFlowObjective(MeanFlowSettings(omega=1.5, kappa=0.25))
    v = torch.ones(4, 1, 2, 2)
    drop = torch.tensor([False, True, False, True])
    v_g = objective.guided_velocity(stub, torch.zeros_like(v), torch.rand(4), torch.arange(4), v,
                                    drop)
    kept = 1.5 * 1 + 0.25 * 3.0 + (1 - 1.5 - 0.25) * 10.0
    assert torch.equal(v_g[:, 0, 0, 0], torch.tensor([kept, 1.0, kept, 1.0]))
    plain = MeanFlowObjective(MeanFlowSettings(omega=1.0, kappa=0.0))
    assert plain.guided_velocity(stub, v, torch.rand(4), torch.arange(4), v, drop) is v


def test_the_predicted_tangent_is_the_models_velocity_mixed_with_the_same_guidance():
    """ω·u(z, t, t | y) + κ·u(z, t, t | y) + (1 - ω - κ)·u(z, t, t | ∅) where the label is kept, the
    unconditional u where it is dropped; one forward of the batch more than v_g."""
    calls = []

    def stub(x: Tensor, t: Tensor, y: Tensor, interval=None, force_drop_ids=None) -> Tensor:
        assert interval is None  # the instantaneous velocity (r = t)
        calls.append(len(x))
        null = force_drop_ids.view(-1, 1, 1, 1).to(x.dtype)
        return 10.0 * null + 3.0 * (1 - null) + 0 * x  # u(·|∅) = 10, u(·|y) = 3

    v, z = torch.ones(4, 1, 2, 2), torch.zeros(4, 1, 2, 2)
    t, y, drop = torch.rand(4), torch.arange(4), torch.tensor([False, True, False, True])
    guided = MeanFlowObjective(MeanFlowSettings(omega=1.5, kappa=0.25, tangent="predicted"))
    v_g = guided.guided_velocity(stub, z, t, y, v, drop)
    calls.clear()
    kept = (1.5 + 0.25) * 3.0 + (1 - 1.5 - 0.25) * 10.0
    dzdt = guided.tangent(stub, z, t, y, v, v_g, drop)
    assert torch.equal(dzdt[:, 0, 0, 0], torch.tensor([kept, 10.0, kept, 10.0])) and calls == [4]
    plain = MeanFlowObjective(MeanFlowSettings(omega=1.0, kappa=0.0, tangent="predicted"))
    dzdt = plain.tangent(stub, z, t, y, v, v, drop)
    assert torch.equal(dzdt[:, 0, 0, 0], torch.tensor([3.0, 10.0, 3.0, 10.0]))
    conditional = MeanFlowObjective(MeanFlowSettings(omega=1.5, kappa=0.25))
    assert conditional.tangent(stub, z, t, y, v, v_g, drop) is v_g
