"""Building blocks shared by both backbones (timm-style small pieces).

Shapes: B batch, N tokens, D hidden width, H heads, C channels. Parameter names follow DiT/SiT so
official checkpoints load unchanged (``x_embedder.proj``, ``t_embedder.mlp.{0,2}``, ``attn.qkv``,
``mlp.fc1`` ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernels import (
    Rotation,
    _QKNormRopeFunction,
    _RMSNormFunction,
    attention,
    cpu_nodes_enabled,
    qkv_gpu_path,
)


def _fusable() -> bool:
    """Whether the hand-written CPU autograd Functions below may run: not under a ``torch.func``
    transform (MeanFlow's ``torch.func.jvp``), where they have no forward-mode rule; there the
    composite ops run instead (the same forward op sequence, so the same values). Compiled code
    keeps the Functions (dynamo traces them; the check is for eager transforms)."""
    if torch.compiler.is_compiling():
        return True
    return not torch._C._are_functorch_transforms_active()  # private API: no public query yet


def generic_path_for(x: Tensor) -> bool:
    """Whether x takes the device-generic ops (any GPU; CPU inside ``kernels.generic_path()``)
    rather than the CPU's: the CPU keeps its op sequence, so its results stay bit for bit."""
    return x.device.type != "cpu" or not cpu_nodes_enabled()


def gated_residual(x: Tensor, gate: Tensor, branch: Tensor) -> Tensor:
    """``x + gate * branch``; x (B, N, D), gate (B, 1, D), branch (B, N, D). On the GPU path without
    autograd (sampling) one ``addcmul``: no product written and read back; otherwise SiT's two ops,
    whose backward runs in the gate's and branch's dtype (the CPU keeps its bits)."""
    if not torch.is_grad_enabled() and generic_path_for(x):
        return torch.addcmul(x, gate, branch)
    return x + gate * branch


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation ``x * (1 + scale) + shift``; x (B, N, D), shift/scale (B, 1, D). The GPU
    path adds the product in one ``addcmul`` (no (B, N, D) product written and read back); the CPU
    keeps its op sequence (its bits)."""
    if generic_path_for(x):
        return torch.addcmul(shift, x, 1 + scale)
    return x * (1 + scale) + shift


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 (ViT-5: eps 1e-6, weight, no bias); returns x's
    dtype.

    The weight is applied in fp32 before the one cast back (bf16 autocast: the output stays bf16,
    no fp32 detour).
    """

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None  # on cpu: a parameter

    def forward(self, x: Tensor) -> Tensor:
        if generic_path_for(x):  # CUDA: fused forward and backward; casts only where they convert
            x32 = x if x.dtype == torch.float32 else x.float()
            out = F.rms_norm(x32, (self.dim,), self.weight, self.eps)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        x32 = x.float()
        if _fusable():
            return _RMSNormFunction.apply(x32, self.weight, self.eps).to(x.dtype)
        # CPU under torch.func: the composite (forward-mode rules)
        return F.rms_norm(x32, (self.dim,), self.weight, self.eps).to(x.dtype)


NORMS = ("layernorm", "rmsnorm")


def make_norm(kind: str, dim: int, affine: bool = False, eps: float = 1e-6) -> nn.Module:
    """Block/final norm: ``layernorm`` (DiT: no affine, eps 1e-6) or ``rmsnorm``."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, elementwise_affine=affine, eps=eps)
    return RMSNorm(dim, eps=eps, affine=affine)


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, H/p * W/p, D) tokens in row-major order; any H, W divisible by p."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        # contiguous: left as the transposed view (timm, official SiT), the whole residual stream
        # inherits its strides, so every norm copies its input and every residual add is strided
        # (~5% of a step)
        x = self.proj(x)  # (B, D, H/p, W/p)
        return x.flatten(2).transpose(1, 2).contiguous()  # (B, N, D), N = H/p * W/p


class TimestepEmbedder(nn.Module):
    """Scalar t (B,) -> (B, D): 256-d sinusoid ``[cos, sin]``, max period 1e4, then
    Linear-SiLU-Linear.

    ``freq_shift``: frequencies ``1e4 ** (-i / (half - freq_shift))``; 0 is DiT/SiT, 1 is diffusers'
    ``DiTTransformer2DModel`` (its ``Timesteps(downscale_freq_shift=1)``).
    """

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256,
                 freq_shift: int = 0) -> None:
        super().__init__()
        self.frequency_embedding_size, self.freq_shift = frequency_embedding_size, freq_shift
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0,
                           freq_shift: int = 0) -> Tensor:
        """(B,) -> (B, dim). SiT feeds raw t in [0, 1] (no x1000 rescale as in DiT)."""
        half = dim // 2
        steps = torch.arange(half, dtype=torch.float32, device=t.device)
        freqs = torch.exp(-math.log(max_period) * steps / (half - freq_shift))  # (dim / 2,)
        args = t[:, None].float() * freqs[None]  # (B, dim / 2)
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, dim - dim % 2)
        return F.pad(emb, (0, dim % 2))

    def forward(self, t: Tensor) -> Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size,
                                         freq_shift=self.freq_shift)  # (B, 256)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))  # (B, D)


class LabelEmbedder(nn.Module):
    """Labels (B,) -> (B, D). Row ``num_classes`` is the null class; training drops labels with
    probability ``dropout_prob``."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Tensor | None = None) -> Tensor:
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            if force_drop_ids is None:
                drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            else:
                drop = force_drop_ids == 1
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)


