"""Issue 21 item 6: the fused QK-norm + RoPE node computes the unfused chain's numbers (CPU fp32: forward
and gradients bitwise equal), is the inverse-rotation-then-RMSNorm derivative (fp64 gradcheck), and is
taken only where it applies (CPU fp32 eager with RoPE and a weighted RMSNorm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sit_vit5.models import create_model, layers
from sit_vit5.models.kernels import _QKNormRopeFunction
from sit_vit5.models.layers import RMSNorm, norm_and_rotate
from sit_vit5.models.rope import RopeTables, apply_rope

TINY = dict(input_size=8, in_channels=4, depth=2, hidden_size=64, num_heads=4, num_classes=10)


def _rotation(dtype: torch.dtype = torch.float32, num_registers: int = 4):
    tables = RopeTables(16, (4, 4), 10000.0, num_registers, 100.0)
    return tables((4, 4), torch.device("cpu"), dtype)


def _norm(dtype: torch.dtype = torch.float32) -> RMSNorm:
    norm = RMSNorm(16).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=torch.Generator().manual_seed(5), dtype=dtype) + 0.5)
    return norm


def _formula(x: torch.Tensor, norm: RMSNorm, rotation) -> torch.Tensor:
    """The defining chain: F.rms_norm, weight, apply_rope with the cos/sin tables (x is (B, N, H, d))."""
    normed = F.rms_norm(x, (x.shape[-1],), eps=norm.eps) * norm.weight
    cos, sin = rotation.source
    return apply_rope(normed.transpose(1, 2), cos, sin).transpose(1, 2)


def _q_slice(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A qkv activation (B, N, 3, H, d) and its q slice: strided, as Attention hands it over."""
    qkv = torch.randn(2, 20, 3, 2, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return qkv, qkv[:, :, 0]


def test_fused_node_is_bitwise_the_unfused_chain_forward_and_backward():
    rotation, norm = _rotation(), _norm()
    qkv, q = _q_slice()
    grad_out = torch.randn(2, 20, 2, 16, generator=torch.Generator().manual_seed(6))
    unfused = rotation(norm(q))  # RMSNorm module + Rotation: the previous code path
    g_unfused = torch.autograd.grad(unfused, (qkv, norm.weight), grad_out)
    fused = norm_and_rotate(q, norm, rotation)
    assert type(fused.grad_fn).__name__ == "_QKNormRopeFunctionBackward"
    g_fused = torch.autograd.grad(fused, (qkv, norm.weight), grad_out)
    assert torch.equal(fused, unfused)
    assert all(torch.equal(a, b) for a, b in zip(g_fused, g_unfused))
    # and the defining formula (F.rms_norm composite + rotate_half RoPE): forward bitwise, gradients within
    # fp32 rounding of the reduction order (autograd's composite backward sums in another order)
    reference = _formula(q, norm, rotation)
    g_reference = torch.autograd.grad(reference, (qkv, norm.weight), grad_out)
    assert torch.equal(fused, reference)
    for a, b in zip(g_fused, g_reference):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_fused_node_gradient_is_the_exact_derivative():
    rotation, norm = _rotation(torch.float64), _norm(torch.float64)
    x = torch.randn(2, 20, 2, 16, dtype=torch.float64, requires_grad=True)
    weight = norm.weight.detach().clone().requires_grad_()

    def fused(a, w):
        return _QKNormRopeFunction.apply(a, w, 1e-6, rotation.cis, rotation.cis_conj)

    assert torch.autograd.gradcheck(fused, (x, weight))
    assert torch.allclose(fused(x, weight), _formula(x, norm, rotation), rtol=0, atol=1e-12)
    y = fused(x, weight)
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)
    with pytest.raises(RuntimeError):  # second derivatives are refused rather than silently wrong
        torch.autograd.grad(g.sum(), x)


