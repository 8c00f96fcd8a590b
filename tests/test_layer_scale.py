"""ViT-5's LayerScale in the generative setting: the default, the named settings, the reduction to SiT, the
official weight-decay rule, the official SwiGLU, and the gate diagnostics logged during training."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from sit_vit5.models import SIT_SWITCHES, VIT5_SWITCHES, create_model
from sit_vit5.models.vit5 import LAYER_SCALE_INITS
from sit_vit5.training.diagnostics import GateMonitor
from sit_vit5.training.optim import param_groups

TINY = dict(input_size=8, in_channels=4, depth=2, hidden_size=64, num_heads=4, num_classes=10)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def inputs(b: int = 3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 4, 8, 8, generator=g), torch.rand(b, generator=g), torch.randint(0, 10, (b,), generator=g)


def test_named_layer_scale_inits_and_the_default():
    assert LAYER_SCALE_INITS == {"generative": 1.0, "classification": 1e-4}
    model = create_model("ViT5-S/2", **TINY)
    assert VIT5_SWITCHES["layer_scale_init"] == 1.0  # the generative default (results/digits)
    for block in model.blocks:
        assert torch.all(block.gamma_1 == 1.0) and torch.all(block.gamma_2 == 1.0)
    assert torch.equal(model(*inputs()), torch.zeros(3, model.out_channels, 8, 8))  # still exactly 0 at init
    for name, value in LAYER_SCALE_INITS.items():
        block = create_model("ViT5-S/2", **TINY, layer_scale_init=name).blocks[1]
        assert torch.all(block.gamma_1 == value) and torch.all(block.gamma_2 == value)
    assert create_model("ViT5-S/2", **TINY, layer_scale_init=None).blocks[0].gamma_1 is None
    with pytest.raises(ValueError, match="layer_scale_init='lamb'.*classification"):
        create_model("ViT5-S/2", **TINY, layer_scale_init="lamb")


@pytest.mark.parametrize("backbone", ["SiT", "ViT5"])
def test_named_layer_scale_inits_build_every_backbone(backbone):
    """The config accepts the names for any backbone: every model constructor resolves them
    (SiT-* used to get float("generative"))."""
    for name, value in LAYER_SCALE_INITS.items():
        model = create_model(f"{backbone}-S/2", **TINY, layer_scale_init=name)
        assert model.config.layer_scale_init == value  # config.json records the number
        for block in model.blocks:
            assert torch.all(block.gamma_1 == value) and torch.all(block.gamma_2 == value)
    with pytest.raises(ValueError, match="layer_scale_init='lamb'.*classification"):
        create_model(f"{backbone}-S/2", **TINY, layer_scale_init="lamb")


@pytest.mark.parametrize("layer_scale_init", [None, 1.0, "generative"])
def test_sit_switches_with_unit_layer_scale_are_exactly_sit(layer_scale_init):
    """γ0 = 1 starts as the same function as no LayerScale: with every other switch at its SiT value the
    ViT5 class is bit-for-bit SiT (the gammas are the only extra parameters)."""
    sit = randomize(create_model("SiT-S/2", **TINY))
    vit5 = create_model("ViT5-S/2", **TINY, **{**SIT_SWITCHES, "layer_scale_init": layer_scale_init}).eval()
    extra = set(vit5.state_dict()) - set(sit.state_dict())
    assert extra == (set() if layer_scale_init is None else {f"blocks.{i}.gamma_{j}" for i in (0, 1) for j in (1, 2)})
    vit5.load_state_dict(sit.state_dict(), strict=False)
    x, t, y = inputs()
    assert torch.equal(vit5(x, t, y), sit(x, t, y))


def test_every_vit5_switch_moves_the_function_away_from_sit():
    """Each ViT-5 switch, alone on top of SiT's values, changes the function (it is wired), and all of them at
    SiT's values give SiT (tested above and in test_models)."""
    sit = randomize(create_model("SiT-S/2", **TINY))
    x, t, y = inputs()
    reference = sit(x, t, y)
    for key, value in VIT5_SWITCHES.items():
        if value == SIT_SWITCHES[key] or key in ("rope_theta", "register_rope_theta"):
            continue  # shared value, or only meaningful with rope / registers on
        model = create_model("ViT5-S/2", **TINY, **{**SIT_SWITCHES, key: value})
        model.load_state_dict(sit.state_dict(), strict=False)
        if key == "pos_embed":  # learned APE starts as the fixed table: it differs by being trained
            assert model.pos_embed.requires_grad and not sit.pos_embed.requires_grad
            continue
        randomize(model, seed=1) if key == "layer_scale_init" else model.eval()
        assert not torch.equal(model(x, t, y), reference), key


