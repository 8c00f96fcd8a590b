"""Attention over ``main + tail`` tokens at the flash tiles of ``main``: ViT-5 registers (issue 56).

ViT-5-XL/2 at 256 px attends over 260 tokens: 256 patches and 4 registers. torch's flash attention
computes whole tiles (128 query x 64 key rows forward, 64 x 128 backward, for head dim 72), so 260
tokens run 3 x 5 tiles where 256 run 2 x 4: 1.875x the work for 1.03x the FLOPs
(``bench.cost_model.flash_padding``). Here flash attention runs the ``main x main`` block only, and
returns its log-sum-exp; the softmax over all keys splits exactly, by log-sum-exp, into that block
and the ``tail`` keys. One Triton kernel adds the tail keys to the main rows and computes the tail
rows over every key (online softmax). The backward is flash's own backward, given the merged output
and log-sum-exp (its P = exp(S - lse) and D = rowsum(dO * O) are then the full softmax's), plus two
Triton kernels for the tail rows and columns; partial sums go to buffers summed in a fixed order (no
atomics).

Registered as torch operators (``sit_vit5::tail_attention`` and its backward) with shape-only fake
versions: a trace under ``FakeTensorMode`` (``bench.cost_model``) sees one op each way. Off CUDA the
operators compute :func:`reference` (the whole softmax in fp32 torch ops), or the flash + Triton
path under ``TRITON_INTERPRET=1`` (the tests, with CPU flash attention). Opt-in
(``kernels.tail_attention``) until a GPU has timed it.

Shapes: q, k, v (B, H, N, d), last dim contiguous (views of the qkv activation are fine); N = main +
tail with main a multiple of 16 and 0 < tail <= ``MAX_TAIL``; out (B, H, N, d) in q's dtype,
laid out as (B, N, H, d) (as flash attention's is; the gradients too), lse (B, H, N) fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton's CPU interpreter (tests)
#: the most tail tokens the kernels take (one 16-row block: a tl.dot needs 16 rows)
MAX_TAIL = 16


@triton.jit
def _rows(base, rows, row_stride, cols, mask):
    """Rows (len(rows), len(cols)) of a (N, d) matrix with contiguous rows, masked, in its dtype."""
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


#: Triton's interpreter multiplies bf16 operands of tl.dot wrongly (raw bits): there the rounded
#: operands are multiplied in fp32, which is what a tensor core computes
_FP32_DOTS = tl.constexpr(_INTERPRET)


@triton.jit
def _dot(a, b):
    """a @ b accumulated in fp32, a rounded to b's dtype first: bf16 / fp16 activations run on
    tensor cores (the probabilities and score gradients rounded to them, as flash attention rounds
    its own), fp32 ones exactly ("ieee", not tf32)."""
    a = a.to(b.dtype)
    if _FP32_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _layout(pid_bh, heads, n, main, d, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's (batch, head), its channels and their mask (d of BLOCK_D), and the tail tokens
    (rows or keys, from main) and their mask (n - main of BLOCK_R)."""
    cols = tl.arange(0, BLOCK_D)
    tail = main + tl.arange(0, BLOCK_R)
    return pid_bh // heads, pid_bh % heads, cols, cols < d, tail, tail < n


@triton.jit
def _token_major(b, h, heads, n, d):
    """(offset of token 0, token stride) of batch b, head h in a contiguous (B, N, H, d) tensor:
    the layout of every (B, H, N, d) output here (``_empty``)."""
    return (b * n * heads + h) * d, heads * d


