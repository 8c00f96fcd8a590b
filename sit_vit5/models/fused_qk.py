"""ViT-5's QK-norm + RoPE as one Triton kernel each way (forward, backward): the CUDA eager path
when switched on (``kernels.fused_qk``; off by default until a GPU has timed it, issue 56).

Per token and per q / k, the kernel reads the H heads once, normalises each head in fp32
(``x * rsqrt(mean(x²) + eps) * weight``), rotates its channel pairs with the fp32 tables and writes
the result once, in the activation's dtype: one pass where the torch ops of
``kernels.qk_norm_rope`` make four forward (fourteen unfused). v is copied beside them: q, k and v
leave as three tensors and their three gradients come back to one kernel, which writes the qkv
gradient whole (no ``torch.stack`` of them, as ``qkv.unbind(2)``'s backward makes; without the v
copy the backward would assemble the qkv gradient from two slices). The backward reads the output
gradients and the activation once, rotates back, runs the RMSNorm backward and writes the qkv
gradient; each program writes its share of the weight gradient to its own row, summed afterwards
(deterministic: no atomics).

The two kernels are registered as torch operators (``sit_vit5::qkv_norm_rope`` and its backward)
with shape-only fake versions, so a trace under ``FakeTensorMode`` (``bench.cost_model``) sees
one op each way. Off CUDA the same operators run :func:`reference` in torch ops (or the Triton
kernels on the CPU under ``TRITON_INTERPRET=1``: the tests).

Shapes: qkv (B, N, 3, H, d), the attention's qkv activation (a strided view is fine); q, k, v
and their gradients (B, N, H, d); q_weight, k_weight (d,) fp32; cos, sin (N, d / 2) fp32, the
angle of channel pair (2i, 2i + 1).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton's CPU interpreter (tests)


@triton.jit
def _weight(qw_ptr, kw_ptr, which, p, half):
    """The norm weight's even and odd channels (1, B_P): q's for ``which`` 0, else k's (both read;
    a select, not a pointer chosen at run time)."""
    pairs = p < half
    we = tl.where(which == 0, tl.load(qw_ptr + 2 * p, mask=pairs, other=0.0),
                  tl.load(kw_ptr + 2 * p, mask=pairs, other=0.0))
    wo = tl.where(which == 0, tl.load(qw_ptr + 2 * p + 1, mask=pairs, other=0.0),
                  tl.load(kw_ptr + 2 * p + 1, mask=pairs, other=0.0))
    return we, wo


@triton.jit
def _forward_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, rstd_ptr,
                    n_pos, stride_tok, heads, half, eps, per_token, BLOCK_H: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)  # one (token, q / k / v): its H heads at once; v only if per_token 3
    tok, which = pid // per_token, pid % per_token
    d = 2 * half
    h = tl.arange(0, BLOCK_H)[:, None]
    p = tl.arange(0, BLOCK_P)[None, :]
    mask = (h < heads) & (p < half)
    src = qkv_ptr + tok * stride_tok + which * heads * d + h * d + 2 * p
    y_ptr = q_ptr
    if which == 1:
        y_ptr = k_ptr
    elif which == 2:
        y_ptr = v_ptr
    dst = y_ptr + tok * heads * d + h * d + 2 * p  # q, k, v (B, N, H, d) contiguous
    x_even = tl.load(src, mask=mask, other=0.0)  # even channels (B_H, B_P), qkv's dtype
    x_odd = tl.load(src + 1, mask=mask, other=0.0)  # odd channels
    if which == 2:  # v passes through (copied: an operator's outputs may not alias its input)
        tl.store(dst, x_even, mask=mask)
        tl.store(dst + 1, x_odd, mask=mask)
    else:
        xe, xo = x_even.to(tl.float32), x_odd.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(xe * xe, 1) + tl.sum(xo * xo, 1)) / d + eps)  # (B_H,)
        we, wo = _weight(qw_ptr, kw_ptr, which, p, half)
        ze = xe * rstd[:, None] * we
        zo = xo * rstd[:, None] * wo
        pos = tok % n_pos
        c = tl.load(cos_ptr + pos * half + p, mask=p < half, other=1.0)
        s = tl.load(sin_ptr + pos * half + p, mask=p < half, other=0.0)
        tl.store(dst, (ze * c - zo * s).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + 1, (ze * s + zo * c).to(y_ptr.dtype.element_ty), mask=mask)
        hs = tl.arange(0, BLOCK_H)
        tl.store(rstd_ptr + (tok * 2 + which) * heads + hs, rstd, mask=hs < heads)


@triton.jit
def _backward_kernel(gq_ptr, gk_ptr, gv_ptr, qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, rstd_ptr,
                     gx_ptr, gw_ptr, n_pos, stride_tok, stride_gq, stride_gk, stride_gv, heads,
                     half, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    tok, which = pid // 3, pid % 3
    d = 2 * half
    h = tl.arange(0, BLOCK_H)[:, None]
    p = tl.arange(0, BLOCK_P)[None, :]
    mask = (h < heads) & (p < half)
    gy_ptr = gq_ptr + tok * stride_gq  # this token's gradient of q, k or v (heads contiguous)
    if which == 1:
        gy_ptr = gk_ptr + tok * stride_gk
    elif which == 2:
        gy_ptr = gv_ptr + tok * stride_gv
    out = pid * heads * d + h * d + 2 * p  # gx: (B, N, 3, H, d) contiguous
    g_even = tl.load(gy_ptr + h * d + 2 * p, mask=mask, other=0.0)
    g_odd = tl.load(gy_ptr + h * d + 2 * p + 1, mask=mask, other=0.0)
    if which == 2:  # v's gradient passes through
        tl.store(gx_ptr + out, g_even, mask=mask)
        tl.store(gx_ptr + out + 1, g_odd, mask=mask)
    else:
        gye, gyo = g_even.to(tl.float32), g_odd.to(tl.float32)
        row = tok * 2 + which
        src = qkv_ptr + tok * stride_tok + which * heads * d + h * d + 2 * p
        hs = tl.arange(0, BLOCK_H)
        rstd = tl.load(rstd_ptr + row * heads + hs, mask=hs < heads, other=0.0)[:, None]
        xe = tl.load(src, mask=mask, other=0.0).to(tl.float32) * rstd  # x_hat, even channels
        xo = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32) * rstd
        pos = tok % n_pos
        c = tl.load(cos_ptr + pos * half + p, mask=p < half, other=1.0)
        s = tl.load(sin_ptr + pos * half + p, mask=p < half, other=0.0)
        gze = gye * c + gyo * s  # the inverse rotation: gradient w.r.t. x_hat * weight
        gzo = gyo * c - gye * s
        ps = tl.arange(0, BLOCK_P)
        tl.store(gw_ptr + row * d + 2 * ps, tl.sum(gze * xe, 0), mask=ps < half)  # its share
        tl.store(gw_ptr + row * d + 2 * ps + 1, tl.sum(gzo * xo, 0), mask=ps < half)
        we, wo = _weight(qw_ptr, kw_ptr, which, p, half)
        ge, go = gze * we, gzo * wo
        dot = ((tl.sum(ge * xe, 1) + tl.sum(go * xo, 1)) / d)[:, None]  # mean(g · x_hat)
        tl.store(gx_ptr + out, (rstd * (ge - xe * dot)).to(gx_ptr.dtype.element_ty), mask=mask)
        tl.store(gx_ptr + out + 1, (rstd * (go - xo * dot)).to(gx_ptr.dtype.element_ty),
                 mask=mask)


def _by_token(t: Tensor) -> tuple[Tensor, int]:
    """(t, the stride between its tokens) for t (B, N, ...) laid out as the kernels read it (each
    token's entries contiguous, tokens evenly spaced: qkv and its views, the gradients of q, k, v);
    otherwise a contiguous copy of t."""
    b, n, inner = t.shape[0], t.shape[1], t.shape[2:]
    packed = tuple(math.prod(inner[i + 1:]) for i in range(len(inner)))
    if t.stride()[2:] != packed or (b > 1 and t.stride(0) != n * t.stride(1)):
        t = t.contiguous()
    return t, t.stride(1)


def _blocks(qkv: Tensor) -> dict:
    heads, half = qkv.shape[3], qkv.shape[4] // 2
    return dict(BLOCK_H=triton.next_power_of_2(heads), BLOCK_P=triton.next_power_of_2(half))


def reference(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
              eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the forward kernel computes, in torch ops (fp32): (q, k, v (B, N, H, d) contiguous in
    qkv's dtype, v a copy of qkv's; rstd (B, N, 2, H))."""
    weight = torch.stack((q_weight, k_weight))  # (2, d): broadcast over (B, N, 2, H, d)
    x = qkv[:, :, :2].float()
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    z = (x * rstd[..., None] * weight[:, None]).unflatten(-1, (-1, 2))  # (B, N, 2, H, d/2, 2)
    c, s = cos[:, None, None], sin[:, None, None]  # (N, 1, 1, d/2)
    ze, zo = z.unbind(-1)
    qk = torch.stack((ze * c - zo * s, ze * s + zo * c), dim=-1).flatten(-2)
    q, k = qk.to(qkv.dtype).unbind(2)
    v = qkv[:, :, 2].clone(memory_format=torch.contiguous_format)
    return q.contiguous(), k.contiguous(), v, rstd


def reference_backward(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qkv: Tensor,
                       q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """What the backward kernel computes, in torch ops (fp32): (grad w.r.t. qkv in its dtype,
    w.r.t. q_weight, w.r.t. k_weight)."""
    grad = torch.stack((grad_q, grad_k, grad_v), dim=2)  # (B, N, 3, H, d)
    weight = torch.stack((q_weight, k_weight))
    x_hat = qkv[:, :, :2].float() * rstd[..., None]
    ge, go = grad[:, :, :2].float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, None], sin[:, None, None]
    gz = torch.stack((ge * c + go * s, go * c - ge * s), dim=-1).flatten(-2)  # rotated back
    grad_weight = gz * x_hat  # summed over (B, N, H) for q's and k's weight below
    g = gz * weight[:, None]
    grad_qk = rstd[..., None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    grad_qkv = torch.cat((grad_qk.to(qkv.dtype), grad[:, :, 2:].to(qkv.dtype)), dim=2)
    return grad_qkv, grad_weight[:, :, 0].sum((0, 1, 2)), grad_weight[:, :, 1].sum((0, 1, 2))


def _use_kernels(qkv: Tensor) -> bool:
    return qkv.is_cuda or _INTERPRET


@torch.library.custom_op("sit_vit5::qkv_norm_rope", mutates_args=())
def qkv_norm_rope(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                  eps: float, copy_v: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k normalised and rotated, v as it is: each (B, N, H, d) contiguous in qkv's dtype;
    rstd (B, N, 2, H) fp32). The weights (d,) are fp32. ``copy_v`` False (no gradient will flow
    back: the caller reads v in place): v is an empty (0,) tensor and is not written."""
    if not _use_kernels(qkv):
        q, k, v, rstd = reference(qkv, q_weight, k_weight, cos, sin, eps)
        return q, k, v if copy_v else v.new_empty(0), rstd
    qkv, stride = _by_token(qkv)
    b, n, _, heads, d = qkv.shape
    q, k = qkv.new_empty((b, n, heads, d)), qkv.new_empty((b, n, heads, d))
    v = qkv.new_empty((b, n, heads, d) if copy_v else 0)
    rstd = torch.empty((b, n, 2, heads), dtype=torch.float32, device=qkv.device)
    per_token = 3 if copy_v else 2
    _forward_kernel[(b * n * per_token,)](qkv, q_weight, k_weight, cos, sin, q, k, v, rstd, n,
                                          stride, heads, d // 2, eps, per_token, **_blocks(qkv))
    return q, k, v, rstd


@qkv_norm_rope.register_fake
def _(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
      copy_v: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b, n, _, heads, d = qkv.shape
    q, k = qkv.new_empty((b, n, heads, d)), qkv.new_empty((b, n, heads, d))
    v = qkv.new_empty((b, n, heads, d) if copy_v else 0)
    return q, k, v, qkv.new_empty((b, n, 2, heads), dtype=torch.float32)


@torch.library.custom_op("sit_vit5::qkv_norm_rope_backward", mutates_args=())
def qkv_norm_rope_backward(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qkv: Tensor,
                           q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                           rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(gradient w.r.t. qkv (B, N, 3, H, d) in its dtype, contiguous; w.r.t. q_weight, k_weight
    (d,) fp32), from the gradients of q, k and v (any strides; one copy each where a token's heads
    are not contiguous)."""
    if not _use_kernels(qkv):
        return reference_backward(grad_q, grad_k, grad_v, qkv, q_weight, k_weight, cos, sin, rstd)
    qkv, stride = _by_token(qkv)
    (grad_q, stride_q), (grad_k, stride_k), (grad_v, stride_v) = map(_by_token,
                                                                     (grad_q, grad_k, grad_v))
    b, n, _, heads, d = qkv.shape
    grad_qkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    shares = torch.empty((b * n, 2, d), dtype=torch.float32, device=qkv.device)
    _backward_kernel[(b * n * 3,)](grad_q, grad_k, grad_v, qkv, q_weight, k_weight, cos, sin,
                                   rstd, grad_qkv, shares, n, stride, stride_q, stride_k,
                                   stride_v, heads, d // 2, **_blocks(qkv))
    # each token's share, summed in a fixed order (two reductions: outputs must not alias)
    return grad_qkv, shares[:, 0].sum(0), shares[:, 1].sum(0)


@qkv_norm_rope_backward.register_fake
def _(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qkv: Tensor, q_weight: Tensor,
      k_weight: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return qkv.new_empty(qkv.shape), q_weight.new_empty(q_weight.shape), k_weight.new_empty(
        k_weight.shape)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    qkv, q_weight, k_weight, cos, sin, _, copy_v = inputs
    if not copy_v:
        raise ValueError("qkv_norm_rope(copy_v=False) has no gradient: v is read in place")
    ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin, output[3])


def _backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, grad_rstd: Tensor | None
              ) -> tuple:
    qkv, q_weight, k_weight, cos, sin, rstd = ctx.saved_tensors
    grad_qkv, grad_qw, grad_kw = qkv_norm_rope_backward(grad_q, grad_k, grad_v, qkv, q_weight,
                                                        k_weight, cos, sin, rstd)
    return grad_qkv, grad_qw, grad_kw, None, None, None, None


qkv_norm_rope.register_autograd(_backward, setup_context=_setup_context)
