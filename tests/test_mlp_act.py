"""The GELU MLP's activation switch ``mlp_act``: SiT's tanh-GELU (default) vs the exact GELU of
ViT-5."""

from __future__ import annotations

import math

import pytest
import torch

from sit_vit5.config import ConfigError, load_config
from sit_vit5.models import SIT_SWITCHES, VIT5_SWITCHES, create_model
from sit_vit5.models.layers import Mlp

TINY = dict(input_size=8, in_channels=4, depth=2, hidden_size=32, num_heads=4, num_classes=10)


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(3, 4, 8, 8, generator=g),
        torch.rand(3, generator=g),
        torch.randint(0, 10, (3,), generator=g),
    )


def test_defaults_are_sits_tanh_gelu():
    assert SIT_SWITCHES["mlp_act"] == VIT5_SWITCHES["mlp_act"] == "gelu_tanh"


def test_sit_value_reduces_exactly_to_sit():
    sit = _randomized(create_model("SiT-S/2", **TINY))
    explicit = create_model("SiT-S/2", **TINY, mlp_act="gelu_tanh")
    explicit.load_state_dict(sit.state_dict())
    vit5_at_sit = create_model("ViT5-S/2", **TINY, **SIT_SWITCHES)
    vit5_at_sit.load_state_dict(sit.state_dict(), strict=False)
    x, t, y = _inputs()
    assert torch.equal(explicit.eval()(x, t, y), sit(x, t, y))
    assert torch.equal(vit5_at_sit.eval()(x, t, y), sit(x, t, y))


def test_activations_match_their_closed_forms_and_differ():
    x = torch.linspace(-6, 6, 2001, dtype=torch.float64)
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf_form = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    tanh_act, exact_act = Mlp(4, 8).act, Mlp(4, 8, "gelu").act
    torch.testing.assert_close(tanh_act(x), tanh_form, rtol=0, atol=1e-12)
    torch.testing.assert_close(exact_act(x), erf_form, rtol=0, atol=1e-12)
    gap = (tanh_form - erf_form).abs().max().item()
    assert 1e-4 < gap < 1e-3  # the approximation is close but not exact


def test_exact_gelu_changes_the_model_function():
    sit = _randomized(create_model("SiT-S/2", **TINY))
    exact = create_model("SiT-S/2", **TINY, mlp_act="gelu")
    exact.load_state_dict(sit.state_dict())
    x, t, y = _inputs()
    assert not torch.equal(exact.eval()(x, t, y), sit(x, t, y))
    assert (
        isinstance(exact.blocks[0].mlp.act, torch.nn.GELU)
        and exact.blocks[0].mlp.act.approximate == "none"
    )


def test_bad_value_is_a_clear_error():
    with pytest.raises(ValueError, match="mlp_act='relu'"):  # checked once, where the model is built
        create_model("ViT5-S/2", depth=1, hidden_size=32, num_heads=2, mlp_act="relu")
    with pytest.raises(ConfigError, match="mlp_act"):
        load_config(None, ["model.name=ViT5-S/2", "model.mlp_act=relu"])
