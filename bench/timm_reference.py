"""A plain SiT built from timm's PatchEmbed / Attention / Mlp, the layers the official code uses.

Not used for training: it is the independent reference that the tests compare our SiT against (same
state-dict keys, so one set of weights drives both) and the baseline that ``bench/`` times side by side.
Written from the published architecture; needs ``timm`` (the ``dev`` extra).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn


def _sincos_2d(dim: int, side: int) -> np.ndarray:
    """MAE table via numpy (independent of sit_vit5.models.layers): grid = meshgrid(w, h)."""
    grid = np.stack(np.meshgrid(np.arange(side, dtype=np.float64), np.arange(side, dtype=np.float64)))

    def axis(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([axis(dim // 2, grid[0]), axis(dim // 2, grid[1])], axis=1)


class _TEmbed(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))

    def forward(self, t: Tensor) -> Tensor:
        freqs = torch.exp(-math.log(10000) * torch.arange(128, device=t.device) / 128)
        args = t[:, None].float() * freqs
        return self.mlp(torch.cat([args.cos(), args.sin()], dim=-1))


class _YEmbed(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(n + 1, d)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        from timm.models.vision_transformer import Attention, Mlp

        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(d, num_heads=heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(d, 4 * d, act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        m = [v.unsqueeze(1) for v in self.adaLN_modulation(c).chunk(6, dim=1)]
        x = x + m[2] * self.attn(self.norm1(x) * (1 + m[1]) + m[0])
        return x + m[5] * self.mlp(self.norm2(x) * (1 + m[4]) + m[3])


class _Final(nn.Module):
    def __init__(self, d: int, p: int, c: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(d, p * p * c)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))


class TimmSiT(nn.Module):
    """SiT-{size}/{p} with timm layers; forward(x, t, y) returns the velocity channels like SiT."""

    def __init__(
        self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
        depth: int = 28, num_heads: int = 16, num_classes: int = 1000, learn_sigma: bool = True,
    ) -> None:
        super().__init__()
        from timm.layers import PatchEmbed

        self.p, self.c_in, self.c_out = patch_size, in_channels, in_channels * (2 if learn_sigma else 1)
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder, self.y_embedder = _TEmbed(hidden_size), _YEmbed(num_classes, hidden_size)
        side = input_size // patch_size
        table = torch.from_numpy(_sincos_2d(hidden_size, side)).float()[None]
        self.pos_embed = nn.Parameter(table, requires_grad=False)
        self.blocks = nn.ModuleList([_Block(hidden_size, num_heads) for _ in range(depth)])
        self.final_layer = _Final(hidden_size, patch_size, self.c_out)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        n, side = x.shape[0], x.shape[-1] // self.p
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder.embedding_table(y)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_layer.adaLN_modulation(c).chunk(2, dim=1)
        x = self.final_layer.linear(self.final_layer.norm_final(x) * (1 + scale[:, None]) + shift[:, None])
        x = x.reshape(n, side, side, self.p, self.p, self.c_out).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(n, self.c_out, side * self.p, side * self.p)[:, : self.c_in]
