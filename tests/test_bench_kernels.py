"""The speed-ups of issue 7 compute the same numbers as the defining formulas (fp32: bitwise on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sit_vit5.models import create_model
from sit_vit5.models.kernels import Rotation, _RMSNormFunction
from sit_vit5.models.layers import RMSNorm
from sit_vit5.models.rope import apply_rope, rope_angles_2d

TINY = dict(input_size=8, in_channels=4, depth=2, hidden_size=64, num_heads=4, num_classes=10)


def _tables(n_side: int = 4, head_dim: int = 16, dtype: torch.dtype = torch.float32):
    ang = rope_angles_2d(head_dim, 100.0, (n_side, n_side), (n_side, n_side))
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope on (B, H, N, d), for x laid out (B, N, H, d) as Rotation takes it."""
    return apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rotation_is_bitwise_the_rope_formula(dtype):
    cos, sin = _tables(dtype=dtype)
    x = torch.randn(2, 16, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    rotation = Rotation(cos, sin)
    assert (rotation.cis is not None) == (dtype != torch.bfloat16)  # complex form only with a complex dtype
    assert torch.equal(rotation(x), _reference_rope(x, cos, sin))


def test_real_form_used_under_compile_is_bitwise_the_formula_too(monkeypatch):
    cos, sin = _tables()
    x = torch.randn(2, 16, 3, 16, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(Rotation(cos, sin)(x), _reference_rope(x, cos, sin))


def test_rotation_gradient_is_the_inverse_rotation():
    cos, sin = _tables(dtype=torch.float64)
    x = torch.randn(2, 16, 3, 16, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(Rotation(cos, sin), (x,))
    g = torch.randn(2, 16, 3, 16, dtype=torch.float64)
    (grad,) = torch.autograd.grad(Rotation(cos, sin)(x), x, g)
    assert torch.allclose(grad, _reference_rope(g, cos, -sin))  # rotations are orthogonal: R^T = R(-angle)


def test_rope_operands_are_cached_and_follow_a_replaced_table():
    model = create_model("ViT5-S/2", **TINY)
    key = ((4, 4), torch.device("cpu"), torch.float32)
    first = model.rope(*key)
    assert model.rope(*key) is first  # prepared once, not per call
    cos, sin = model.rope.tables(*key)
    model.rope._cache[key] = (cos.clone(), -sin)  # a replaced table (e.g. mirrored coordinates) is picked up
    assert model.rope(*key) is not first and torch.equal(model.rope(*key).source[1], -sin)


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_function_forward_is_bitwise_f_rms_norm(affine):
    x = torch.randn(3, 5, 8, 16, generator=torch.Generator().manual_seed(2))
    weight = torch.rand(16) + 0.5 if affine else None
    reference = F.rms_norm(x, (16,), eps=1e-6)
    reference = reference * weight if affine else reference
    assert torch.equal(_RMSNormFunction.apply(x, weight, 1e-6), reference)


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_function_backward_matches_finite_differences(affine):
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    inputs = (x, (torch.rand(8, dtype=torch.float64) + 0.5).requires_grad_()) if affine else (x, None)
    assert torch.autograd.gradcheck(lambda a, w: _RMSNormFunction.apply(a, w, 1e-6), inputs)
    y = _RMSNormFunction.apply(*inputs, 1e-6)
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)
    with pytest.raises(RuntimeError):  # second derivatives are refused rather than silently wrong
        torch.autograd.grad(g.sum(), x)


def test_rms_norm_bf16_is_computed_in_fp32_and_returns_bf16():
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16  # no promotion to fp32 by the fp32 weight
    expected = F.rms_norm(x.bfloat16().float(), (16,), eps=1e-6) * norm.weight
    assert torch.equal(out, expected.bfloat16())  # one rounding, after the weight


def test_residual_stream_is_contiguous():
    model = create_model("SiT-S/2", **TINY)
    tokens = model.x_embedder(torch.randn(2, 4, 8, 8))
    assert tokens.is_contiguous()  # a transposed view would make every later norm copy and every add strided
    out = model.blocks[0](tokens, torch.randn(2, 64))
    assert out.is_contiguous()


@pytest.mark.parametrize("backbone", ["SiT", "ViT5"])
def test_model_is_bitwise_the_formula_implementation(backbone, monkeypatch):
    """Whole model, fp32 CPU: the fast RMSNorm and RoPE give exactly the outputs of the defining formulas."""
    model = create_model(f"{backbone}-S/2", **TINY).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + float(p.dim() == 1 and p.numel() < 64))
    x, t, y = torch.randn(3, 4, 8, 8, generator=gen), torch.rand(3, generator=gen), torch.tensor([1, 2, 3])
    fast = model(x, t, y)

    def formula_norm(self, x):
        out = F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)
        return out * self.weight if self.weight is not None else out

    monkeypatch.setattr(RMSNorm, "forward", formula_norm)
    monkeypatch.setattr(Rotation, "__call__", lambda self, x: _reference_rope(x, *self.source))
    assert torch.equal(fast, model(x, t, y))
