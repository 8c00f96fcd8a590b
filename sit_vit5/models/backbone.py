"""The backbone interface: everything the rest of the code uses of a model. Training, sampling,
REPA, FSDP2, diagnostics and export read these names and nothing else, so a third backbone
implements this and nothing more (``SiT`` and ``ViT5`` do; ``tests/test_backbone.py`` trains and
samples a toy one through it).

Shapes: x (B, C, H, W) with H = W = ``input_size`` at training, t (B,) in [0, 1] (0 = noise; DiT's
objective passes integer steps), y (B,) in [0, ``num_classes``]; the row ``num_classes`` is the
null class of classifier-free guidance when ``has_null_class``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class BackboneBlock(Protocol):
    """One residual block, as diagnostics read it: ``adaLN_modulation(c)`` gives (B, 6D) = shift,
    scale, gate of the attention branch, then of the MLP branch; ``gamma_1`` / ``gamma_2`` are the
    branches' LayerScale (D,) or None."""

    adaLN_modulation: nn.Module
    gamma_1: Tensor | None
    gamma_2: Tensor | None


@runtime_checkable
class Backbone(Protocol):
    """A class-conditional network ``(x, t, y) -> (B, out_channels, H, W)``; the objective reads
    the channels it needs (the first ``in_channels``, and DiT's variance half when
    ``out_channels = 2 · in_channels``)."""

    input_size: int  # latent (or pixel) side at training
    patch_size: int
    in_channels: int
    out_channels: int
    num_classes: int
    hidden_size: int  # D, the token width (REPA's projector input)
    num_registers: int  # extra tokens after the patch tokens, dropped before the output
    grid: tuple[int, int]  # (rows, cols) of patch tokens at training
    blocks: nn.ModuleList  # residual blocks: FSDP2 units, REPA's hook, FLOPs, gate diagnostics

    def __call__(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor: ...
    # MeanFlow's models (built with interval_embed) also take ``interval=h`` (B,) or a number: h =
    # r - t, the span of the average velocity (0: the instantaneous one), and ``force_drop_ids``

    @property
    def has_null_class(self) -> bool:
        """Whether the label table has the null row ``num_classes`` (classifier-free guidance)."""
        ...

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in the backward pass (a runtime choice, not the architecture)."""
        ...