@triton.jit
def _forward_kernel(Q, K, V, O1, LSE1, OUT, LSE, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                    sob, soh, son, slb, slh, sln, heads, n, main, d, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h, cols, dmask, tail, tmask = _layout(pid_bh, heads, n, main, d, BLOCK_R, BLOCK_D)
    q_base, k_base, v_base = Q + b * sqb + h * sqh, K + b * skb + h * skh, V + b * svb + h * svh
    base, step = _token_major(b, h, heads, n, d)
    # the two branches share no variable names: Triton types a name across both branches
    if pid_m * BLOCK_M < main:  # main rows: flash's block, plus the tail keys
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _rows(q_base, rows, sqn, cols, dmask[None, :])
        kt = _rows(k_base, tail, skn, cols, tmask[:, None] & dmask[None, :])
        vt = _rows(v_base, tail, svn, cols, tmask[:, None] & dmask[None, :])
        s = _dot(q, tl.trans(kt)) * scale  # (BLOCK_M, BLOCK_R)
        s = tl.where(tmask[None, :], s, float("-inf"))
        lse1 = tl.load(LSE1 + b * slb + h * slh + rows * sln)
        m = tl.maximum(lse1, tl.max(s, 1))
        lse = m + tl.log(tl.exp(lse1 - m) + tl.sum(tl.exp(s - m[:, None]), 1))
        p = tl.exp(s - lse[:, None])
        o1 = _rows(O1 + b * sob + h * soh, rows, son, cols, dmask[None, :]).to(tl.float32)
        out = o1 * tl.exp(lse1 - lse)[:, None] + _dot(p, vt)
        tl.store(OUT + base + rows[:, None] * step + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=dmask[None, :])
        tl.store(LSE + pid_bh * n + rows, lse)
    else:  # the tail rows over every key: an online softmax
        qt = _rows(q_base, tail, sqn, cols, tmask[:, None] & dmask[None, :])
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for start in range(0, n, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            kmask = keys < n
            kb = _rows(k_base, keys, skn, cols, kmask[:, None] & dmask[None, :])
            vb = _rows(v_base, keys, svn, cols, kmask[:, None] & dmask[None, :])
            s_t = tl.where(kmask[None, :], _dot(qt, tl.trans(kb)) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 1))
            p_t = tl.exp(s_t - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p_t, 1)
            acc = acc * alpha[:, None] + _dot(p_t, vb)
            m_i = m_new
        tl.store(OUT + base + tail[:, None] * step + cols[None, :],
                 (acc / l_i[:, None]).to(OUT.dtype.element_ty),
                 mask=tmask[:, None] & dmask[None, :])
        tl.store(LSE + pid_bh * n + tail, m_i + tl.log(l_i), mask=tmask)


@triton.jit
def _main_rows_backward_kernel(Q, K, V, DO, OUT, LSE, DQ1, DQ, PART_K, PART_V, sqb, sqh, sqn,
                               skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, s1b, s1h, s1n, heads,
                               n, main, d, scale, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    """Main rows x tail keys: dq (flash's plus theirs) written whole; the tail keys' dk, dv
    shares per program."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h, cols, dmask, tail, tmask = _layout(pid_bh, heads, n, main, d, BLOCK_R, BLOCK_D)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _rows(Q + b * sqb + h * sqh, rows, sqn, cols, dmask[None, :])
    do = _rows(DO + b * sdb + h * sdh, rows, sdn, cols, dmask[None, :])
    base, step = _token_major(b, h, heads, n, d)  # OUT and DQ
    o = _rows(OUT + base, rows, step, cols, dmask[None, :]).to(tl.float32)
    lse = tl.load(LSE + pid_bh * n + rows)
    kt = _rows(K + b * skb + h * skh, tail, skn, cols, tmask[:, None] & dmask[None, :])
    vt = _rows(V + b * svb + h * svh, tail, svn, cols, tmask[:, None] & dmask[None, :])
    delta = tl.sum(do.to(tl.float32) * o, 1)  # D = rowsum(dO * O)
    s = _dot(q, tl.trans(kt)) * scale
    p = tl.where(tmask[None, :], tl.exp(s - lse[:, None]), 0.0)
    ds = p * (_dot(do, tl.trans(vt)) - delta[:, None])
    dq1 = _rows(DQ1 + b * s1b + h * s1h, rows, s1n, cols, dmask[None, :]).to(tl.float32)
    dq = dq1 + _dot(ds, kt) * scale
    dst = DQ + base + rows[:, None] * step + cols[None, :]
    tl.store(dst, dq.to(DQ.dtype.element_ty), mask=dmask[None, :])
    r = tl.arange(0, BLOCK_R)
    part = ((pid_bh * tl.num_programs(0) + pid_m) * BLOCK_R + r[:, None]) * BLOCK_D + cols[None, :]
    tl.store(PART_K + part, _dot(tl.trans(ds), q) * scale)
    tl.store(PART_V + part, _dot(tl.trans(p), do))


@triton.jit
def _keys_backward_kernel(Q, K, V, DO, OUT, LSE, DK1, DV1, TK, TV, DK, DV, PART_Q, sqb, sqh, sqn,
                          skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, s1b, s1h, s1n, heads, n,
                          main, d, scale, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Tail rows x one block of keys: dk, dv (flash's or the tail keys' shares, plus theirs)
    written whole; the tail rows' dq share per program."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h, cols, dmask, tail, tmask = _layout(pid_bh, heads, n, main, d, BLOCK_R, BLOCK_D)
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = keys < n
    both = tmask[:, None] & dmask[None, :]
    qt = _rows(Q + b * sqb + h * sqh, tail, sqn, cols, both)
    dot_ = _rows(DO + b * sdb + h * sdh, tail, sdn, cols, both)
    base, step = _token_major(b, h, heads, n, d)  # OUT, DK and DV
    ot = _rows(OUT + base, tail, step, cols, both).to(tl.float32)
    lse = tl.load(LSE + pid_bh * n + tail, mask=tmask, other=0.0)
    kb = _rows(K + b * skb + h * skh, keys, skn, cols, kmask[:, None] & dmask[None, :])
    vb = _rows(V + b * svb + h * svh, keys, svn, cols, kmask[:, None] & dmask[None, :])
    s = _dot(qt, tl.trans(kb)) * scale
    p = tl.where(tmask[:, None] & kmask[None, :], tl.exp(s - lse[:, None]), 0.0)
    dp = _dot(dot_, tl.trans(vb))
    ds = p * (dp - tl.sum(dot_.to(tl.float32) * ot, 1)[:, None])
    if pid_n * BLOCK_N < main:  # main keys: flash's gradients (BLOCK_N divides main)
        dk = _rows(DK1 + b * s1b + h * s1h, keys, s1n, cols, dmask[None, :]).to(tl.float32)
        dv = _rows(DV1 + b * s1b + h * s1h, keys, s1n, cols, dmask[None, :]).to(tl.float32)
    else:  # the tail keys: the main rows' shares, summed
        own = (pid_bh * BLOCK_R + (keys - main)[:, None]) * BLOCK_D + cols[None, :]
        dk = tl.load(TK + own, mask=kmask[:, None] & dmask[None, :], other=0.0)
        dv = tl.load(TV + own, mask=kmask[:, None] & dmask[None, :], other=0.0)
    dk += _dot(tl.trans(ds), qt) * scale
    dv += _dot(tl.trans(p), dot_)
    dst = base + keys[:, None] * step + cols[None, :]
    tl.store(DK + dst, dk.to(DK.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])
    tl.store(DV + dst, dv.to(DV.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])
    r = tl.arange(0, BLOCK_R)
    part = ((pid_bh * tl.num_programs(0) + pid_n) * BLOCK_R + r[:, None]) * BLOCK_D + cols[None, :]
    tl.store(PART_Q + part, _dot(ds, kb) * scale)


def _empty(q: Tensor) -> Tensor:
    """An uninitialised tensor of q's shape (B, H, N, d) and dtype, laid out as (B, N, H, d): every
    output here, so that the attention's output reshapes to (B, N, H·d) as a view (no copy before
    the projection)."""
    b, heads, n, d = q.shape
    return q.new_empty((b, n, heads, d)).transpose(1, 2)


def reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The definition in fp32 torch ops: (softmax(q kᵀ / √d) v in q's dtype, lse (B, H, N) fp32)."""
    with torch.autocast(q.device.type, enabled=False):  # called under autocast: fp32 matmuls
        s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        return _empty(q).copy_(torch.softmax(s, -1) @ v.float()), s.logsumexp(-1)


def reference_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax attention's gradients in fp32 torch ops, given its output and lse: (dq, dk, dv) in
    q's dtype."""
    scale, g = q.shape[-1] ** -0.5, grad.float()
    with torch.autocast(q.device.type, enabled=False):  # fp32 matmuls under any caller's autocast
        p = torch.exp((q.float() @ k.float().transpose(-1, -2)) * scale - lse[..., None])
        ds = p * (g @ v.float().transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
        grads = (ds @ k.float() * scale, ds.transpose(-1, -2) @ q.float() * scale,
                 p.transpose(-1, -2) @ g)
    return tuple(_empty(q).copy_(t) for t in grads)


def _use_kernels(q: Tensor) -> bool:
    return q.is_cuda or _INTERPRET


def _flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """torch's flash attention with its log-sum-exp: (out (B, H, M, d), lse (B, H, M) fp32)."""
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                      scale=scale)


def _flash_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """flash attention's backward of the main block, given the merged output and lse of its
    rows."""
    if q.is_cuda:
        m = q.shape[-2]
        # the forward's rng state (2,) and offset (), as it returns them: unread without dropout
        seed, offset = (torch.empty(shape, dtype=torch.uint64, device=q.device)
                        for shape in ((2,), ()))
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, m, m, 0.0, False, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, scale=scale)


