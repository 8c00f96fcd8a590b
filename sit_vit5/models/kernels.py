"""Fast paths of ViT-5's elementwise work, kept apart from the formulas they compute.

``layers.py`` and ``rope.py`` hold the definitions (RMSNorm, QK-norm, ``apply_rope``); this module
holds what makes them cheap: a RoPE :class:`Rotation` with its tables laid out once (a complex
multiply in fp32), and two hand-written CPU autograd nodes (RMSNorm; QK-norm + RoPE in one node).
Each is bitwise equal to the definition in the forward (fp32) and within float rounding in the
backward (``tests/test_bench_kernels.py``, ``tests/test_vit5_kernels.py``). On the GPU, QK-norm +
RoPE can run as one Triton kernel each way (``fused_qk.py``, opt-in: :func:`fused_qk`), and
attention over patches + registers at the flash tiles of the patches alone (``tail_attention.py``,
opt-in: :func:`tail_attention`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..utils.errors import ConfigError

#: Whether the CPU autograd nodes below may run on CPU tensors (layers.py asks
#: :func:`cpu_nodes_enabled`). False only inside :func:`generic_path`.
_CPU_NODES = True
#: The environment switch of the fused QK-norm + RoPE, and its values (unset: off)
FUSED_QK_ENV, FUSED_QK_VALUES = "SIT_VIT5_FUSED_QK", {"0": False, "1": True}


def _env_switch(name: str, values: dict[str, bool]) -> bool:
    """The switch ``$name`` (unset or empty: off); ConfigError naming it and the valid values."""
    raw = os.environ.get(name, "").strip()
    if raw and raw not in values:
        raise ConfigError(f"{name}={raw!r}; valid: {', '.join(values)} (or unset)")
    return values.get(raw, False)


#: Whether the GPU path's QK-norm + RoPE runs as one Triton kernel each way (``fused_qk.py``):
#: opt-in (``SIT_VIT5_FUSED_QK=1`` or :func:`fused_qk`) until a GPU has timed it (issue 56)
_FUSED_QK = _env_switch(FUSED_QK_ENV, FUSED_QK_VALUES)
#: Whether the GPU path's attention over main + tail tokens (ViT-5's registers) runs the main block
#: at its own flash tiles (``tail_attention.py``): opt-in (``SIT_VIT5_TAIL_ATTENTION=1`` or
#: :func:`tail_attention`) until a GPU has timed it (issue 56)
TAIL_ATTENTION_ENV = "SIT_VIT5_TAIL_ATTENTION"
_TAIL_ATTENTION = _env_switch(TAIL_ATTENTION_ENV, FUSED_QK_VALUES)
#: flash attention's tiles are at most 128 rows and divide 128: 128·m + r tokens run m + 1 of them
#: along each side, so the last r tokens (r <= tail_attention.MAX_TAIL) are taken apart
FLASH_TILE = 128


def cpu_nodes_enabled() -> bool:
    """Whether CPU tensors take the hand-written CPU nodes (the default) or the generic path."""
    return _CPU_NODES


@contextmanager
def _set(switch: str, value: bool) -> Iterator[None]:
    """This module's global ``switch`` set to ``value`` inside, restored after. Not thread-safe."""
    previous = globals()[switch]
    globals()[switch] = value
    try:
        yield
    finally:
        globals()[switch] = previous


def generic_path() -> AbstractContextManager[None]:
    """Inside, CPU tensors take the device-generic ops a GPU runs (``F.rms_norm``, the unfused
    QK-norm + RoPE chain) instead of the CPU nodes: for tracing the GPU's op sequence on a CPU
    (``bench.cost_model``). Not thread-safe; outside it nothing changes."""
    return _set("_CPU_NODES", False)


def fused_qk(enabled: bool = True) -> AbstractContextManager[None]:
    """Inside, the GPU path's QK-norm + RoPE takes the fused Triton kernels (``enabled``) or the
    torch ops; outside it, ``SIT_VIT5_FUSED_QK`` decides. Not thread-safe."""
    return _set("_FUSED_QK", enabled)


def tail_attention(enabled: bool = True) -> AbstractContextManager[None]:
    """Inside, the GPU path's attention takes :func:`attention`'s tail split (``enabled``) or
    plain SDPA; outside it, ``SIT_VIT5_TAIL_ATTENTION`` decides. Not thread-safe."""
    return _set("_TAIL_ATTENTION", enabled)


