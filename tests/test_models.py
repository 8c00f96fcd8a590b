"""Backbones: shapes, init, SiT == ViT-5 with SiT switches, RoPE, registers, resolution, CFG, counts."""

from __future__ import annotations

import math

import pytest
import torch

from sit_vit5.models import (
    SIT_SWITCHES,
    VIT5_SWITCHES,
    count_params,
    create_model,
    flops,
    list_models,
)
from sit_vit5.models.layers import sincos_pos_embed_2d
from sit_vit5.models.rope import apply_rope, rope_angles_2d
from tests.helpers import naming

TINY = dict(input_size=8, in_channels=4, depth=2, hidden_size=64, num_heads=4, num_classes=10)


def randomize(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> torch.nn.Module:
    """Random weights everywhere (the zero init would make every comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 and p.numel() < 64 else 0.0))
    return model.eval()


def inputs(b: int = 3, c: int = 4, side: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, side, side, generator=g)
    return x, torch.rand(b, generator=g), torch.randint(0, 10, (b,), generator=g)


@pytest.mark.parametrize("name", list_models())
def test_every_registered_name_builds_with_right_shapes(name):
    with torch.device("meta"):  # full size, no memory: shapes only
        model = create_model(name, input_size=32)
        out = model(torch.empty(2, 4, 32, 32), torch.empty(2), torch.zeros(2, dtype=torch.long))
    assert out.shape == (2, 8, 32, 32)  # learn_sigma (the default): the full 2C output


def test_sit_xl2_parameter_and_flop_counts_match_published():
    with torch.device("meta"):
        model = create_model("SiT-XL/2", input_size=32)
    assert count_params(model) == 675_129_632
    assert flops(model) == pytest.approx(118.6, abs=0.1)
    assert count_params(model, trainable_only=True) == 675_129_632 - 256 * 1152  # frozen pos-embed


def test_flops_match_hand_count_for_tiny_models():
    d, p, c_in, c_out = 64, 2, 4, 8
    for side in (8, 16):
        n = (side // p) ** 2
        block = 6 * d * d + n * (3 * d * d + d * d + 8 * d * d) + 2 * n * n * d
        embed, final = n * c_in * p * p * d + 256 * d + d * d, 2 * d * d + n * d * p * p * c_out
        assert flops(create_model("SiT-S/2", **TINY), side) * 1e9 == pytest.approx(embed + 2 * block + final)
        n5 = n + 4  # four registers join every block (and leave before the output layer)
        block5 = 6 * d * d + n5 * 12 * d * d + 2 * n5 * n5 * d
        assert flops(create_model("ViT5-S/2", **TINY), side) * 1e9 == pytest.approx(embed + 2 * block5 + final)


@pytest.mark.parametrize("backbone", ["SiT", "ViT5"])
def test_output_is_exactly_zero_at_init(backbone):
    model = create_model(f"{backbone}-S/2", **TINY)
    x, t, y = inputs()
    assert torch.equal(model(x, t, y), torch.zeros(len(x), model.out_channels, *x.shape[2:]))


def test_learn_sigma_output_has_both_halves():
    model = randomize(create_model("SiT-S/2", **TINY, learn_sigma=True))
    assert model.final_layer.linear.out_features == 2 * 2 * 8
    assert model(*inputs()).shape == (3, 8, 8, 8)  # as DiT: the objective reads the half it needs


def test_vit5_with_sit_switches_is_exactly_sit():
    sit = randomize(create_model("SiT-S/2", **TINY))
    vit5 = create_model("ViT5-S/2", **TINY, **SIT_SWITCHES).eval()
    vit5.load_state_dict(sit.state_dict(), strict=True)
    x, t, y = inputs()
    assert torch.equal(vit5(x, t, y), sit(x, t, y))


def test_sit_matches_independent_timm_reference():
    pytest.importorskip("timm")
    from bench.timm_reference import TimmSiT

    ours = create_model("SiT-S/2", **TINY, learn_sigma=True)
    ref = TimmSiT(input_size=8, hidden_size=64, depth=2, num_heads=4, num_classes=10).eval()
    assert torch.equal(ref.pos_embed, ours.pos_embed)  # independent numpy sin-cos table
    randomize(ours)
    ref.load_state_dict(ours.state_dict(), strict=True)
    x, t, y = inputs()
    assert (ours(x, t, y)[:, : x.shape[1]] - ref(x, t, y)).abs().max() <= 1e-5  # the reference drops sigma, as SiT


def test_vit5_recipe_components_are_present():
    model = create_model("ViT5-S/2", **TINY)
    keys = model.state_dict().keys()
    assert "register_tokens" in keys and model.register_tokens.shape == (1, 4, 64)
    assert "blocks.0.attn.q_norm.weight" in keys and "blocks.0.attn.k_norm.weight" in keys
    assert "blocks.0.attn.qkv.bias" not in keys and "blocks.0.attn.proj.bias" in keys
    assert torch.all(model.blocks[0].gamma_1 == 1.0)  # the generative LayerScale init (vit5.py)
    assert model.pos_embed.requires_grad
    assert torch.allclose(model.pos_embed[0], sincos_pos_embed_2d(64, 4))
    assert type(model.blocks[0].norm1).__name__ == "RMSNorm"
    assert model.blocks[0].mlp.act.approximate == "tanh"
    assert set(VIT5_SWITCHES) == set(SIT_SWITCHES)


def test_sincos_table_layout_columns_first():
    table = sincos_pos_embed_2d(8, 3)  # (9, 8): [col sin(2), col cos(2), row sin(2), row cos(2)]
    idx = lambda r, c: 3 * r + c  # noqa: E731
    assert torch.equal(table[idx(2, 1), :4], table[idx(0, 1), :4])  # first half depends on the column only
    assert torch.equal(table[idx(1, 0), 4:], table[idx(1, 2), 4:])  # second half on the row only
    assert table[idx(0, 1), 0] == pytest.approx(math.sin(1.0))
    assert table[idx(2, 0), 5] == pytest.approx(math.sin(2 * 1e-2))


def test_rope_depends_only_on_relative_offset():
    hd, grid = 16, (6, 6)
    ang = rope_angles_2d(hd, 10000.0, grid, grid).float()
    cos, sin = ang.cos(), ang.sin()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    rq = apply_rope(q.expand(36, hd), cos, sin)
    rk = apply_rope(k.expand(36, hd), cos, sin)
    idx = lambda r, c: 6 * r + c  # noqa: E731
    dot = lambda a, b: float(rq[idx(*a)] @ rk[idx(*b)])  # noqa: E731
    assert dot((0, 0), (2, 3)) == pytest.approx(dot((3, 1), (5, 4)), abs=1e-5)
    assert dot((1, 4), (0, 1)) == pytest.approx(dot((5, 5), (4, 2)), abs=1e-5)
    assert abs(dot((0, 0), (2, 3)) - dot((0, 0), (3, 2))) > 1e-3  # but it does depend on the offset
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(36), atol=1e-5)  # rotations keep norms


def test_rope_split_rows_first_half_columns_second():
    ang = rope_angles_2d(8, 10000.0, (3, 3), (3, 3))
    assert torch.equal(ang[4, :4], torch.tensor([1.0, 1.0, 1e-2, 1e-2], dtype=torch.float64))  # row 1
    assert torch.equal(ang[4, 4:], ang[1, 4:])  # column 1 in both tokens
    assert torch.equal(ang[2, :4], torch.zeros(4, dtype=torch.float64))  # row 0


def test_registers_have_their_own_rope_grid_and_theta():
    model = create_model("ViT5-S/2", **TINY)
    hd = 16
    full = model.rope.angles((4, 4))
    regs = full[16:]
    assert torch.equal(regs, rope_angles_2d(hd, 100.0, (2, 2), (2, 2)))
    assert not torch.allclose(regs, rope_angles_2d(hd, 10000.0, (2, 2), (2, 2)))
    assert regs[3, 2].item() == pytest.approx(100 ** (-2 / 8))  # register (1, 1), second frequency
    assert torch.equal(model.rope.angles((8, 8))[64:], regs)  # unaffected by the patch grid
    with pytest.raises(ValueError, match=naming("num_registers", "3")):
        create_model("ViT5-S/2", **TINY, num_registers=3)
    create_model("ViT5-S/2", **TINY, num_registers=3, register_rope_theta=None)  # fine without register RoPE


def _mirror_columns(model, grid):
    """Give RoPE mirrored column coordinates (c -> W-1-c) for this grid."""
    ang = model.rope.angles(grid)
    n = grid[0] * grid[1]
    patches = ang[:n].reshape(*grid, -1).flip(1).reshape(n, -1)
    ang = torch.cat([patches, ang[n:]])
    model.rope._cache[(grid, torch.device("cpu"), torch.float32)] = (ang.cos().float(), ang.sin().float())


def flip_patch_grid(x: torch.Tensor, p: int = 2) -> torch.Tensor:
    """Reverse the order of patch columns, keeping the pixels inside each patch as they are."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h, w // p, p).flip(3).reshape(b, c, h, w)


@pytest.mark.parametrize("pos_embed,equivariant", [("none", True), ("learned", False)])
def test_flip_seen_by_rope_only_model_is_just_mirrored_coordinates(pos_embed, equivariant):
    """Paper §3.4: RoPE alone carries no absolute left/right. A RoPE-only model sees a flipped patch grid
    exactly as the original grid with mirrored coordinates; adding APE pins absolute positions and breaks it."""
    model = randomize(create_model("ViT5-S/2", **TINY, pos_embed=pos_embed))
    x, t, y = inputs()
    out_flipped_input = model(flip_patch_grid(x), t, y)
    _mirror_columns(model, (4, 4))
    out_mirrored = flip_patch_grid(model(x, t, y))
    assert torch.allclose(out_flipped_input, out_mirrored, atol=1e-5) == equivariant
    assert not torch.allclose(out_flipped_input, model(x, t, y), atol=1e-3)  # the flip is visible at all


@pytest.mark.parametrize("backbone", ["SiT", "ViT5"])
def test_any_resolution_and_exact_at_training_size(backbone):
    model = randomize(create_model(f"{backbone}-S/2", **TINY))
    assert model.pos_embed_for((4, 4)) is model.pos_embed  # no resampling at the training size
    x, t, y = inputs(side=16)
    out = model(x, t, y)
    assert out.shape == (len(x), model.out_channels, *x.shape[2:]) and torch.isfinite(out).all()
    small = model(x[..., :8, :8], t, y)  # back to the training size: unaffected by the larger call
    again = randomize(create_model(f"{backbone}-S/2", **TINY))(x[..., :8, :8], t, y)
    assert torch.equal(small, again)
    table = model.pos_embed_for((8, 8)).reshape(8, 8, -1)
    assert table.shape == (8, 8, 64)
    rect = model(torch.randn(2, 4, 8, 12), t[:2], y[:2])
    assert rect.shape == (2, model.out_channels, 8, 12)


def test_rope_positions_rescaled_to_training_grid():
    model = create_model("ViT5-S/2", **TINY)
    base = model.rope.angles((4, 4))[:16].reshape(4, 4, -1)
    big = model.rope.angles((8, 8))[:64].reshape(8, 8, -1)
    assert torch.allclose(big[::2, ::2], base)  # even positions of the 8-grid = integer positions of the 4-grid
    assert torch.allclose(big[1, 0, :8], base[1, 0, :8] / 2)  # row 1 of 8 maps to position 0.5


def test_rope_tables_are_cached_not_rebuilt():
    model = create_model("ViT5-S/2", **TINY).eval()
    x, t, y = inputs()
    model(x, t, y)
    cached = dict(model.rope._cache)
    model(x, t, y)
    assert len(model.rope._cache) == 1 and all(model.rope._cache[k][0] is cached[k][0] for k in cached)


def test_forward_with_cfg_scale_one_and_legacy_channels():
    model = randomize(create_model("SiT-S/2", **TINY))
    x, t, y = inputs()
    z, tt, yy = torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, 10)])
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, 10))
    assert torch.allclose(model.forward_with_cfg(z, tt, yy, 1.0)[:3], cond, atol=1e-6)
    full = model.forward_with_cfg(z, tt, yy, 4.0)
    assert torch.allclose(full[:3], uncond + 4.0 * (cond - uncond), atol=1e-5)
    legacy = model.forward_with_cfg(z, tt, yy, 4.0, cfg_channels=3)
    assert torch.allclose(legacy[:3, :3], full[:3, :3], atol=1e-6)
    assert torch.allclose(legacy[:3, 3], cond[:, 3], atol=1e-6)  # channel 3 unguided
    assert torch.allclose(legacy[3:, 3], uncond[:, 3], atol=1e-6)  # as in the official code