def _strides(*tensors: Tensor) -> list[int]:
    """(batch, head, token) strides of each (B, H, N, d) tensor (its last dim contiguous)."""
    return [s for t in tensors for s in t.stride()[:3]]


def _blocks(d: int, main: int) -> tuple[int, dict]:
    """(rows per program: the largest of 64, 32, 16 dividing main; the kernels' other blocks)."""
    block = next(b for b in (64, 32, 16) if main % b == 0)
    return block, dict(BLOCK_R=MAX_TAIL, BLOCK_D=max(16, triton.next_power_of_2(d)))


def _check(q: Tensor, main: int) -> None:
    n = q.shape[-2]
    if main <= 0 or main % 16 or not 0 < n - main <= MAX_TAIL:
        raise ValueError(f"tail attention: {n} tokens = main {main} + tail {n - main}; main must "
                         f"be a positive multiple of 16 and the tail 1 to {MAX_TAIL} tokens")


@torch.library.custom_op("sit_vit5::tail_attention", mutates_args=())
def tail_attention(q: Tensor, k: Tensor, v: Tensor, main: int) -> tuple[Tensor, Tensor]:
    """(softmax(q kᵀ / √d) v (B, H, N, d) in q's dtype, laid out as (B, N, H, d); lse (B, H, N)
    fp32)."""
    _check(q, main)
    if not _use_kernels(q):
        return reference(q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    b, heads, n, d = q.shape
    scale = d**-0.5
    o1, lse1 = _flash(q[:, :, :main], k[:, :, :main], v[:, :, :main], scale)
    out = _empty(q)
    lse = torch.empty((b, heads, n), dtype=torch.float32, device=q.device)
    block, blocks = _blocks(d, main)
    _forward_kernel[(main // block + 1, b * heads)](
        q, k, v, o1, lse1, out, lse, *_strides(q, k, v, o1), *lse1.stride(), heads, n, main, d,
        scale, BLOCK_M=block, BLOCK_N=block, **blocks)
    return out, lse


@tail_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, main: int) -> tuple[Tensor, Tensor]:
    return _empty(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("sit_vit5::tail_attention_backward", mutates_args=())
def tail_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            lse: Tensor, main: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each (B, H, N, d) in q's dtype, laid out as (B, N, H, d)."""
    if not _use_kernels(q):
        return reference_backward(grad, q, k, v, out, lse)
    q, k, v, grad = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, grad))
    b, heads, n, d = q.shape
    scale = d**-0.5
    main_block = (slice(None), slice(None), slice(None, main))
    dq1, dk1, dv1 = _flash_backward(grad[main_block], q[main_block], k[main_block],
                                    v[main_block], out[main_block],
                                    lse[main_block].contiguous(), scale)
    if dk1.stride() != dv1.stride():  # one set of strides is passed for both
        dk1, dv1 = dk1.contiguous(), dv1.contiguous()
    block, blocks = _blocks(d, main)
    width = blocks["BLOCK_D"]
    dq, dk, dv = _empty(q), _empty(q), _empty(q)
    parts = main // block
    part_k, part_v = (torch.empty((b * heads, parts, MAX_TAIL, width), dtype=torch.float32,
                                  device=q.device) for _ in range(2))
    _main_rows_backward_kernel[(parts, b * heads)](
        q, k, v, grad, out, lse, dq1, dq, part_k, part_v, *_strides(q, k, v, grad, dq1), heads,
        n, main, d, scale, BLOCK_M=block, **blocks)
    tail_k, tail_v = part_k.sum(1), part_v.sum(1)  # (B·H, MAX_TAIL, width), in program order
    key_blocks = triton.cdiv(n, block)
    part_q = torch.empty((b * heads, key_blocks, MAX_TAIL, width), dtype=torch.float32,
                         device=q.device)
    _keys_backward_kernel[(key_blocks, b * heads)](
        q, k, v, grad, out, lse, dk1, dv1, tail_k, tail_v, dk, dv, part_q,
        *_strides(q, k, v, grad, dk1), heads, n, main, d, scale, BLOCK_N=block, **blocks)
    dq[:, :, main:] = part_q.sum(1)[:, : n - main, :d].unflatten(0, (b, heads))
    return dq, dk, dv


@tail_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, main: int
      ) -> tuple[Tensor, Tensor, Tensor]:
    return _empty(q), _empty(q), _empty(q)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, main = inputs
    ctx.main = main
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor | None) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    return (*tail_attention_backward(grad_out, q, k, v, out, lse, ctx.main), None)


tail_attention.register_autograd(_backward, setup_context=_setup_context)