def test_fusion_is_taken_only_where_it_applies(monkeypatch):
    rotation, norm = _rotation(), _norm()
    _, q = _q_slice()
    name = "_QKNormRopeFunctionBackward"
    assert type(norm_and_rotate(q, norm, rotation).grad_fn).__name__ == name
    assert type(norm_and_rotate(q, norm, None).grad_fn).__name__ != name  # QK-norm without RoPE
    assert type(norm_and_rotate(q, RMSNorm(16, affine=False), rotation).grad_fn).__name__ != name
    identity = norm_and_rotate(q, torch.nn.Identity(), rotation)  # RoPE without QK-norm
    assert torch.equal(identity, rotation(q))
    bf16 = norm_and_rotate(q.bfloat16(), norm, _rotation(torch.bfloat16))  # in fp32 inside the node
    assert type(bf16.grad_fn).__name__ == name and bf16.dtype == torch.bfloat16
    from sit_vit5.models.kernels import Rotation

    cos, sin = _rotation(torch.bfloat16).source  # bf16 tables without fp32 ones: the real form
    assert type(norm_and_rotate(q.bfloat16(), norm, Rotation(cos, sin)).grad_fn).__name__ != name
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # inductor gets the real form
    assert type(norm_and_rotate(q, norm, rotation).grad_fn).__name__ != name


def test_vit5_model_with_fusion_equals_the_unfused_model(monkeypatch):
    """Whole ViT5, fp32 CPU, random weights: output and every gradient bitwise equal with and without the
    fused node (and the fused node is used in every block)."""
    model = create_model("ViT5-S/2", **TINY).train()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + float(p.dim() == 1 and p.numel() < 64))
    x, t, y = torch.randn(3, 4, 8, 8, generator=gen), torch.rand(3, generator=gen), torch.tensor([1, 2, 3])
    calls = []
    fused_apply = _QKNormRopeFunction.apply
    monkeypatch.setattr(_QKNormRopeFunction, "apply", lambda *a: calls.append(1) or fused_apply(*a))

    def run():
        torch.manual_seed(0)  # label dropout
        out = model(x, t, y)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        return out, grads

    out, grads = run()
    assert len(calls) == 2 * TINY["depth"]  # q and k in every block
    monkeypatch.setattr(layers, "norm_and_rotate", lambda a, norm, rope: norm(a) if rope is None else rope(norm(a)))
    out_ref, grads_ref = run()
    assert len(calls) == 2 * TINY["depth"]  # the reference run did not go through the fused node
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fused_node_is_the_unfused_chain_within_its_rounding(dtype):
    """bf16/fp16 q (autocast): the fused node (fp32 inside, one rounding) against the unfused chain it
    replaces (fp32 norm rounded to bf16, then the real-form rotation in bf16) and the fp32 formula; forward and
    gradients, through the strided q slice of a qkv activation."""
    rotation, norm = _rotation(dtype), _norm()
    qkv, q = _q_slice()
    half = q.to(dtype)
    grad_out = torch.randn(2, 20, 2, 16, generator=torch.Generator().manual_seed(6)).to(dtype)
    fused = norm_and_rotate(half, norm, rotation)
    assert type(fused.grad_fn).__name__ == "_QKNormRopeFunctionBackward" and fused.dtype == dtype
    unfused = rotation(norm(half))  # the previous code path: Rotation's real form in the half dtype
    assert type(unfused.grad_fn).__name__ != "_QKNormRopeFunctionBackward"
    exact = _formula(half.float(), norm, _rotation(torch.float32))
    g_fused = torch.autograd.grad(fused, (qkv, norm.weight), grad_out)
    g_unfused = torch.autograd.grad(unfused, (qkv, norm.weight), grad_out)
    g_exact = torch.autograd.grad(exact, (qkv, norm.weight), grad_out.float())
    eps = torch.finfo(dtype).eps  # 2^-7 (bf16), 2^-10 (fp16): one rounding of a value near 1
    scale = exact.abs().max()
    assert (fused.float() - exact).abs().max() <= eps * scale  # one rounding of the fp32 result
    assert (fused.float() - unfused.float()).abs().max() <= 4 * eps * scale  # the old path: a few more
    assert (unfused.float() - exact).abs().max() > (fused.float() - exact).abs().max()  # and no closer
    for a, b, c in zip(g_fused, g_unfused, g_exact):
        assert a.dtype == c.dtype == torch.float32
        assert (a - c).abs().max() <= 2 * eps * c.abs().max()
        assert (a - b).abs().max() <= 8 * eps * c.abs().max()