def norm_and_rotate(x: Tensor, norm: nn.Module, rope: Rotation | None) -> Tensor:
    """``rope(norm(x))`` for q or k (B, N, H, head_dim); one fused autograd node where that pays
    (CPU eager, RMSNorm with an fp32 weight, complex RoPE): fp32 x: same forward bits, gradients
    within float rounding; bf16/fp16 x: computed in fp32, within that dtype's rounding."""
    if (
        rope is not None and isinstance(norm, RMSNorm) and norm.weight is not None
        and x.device.type == "cpu" and cpu_nodes_enabled() and norm.weight.dtype == torch.float32
        and _fusable()
    ):
        if x.dtype == torch.float32 and rope.complex_ok(x):
            return _QKNormRopeFunction.apply(x, norm.weight, norm.eps, rope.cis, rope.cis_conj)
        fused = rope.half_cis is not None and x.dtype == rope.cos.dtype
        if fused and not torch.compiler.is_compiling():
            return _QKNormRopeFunction.apply(x, norm.weight, norm.eps, rope.half_cis,
                                             rope.half_cis_conj)
    x = norm(x)
    return x if rope is None else rope(x)


class Attention(nn.Module):
    """Multi-head self-attention via SDPA; optional per-head RMS QK-norm (before RoPE) and 2-D
    RoPE."""

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = True, qk_norm: bool = False
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        # q and k share one fused norm + rotation on the GPU path (same eps; weights apart)
        self.fused_qk = qk_norm and self.q_norm.eps == self.k_norm.eps

    def forward(self, x: Tensor, rope: Rotation | None = None) -> Tensor:
        B, N, D = x.shape
        # per-token work (QK-norm, RoPE) in the (B, N, H, head_dim) layout qkv comes in: less
        # strided on CPU
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)  # (B, N, 3, H, head_dim)
        if rope is not None and self.fused_qk and generic_path_for(qkv):
            # GPU path: q and k normalised and rotated together (kernels.qkv_gpu_path)
            q, k, v = qkv_gpu_path(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                   rope)
        else:
            q, k, v = qkv.unbind(2)  # each (B, N, H, head_dim)
            q, k = norm_and_rotate(q, self.q_norm, rope), norm_and_rotate(k, self.k_norm, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, N, head_dim)
        if _fusable() and generic_path_for(x):
            x = attention(q, k, v)  # (B, H, N, head_dim): SDPA, or the opt-in tail split
        elif _fusable():
            x = F.scaled_dot_product_attention(q, k, v)
        else:  # torch.func (MeanFlow's JVP): the fused kernels (CPU flash, CUDA flash / cuDNN)
            with sdpa_kernel(SDPBackend.MATH):  # have no forward-mode rule; the math one has
                x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, D))  # (B, N, D)