def tail_split(tokens: int, dtype: torch.dtype) -> int:
    """The main block the tail attention would run at flash's tiles for ``tokens`` = 128·m + r
    (0 < r <= tail_attention.MAX_TAIL) in half precision, where SDPA would run flash attention:
    128·m; else 0."""
    from .tail_attention import MAX_TAIL  # Triton: imported once asked

    main = tokens - tokens % FLASH_TILE
    fits = 0 < main < tokens <= main + MAX_TAIL and dtype in (torch.bfloat16, torch.float16)
    return main if fits else 0


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q kᵀ / √d) v for q, k, v (B, H, N, d) on the GPU path: SDPA, or, with
    :func:`tail_attention` on and N = 128·m + r (0 < r <= 16: ViT-5-XL/2's 256 patches + 4
    registers), flash attention on the first 128·m tokens at their own tiles and the last r by
    log-sum-exp (``tail_attention.py``; half precision, where SDPA would run flash attention; not
    under torch.func transforms, which it has no rule for)."""
    main = tail_split(q.shape[-2], q.dtype) if _TAIL_ATTENTION else 0
    if main and not torch._C._are_functorch_transforms_active():
        from .tail_attention import tail_attention as split

        return split(q, k, v, main)[0]
    return F.scaled_dot_product_attention(q, k, v)


def swap_pairs(x: Tensor) -> Tensor:
    """(..., 2k) -> (..., 2k): each adjacent pair (a, b) becomes (b, a) (stack: a CPU flip is
    slower)."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((b, a), dim=-1).flatten(-2)