def test_grad_checkpointing_gives_identical_gradients():
    torch.manual_seed(0)
    a = randomize(create_model("ViT5-S/2", **TINY, class_dropout_prob=0.0)).train()
    b = randomize(create_model("ViT5-S/2", **TINY, class_dropout_prob=0.0, grad_checkpointing=True)).train()
    x, t, y = inputs()
    a(x, t, y).square().mean().backward()
    b(x, t, y).square().mean().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name


def test_bad_names_and_options_are_named_in_errors():
    with pytest.raises(ValueError, match=naming("'SiT-M/2'", "SiT-XL/2", "ViT5-S/2")):
        create_model("SiT-M/2")
    with pytest.raises(ValueError, match="depht"):
        create_model("SiT-S/2", depht=3)
    with pytest.raises(ValueError, match="pos_embed"):
        create_model("ViT5-S/2", **TINY, pos_embed="rotary")
    with pytest.raises(ValueError, match="mlp"):
        create_model("ViT5-S/2", **TINY, mlp="relu")
    with pytest.raises(ValueError, match=naming("(7, 7)", "2")):
        create_model("SiT-S/2", **TINY)(torch.randn(1, 4, 7, 7), torch.rand(1), torch.zeros(1, dtype=torch.long))


def test_swiglu_ablation_matches_gelu_parameter_count():
    gelu = create_model("ViT5-S/2", **TINY)
    swiglu = create_model("ViT5-S/2", **TINY, mlp="swiglu")
    assert abs(count_params(swiglu) - count_params(gelu)) / count_params(gelu) < 0.02
    assert torch.isfinite(randomize(swiglu)(*inputs())).all()


def test_bf16_autocast_forward_runs_with_rope_tables_in_bf16():
    model = randomize(create_model("ViT5-S/2", **TINY))
    x, t, y = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, y)
    assert torch.isfinite(out).all()
    assert (out.float() - model(x, t, y)).abs().max() < 0.1 * model(x, t, y).abs().max() + 0.05
    assert any(k[2] == torch.bfloat16 for k in model.rope._cache)