def test_official_swiglu_is_full_width_and_bias_free():
    d = TINY["hidden_size"]
    official = create_model("ViT5-S/2", **TINY, mlp="swiglu_vit5").blocks[0].mlp
    ours = create_model("ViT5-S/2", **TINY, mlp="swiglu").blocks[0].mlp
    gelu = create_model("ViT5-S/2", **TINY).blocks[0].mlp
    assert sum(p.numel() for p in official.parameters()) == 12 * d * d  # three 4D x D matrices
    assert all(p.ndim == 2 for p in official.parameters())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert abs(count(ours) - count(gelu)) / count(gelu) < 0.01  # ours: FLOP/parameter matched


def test_weight_decay_groups_follow_the_official_vit5_rule():
    model = create_model("ViT5-S/2", **TINY)
    groups = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups[0]["params"]}
    exempt = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.05 and groups[1]["weight_decay"] == 0.0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert decayed | exempt == trainable and not decayed & exempt
    for name in ("blocks.0.gamma_1", "blocks.1.gamma_2", "blocks.0.attn.q_norm.weight", "pos_embed",
                 "register_tokens", "blocks.0.attn.proj.bias", "blocks.0.mlp.fc1.bias", "x_embedder.proj.bias"):
        assert name in exempt, name
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "x_embedder.proj.weight",
                 "y_embedder.embedding_table.weight", "blocks.0.adaLN_modulation.1.weight"):
        assert name in decayed, name
    assert len(param_groups(model, 0.0)) == 1  # the SiT recipe: one group, as older checkpoints have


def test_weight_decay_groups_in_an_adamw_step():
    """With zero gradients AdamW only decays: decayed weights shrink by lr·wd, exempt ones stay put."""
    model = randomize(create_model("ViT5-S/2", **TINY)).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["blocks.0.attn.qkv.weight"], before["blocks.0.attn.qkv.weight"] * (1 - 1e-3))
    for name in ("blocks.0.gamma_1", "pos_embed", "register_tokens", "blocks.0.attn.proj.bias"):
        assert torch.equal(after[name], before[name]), name


def test_gate_monitor_matches_a_hand_computation():
    model = randomize(create_model("ViT5-S/2", **TINY, layer_scale_init=1.0))
    with torch.no_grad():
        model.blocks[1].gamma_2.mul_(0.5)
    x, t, y = inputs(4)
    monitor = GateMonitor(model)
    model(x, t, y)
    assert monitor.metrics() == {}  # nothing captured outside capture()
    with monitor.capture():
        model(x, t, y)
    metrics = monitor.metrics()
    assert set(metrics) == set(monitor.keys) and all(math.isfinite(v) for v in metrics.values())
    c = model.t_embedder(t) + model.y_embedder(y, False)
    for i, block in enumerate(model.blocks):
        chunks = block.adaLN_modulation(c).chunk(6, dim=1)
        for branch, chunk, gamma in (("attn", 2, block.gamma_1), ("mlp", 5, block.gamma_2)):
            gate = chunks[chunk] * gamma
            assert metrics[f"gate/{branch}/{i:02d}"] == pytest.approx(gate.abs().mean().item(), rel=1e-5)
            spread = gate.std(dim=0, unbiased=False).mean().item()
            assert metrics[f"gate_spread/{branch}/{i:02d}"] == pytest.approx(spread, rel=1e-5)
    assert metrics["gate/mlp/mean"] == pytest.approx((metrics["gate/mlp/00"] + metrics["gate/mlp/01"]) / 2)
    assert len(model._forward_hooks) == 0 and all(len(b.adaLN_modulation._forward_hooks) == 0 for b in model.blocks)


@pytest.mark.parametrize("name", ["SiT-S/2", "ViT5-S/2"])
def test_training_logs_finite_gate_rows(tmp_path, name):
    from sit_vit5.config import load_config
    from sit_vit5.training import train

    cfg = load_config("configs/digits/repro.yaml", [
        f"model.name={name}", "model.depth=2", "model.hidden_size=32", "model.num_heads=2", "train.steps=4",
        "train.log_every=2", "train.sample_every=0", "train.ckpt_every=4", "data.global_batch_size=8",
        "optim.weight_decay=0.05", f"train.out_dir={tmp_path}"])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        gates = {k: v for k, v in row.items() if k.startswith("gate")}
        assert len(gates) == 2 + 2 * 2 * 2 and all(math.isfinite(v) and v >= 0 for v in gates.values())
    assert rows[0]["gate/attn/mean"] < rows[-1]["gate/attn/mean"]  # zero-init gates open after two updates
    with open(tmp_path / "metrics.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert float(csv_rows[-1]["gate/mlp/01"]) == pytest.approx(rows[-1]["gate/mlp/01"])