class Rotation:
    """``apply_rope`` with fixed tables, for tokens (B, N, H, head_dim); RopeTables caches it.

    Requires adjacent channels to share an angle (true for every table built here). fp32/fp64: a
    complex multiply, one pass instead of five. Other dtypes (there is no complex bf16) and
    torch.compile (inductor fuses the real form but generates no complex code): the real form with
    the pair signs folded into sin, ``x * cos + swap_pairs(x) * sin_folded``. Both are bitwise equal
    to ``apply_rope`` on CPU. ``wide``, ``wide_cis``: the tables :func:`qk_norm_rope` (the GPU
    path) rotates with, fp32 (fp64 for fp64 tables) whatever the compute dtype.
    ``complex_tables=False`` (compiled code) builds no complex tables.
    """

    def __init__(self, cos: Tensor, sin: Tensor, fp32: tuple[Tensor, Tensor] | None = None,
                 complex_tables: bool = True) -> None:
        self.source = (cos, sin)  # the (N, head_dim) tables this was built from
        self.cos = cos.unsqueeze(-2)  # (N, 1, head_dim): broadcast over heads
        folded = torch.stack((-sin[:, 0::2], sin[:, 1::2]), dim=-1)  # (N, head_dim / 2, 2)
        self.sin_folded = folded.flatten(-2).unsqueeze(-2)  # (N, 1, head_dim)
        complex_ok = cos.dtype in (torch.float32, torch.float64) and complex_tables
        # bf16/fp16 tables come with their fp32 ones (``fp32``): the GPU path rotates in fp32
        wide = (cos, sin) if cos.dtype in (torch.float32, torch.float64) or fp32 is None else fp32
        wide_folded = torch.stack((-wide[1][:, 0::2], wide[1][:, 1::2]), dim=-1).flatten(-2)
        self.wide = (wide[0][:, None, None], wide_folded[:, None, None])  # (N, 1, 1, head_dim)
        # (N, 1, head_dim / 2) complex angles, and their conjugate: the inverse rotation
        self.cis = torch.complex(cos[:, 0::2], sin[:, 0::2]).unsqueeze(-2) if complex_ok else None
        self.cis_conj = self.cis.conj().resolve_conj() if complex_ok else None
        # bf16/fp16 tables with their fp32 ones (``fp32``): complex fp32 angles for the fused
        # QK-norm + RoPE node, which normalises and rotates half-precision q/k in fp32
        self.half_cis = self.half_cis_conj = None
        if fp32 is not None and not complex_ok and complex_tables:
            self.half_cis = torch.complex(fp32[0][:, 0::2], fp32[1][:, 0::2]).unsqueeze(-2)
            self.half_cis_conj = self.half_cis.conj().resolve_conj()
        # (N, 1, 1, head_dim / 2) complex, the wide tables' angles (eager GPU path), or None
        cis = self.cis if self.cis is not None else self.half_cis
        self.wide_cis = None if cis is None else cis.unsqueeze(-2)

    @cached_property
    def pair_tables(self) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (N, head_dim / 2) in the wide tables' dtype: the angle of each channel
        pair (2i, 2i + 1), as the fused kernels read them."""
        cos, sin_folded = self.wide  # (N, 1, 1, head_dim); sin folded: -sin even, +sin odd
        return cos[:, 0, 0, 0::2].contiguous(), sin_folded[:, 0, 0, 1::2].contiguous()

    def complex_ok(self, x: Tensor) -> bool:
        """Whether x is rotated by the complex multiply (eager, x in the tables' fp32/fp64)."""
        return (self.cis is not None and x.dtype == self.cos.dtype
                and not torch.compiler.is_compiling())

    def __call__(self, x: Tensor) -> Tensor:
        """x (B, N, H, head_dim), last dim contiguous -> rotated, same shape and dtype."""
        if self.complex_ok(x):
            pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # (B, N, H, head_dim / 2)
            return torch.view_as_real(pairs * self.cis).flatten(-2)
        return x * self.cos + swap_pairs(x) * self.sin_folded


def qk_norm_rope(qk: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                 rotation: Rotation) -> Tensor:
    """``rotation(rms_norm(x) * weight)`` for q and k at once, in plain torch ops: the GPU path.

    qk (B, N, 2, H, head_dim): q and k side by side (a view of the qkv activation); ``q_weight``,
    ``k_weight`` (head_dim,) their RMSNorm weights; returns (B, N, 2, H, head_dim) in qk's dtype.

    One ``F.rms_norm`` without weight normalises q and k in their own dtype: a same-dtype call is
    CUDA's fused kernel (fp32 accumulation inside), where a bf16 x with an fp32 weight would take
    the composite, and autocast would first copy x to fp32 (it lists rms_norm as an fp32 op; it is
    switched off around the call). The weight multiply promotes to fp32 (fp64 for an fp64 model)
    and the rotation runs there, with fp32 tables: eager, one complex multiply (one kernel,
    backward one); compiled, the real form ``z * cos + swap_pairs(z) * sin_folded``, which Inductor
    fuses (it generates no complex code). Then one cast back. The tables are constants, so the
    backward makes no reduction over the activations for them. Eager CUDA runs 4
    activation-sized kernels forward for q and k where the unfused chain ran 14. fp32: the
    previous chain's numbers within fp32 rounding; bf16: one rounding after the norm and one at
    the end (the previous chain rounded four times, in bf16 tables).
    """
    d, kind = qk.shape[-1], qk.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):  # meta: neither
        with torch.autocast(kind, enabled=False):
            x_hat = F.rms_norm(qk, (d,), None, eps)
    else:
        x_hat = F.rms_norm(qk, (d,), None, eps)
    cos, sin_folded = rotation.wide  # (N, 1, 1, d)
    w = torch.stack((q_weight, k_weight)).unsqueeze(1)  # (2, 1, d): q's, k's
    if w.dtype != cos.dtype:  # fp32 weights and tables (the usual case): no call
        w = w.to(cos.dtype)
    z = x_hat * w  # (B, N, 2, H, d) in the tables' dtype
    if rotation.wide_cis is not None and not torch.compiler.is_compiling():
        pairs = torch.view_as_complex(z.unflatten(-1, (-1, 2)))  # (B, N, 2, H, d / 2)
        y = torch.view_as_real(pairs * rotation.wide_cis).flatten(-2)
    else:
        y = torch.addcmul(z * cos, swap_pairs(z), sin_folded)
    return y.to(qk.dtype)