#: The GELU MLP's activation: SiT/DiT's tanh approximation, or the exact erf GELU of the official
#: ViT-5 code.
MLP_ACTS = {"gelu_tanh": "tanh", "gelu": "none"}  # name -> nn.GELU(approximate=...)


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2, hidden = mlp_ratio * D; ``act`` "gelu_tanh" (DiT/SiT) or "gelu"
    (exact)."""

    def __init__(self, dim: int, hidden: int, act: str = "gelu_tanh") -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = nn.GELU(approximate=MLP_ACTS[act])

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (B, N, D) -> (B, N, hidden) -> (B, N, D)


class SwiGLU(nn.Module):
    """fc1 -> (SiLU(a) * b) -> fc2. Ablation only (ViT-5: SwiGLU + LayerScale over-gates).

    Our FLOP-matched variant: hidden = 2/3 of the GELU width, with biases, so parameters and FLOPs
    match the GELU MLP (8·D² weights).
    """

    width, bias = 2 / 3, True

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        hidden = int(self.width * hidden)
        # fc1 holds the gate and value matrices side by side: one matmul instead of two
        self.fc1 = nn.Linear(dim, 2 * hidden, bias=self.bias)
        self.fc2 = nn.Linear(hidden, dim, bias=self.bias)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.fc1(x).chunk(2, dim=-1)  # each (B, N, hidden)
        return self.fc2(F.silu(a) * b)  # (B, N, D)


class SwiGLUViT5(SwiGLU):
    """The official ViT-5 SwiGLU: hidden = the full GELU width (4·D), three bias-free matrices
    (12·D²)."""

    width, bias = 1.0, False


MLPS = {"gelu": Mlp, "swiglu": SwiGLU, "swiglu_vit5": SwiGLUViT5}

#: Named LayerScale initial values: ``layer_scale_init="classification"`` (config or keyword).
LAYER_SCALE_INITS: dict[str, float] = {
    "generative": 1.0,  # gamma starts at 1 on the zero-init adaLN gate: no second bottleneck
    "classification": 1e-4,  # official ViT-5 ImageNet-1k recipe (LAMB, lr 3e-3-4e-3, long warm-up)
}


def resolve_layer_scale_init(value: float | str | None) -> float | None:
    """LayerScale's initial gamma: a number as given, None (off), or a name in
    ``LAYER_SCALE_INITS``; raises ValueError for any other name."""
    if not isinstance(value, str):
        return value
    if value not in LAYER_SCALE_INITS:
        raise ValueError(f"layer_scale_init={value!r}: a number, None (off) or one of "
                         f"{sorted(LAYER_SCALE_INITS)}")
    return LAYER_SCALE_INITS[value]


class Block(nn.Module):
    """Pre-norm transformer block with adaLN-Zero conditioning.

    Defaults are the DiT/SiT block. ViT-5 switches: ``norm='rmsnorm'``, ``qk_norm``,
    ``qkv_bias=False``, ``layer_scale_init`` (LayerScale gamma multiplies the gated branch: our
    choice for adaLN models), ``mlp``, ``mlp_act`` (the GELU MLP's activation). ``mlp_norm_eps``:
    the eps of the norm before the MLP (diffusers' DiT: its ``norm_eps``).
    """

    def __init__(
        self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, norm: str = "layernorm",
        qk_norm: bool = False, qkv_bias: bool = True, layer_scale_init: float | None = None,
        mlp: str = "gelu", mlp_act: str = "gelu_tanh", mlp_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.norm1 = make_norm(norm, hidden_size)
        self.attn = Attention(hidden_size, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm)
        self.norm2 = make_norm(norm, hidden_size, eps=mlp_norm_eps)
        hidden = int(hidden_size * mlp_ratio)
        if mlp == "gelu":
            self.mlp = Mlp(hidden_size, hidden, mlp_act)
        else:
            self.mlp = MLPS[mlp](hidden_size, hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        if layer_scale_init is not None:
            init = float(layer_scale_init)
            self.gamma_1 = nn.Parameter(torch.full((hidden_size,), init))  # on cpu: a parameter
            self.gamma_2 = nn.Parameter(torch.full((hidden_size,), init))  # on cpu: a parameter
        else:
            self.gamma_1 = self.gamma_2 = None

    def forward(self, x: Tensor, c: Tensor, rope: Rotation | None = None) -> Tensor:
        """x (B, N, D), c (B, D) -> (B, N, D)."""
        # one unsqueeze for the six chunks: each eager torch call is host time on a GPU
        mod = self.adaLN_modulation(c).unsqueeze(1)  # (B, 1, 6D): six (B, 1, D) chunks
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        if self.gamma_1 is not None:
            # back in the modulation's dtype, as SiT's gate (bf16 under autocast; a no-op in fp32):
            # an fp32 gate (gamma is fp32) runs the residual's backward over fp32 (B, N, D) passes
            gate_msa = (gate_msa * self.gamma_1).to(mod.dtype)
            gate_mlp = (gate_mlp * self.gamma_2).to(mod.dtype)
        x = gated_residual(x, gate_msa, self.attn(modulate(self.norm1(x), shift_msa, scale_msa),
                                                  rope))
        return gated_residual(x, gate_mlp, self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp)))


class FinalLayer(nn.Module):
    """Norm + adaLN(shift, scale) + Linear to p*p*C_out per token."""

    def __init__(
        self, hidden_size: int, patch_size: int, out_channels: int, norm: str = "layernorm"
    ) -> None:
        super().__init__()
        self.norm_final = make_norm(norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """x (B, N, D), c (B, D) -> (B, N, p*p*C_out)."""
        shift, scale = self.adaLN_modulation(c).unsqueeze(1).chunk(2, dim=-1)  # each (B, 1, D)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def sincos_pos_embed_2d(embed_dim: int, grid_h: int, grid_w: int | None = None) -> Tensor:
    """MAE-style fixed 2-D sin-cos table (grid_h*grid_w, embed_dim), float64 -> float32.

    As in MAE/DiT the grid is ``meshgrid(w, h)``: the first half of the channels encodes the column
    index, the second half the row index; each half is ``[sin, cos]`` with omega = 1 / 10000^(2i/d).
    """
    grid_w = grid_h if grid_w is None else grid_w
    rows, cols = torch.meshgrid(  # each (grid_h, grid_w)
        torch.arange(grid_h, dtype=torch.float64),  # on cpu: an init-time table
        torch.arange(grid_w, dtype=torch.float64),  # on cpu: an init-time table
        indexing="ij",
    )

    def one_axis(pos: Tensor) -> Tensor:
        steps = torch.arange(embed_dim // 4, dtype=torch.float64)  # on cpu: an init-time table
        omega = 1.0 / 10000 ** (steps / (embed_dim / 4))  # (D/4,)
        out = pos.reshape(-1, 1) * omega[None]  # (h*w, D/4)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)  # (h*w, D/2)

    return torch.cat([one_axis(cols), one_axis(rows)], dim=1).float()