def qkv_gpu_path(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                 rotation: Rotation) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (each (B, N, H, head_dim)) of the qkv activation (B, N, 3, H, head_dim) on the GPU
    path: q and k normalised and rotated by :func:`qk_norm_rope`, or, with :func:`fused_qk` on in
    eager code, by one Triton kernel each way (``fused_qk.py``; not under torch.compile, where
    Inductor fuses the torch ops, nor under torch.func transforms, which it has no rule for)."""
    if (_FUSED_QK and not torch.compiler.is_compiling()
            and rotation.wide[0].dtype == q_weight.dtype == k_weight.dtype == torch.float32
            and not torch._C._are_functorch_transforms_active()):
        try:
            from .fused_qk import qkv_norm_rope  # Triton: imported once switched on
        except ImportError as err:  # no Triton (a CPU-only or macOS torch): say which switch
            raise ConfigError(f"{FUSED_QK_ENV}=1 / kernels.fused_qk(): the fused QK-norm + RoPE "
                              f"needs Triton ({err}); install it (pip install triton) or turn the "
                              "switch off") from None

        cos, sin = rotation.pair_tables
        # v is copied only where its gradient will come back through the op (training)
        copy_v = torch.is_grad_enabled() and any(
            t.requires_grad for t in (qkv, q_weight, k_weight))
        q, k, v, _ = qkv_norm_rope(qkv, q_weight, k_weight, cos, sin, eps, copy_v)
        return q, k, v if copy_v else qkv[:, :, 2]
    qk = qk_norm_rope(qkv[:, :, :2], q_weight, k_weight, eps, rotation)  # (B, N, 2, H, head_dim)
    (q, k), v = qk.unbind(2), qkv[:, :, 2]
    return q, k, v


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm (over the last dim) with a hand-written backward, for CPU.

    CPU has no fused rms_norm backward (torch 2.x: ``_fused_rms_norm_backward`` is CUDA-only),
    and autograd through the composite (pow, mean, rsqrt, mul) costs ~2x this. The forward is the
    same op sequence as F.rms_norm's CPU composite, so outputs are bitwise equal.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat if weight is None else x_hat * weight

    @staticmethod
    @once_differentiable  # second derivatives raise, not silently missing the x_hat, rstd terms
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        # y = x_hat * w, x_hat = x * rstd: dx = rstd * (g - x_hat * mean(g * x_hat)), g = grad * w
        x_hat, rstd, weight = ctx.saved_tensors
        grad_weight = None
        if weight is None:
            g = grad
            dot = (grad * x_hat).mean(-1, keepdim=True)
        else:
            grad_x_hat = grad * x_hat
            if ctx.needs_input_grad[1]:
                grad_weight = grad_x_hat.flatten(0, -2).sum(0)
            g = grad * weight
            # mean(g * x_hat) over the last dim, as a GEMV
            dot = (grad_x_hat @ weight).unsqueeze(-1).div_(x_hat.shape[-1])
        if weight is None:
            grad_x = torch.addcmul(g, x_hat, dot, value=-1)
        else:
            grad_x = g.addcmul_(x_hat, dot, value=-1)
        return grad_x.mul_(rstd), grad_weight, None


class _QKNormRopeFunction(torch.autograd.Function):
    """``rotation(rms_norm(x) * weight)`` for q or k in one autograd node (CPU, complex RoPE).

    fp32/fp64 x: the forward runs the unfused ops in the same order (bitwise equal). bf16/fp16 x
    (autocast): computed in fp32 with fp32 tables and rounded once at the end, where the unfused
    chain rounds after the norm and again after each rotation product (within bf16 rounding of it).
    The backward undoes the rotation with the conjugate table and goes straight into the RMSNorm
    backward, skipping the intermediate gradient tensors and autograd nodes of the three-op chain.
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, eps: float, cis: Tensor, cis_conj: Tensor
    ) -> Tensor:
        x32 = x if x.dtype in (torch.float32, torch.float64) else x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        x_hat = x32 * rstd
        y = x_hat * weight
        torch.view_as_complex(y.unflatten(-1, (-1, 2))).mul_(cis)  # rotate in place: y is ours
        ctx.save_for_backward(x_hat, rstd, weight, cis_conj)
        ctx.in_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None, None]:
        x_hat, rstd, weight, cis_conj = ctx.saved_tensors
        grad = grad.to(x_hat.dtype)  # fp32 for a bf16/fp16 x, as the forward computed
        if grad.stride(-1) != 1 or any(s % 2 for s in grad.stride()[:-1]):
            grad = grad.contiguous()  # view_as_complex needs (re, im) pairs adjacent
        with torch.autocast("cpu", enabled=False):  # a backward inside autocast: keep the GEMV fp32
            # gradient w.r.t. x_hat * weight: rotate back, then the RMSNorm backward
            grad_pairs = torch.view_as_complex(grad.unflatten(-1, (-1, 2)))  # (..., head_dim / 2)
            grad_y = torch.view_as_real(grad_pairs * cis_conj).flatten(-2)
            grad_x_hat = grad_y * x_hat
            grad_weight = grad_x_hat.flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
            dot = (grad_x_hat @ weight).unsqueeze(-1).div_(x_hat.shape[-1])
            grad_x = grad_y.mul_(weight).addcmul_(x_hat, dot, value=-1).mul_(rstd)
        return grad_x.to(ctx.in_dtype), grad_weight, None, None, None
