"""Classifier-free guidance: guided = uncond + scale * (cond - uncond).

Convention (SiT/DiT): the label table has ``num_classes + 1`` rows; id ``num_classes`` is null.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .utils.errors import SettingError

ModelFn = Callable[..., Tensor]
#: first guided step: max |guided| / max(|cond|, |uncond|) above this means saturated images
#: (scales 1-20 stay below 1 + 2 x scale; 1000 needs scales near 500)
CFG_BLOWUP_RATIO = 1e3


def check_guided(cond: Tensor, uncond: Tensor, guided: Tensor, cfg_scale: float) -> None:
    """Raise SettingError naming ``cfg_scale`` when guiding finite predictions made them non-finite
    or ``CFG_BLOWUP_RATIO`` times larger (non-finite model outputs: the sampler's check)."""
    if not (bool(torch.isfinite(cond).all()) and bool(torch.isfinite(uncond).all())):
        return
    own = max(float(cond.abs().max()), float(uncond.abs().max()))
    if not bool(torch.isfinite(guided).all()):
        raise SettingError("cfg_scale", cfg_scale, ": the guided prediction overflows (inf/NaN) "
                           "on the first step; use a scale of about 1-10 (1 = no guidance)")
    ratio = float(guided.abs().max()) / max(own, 1e-12)
    if ratio > CFG_BLOWUP_RATIO:
        raise SettingError("cfg_scale", cfg_scale, ": on the first step the guided prediction "
                           f"is {ratio:.3g} x the model's own, so the images would come out one "
                           "constant colour; use a scale of about 1-10 (1 = no guidance)")


def mix(cond: Tensor, uncond: Tensor, cfg_scale: float, cfg_channels: int | None = None) -> Tensor:
    """Guided prediction of shape ``cond.shape``; ``cfg_channels=3`` (GLIDE/DiT/SiT legacy) guides
    channels 0..2 only and keeps ``cond`` for the rest; None guides all."""
    guided = uncond + cfg_scale * (cond - uncond)
    if cfg_channels is None:
        return guided
    return torch.cat([guided[:, :cfg_channels], cond[:, cfg_channels:]], dim=1)


def in_interval(t: Tensor, interval: tuple[float, float] | None, batch: int) -> Tensor:
    """Boolean mask ``(batch,)``: where ``t_lo <= t <= t_hi`` (everywhere if None)."""
    t = torch.as_tensor(t).reshape(-1)
    t = t.expand(batch) if t.numel() == 1 else t
    if interval is None:
        return torch.ones(batch, dtype=torch.bool, device=t.device)
    t_lo, t_hi = interval
    return (t >= t_lo) & (t <= t_hi)


def forward_with_cfg(forward: ModelFn, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float,
                     cfg_channels: int | None = None,
                     interval: tuple[float, float] | None = None) -> Tensor:
    """SiT's guided forward on a doubled batch ``x = cat([z, z])``, ``y = cat([labels, null])``.
    Returns ``(2B, C, H, W)``, the guided prediction in both halves (legacy ``cfg_channels``: the
    unguided channels keep each half's own), as the official sample scripts.
    """
    half = x[: len(x) // 2]
    out = forward(torch.cat([half, half], dim=0), t, y)
    cond, uncond = out.chunk(2, dim=0)
    guided = mix(cond, uncond, cfg_scale, cfg_channels)
    t = torch.as_tensor(t).reshape(-1)
    keep = in_interval(t[: len(half)], interval, len(half)).view(-1, *([1] * (cond.dim() - 1)))
    guided = torch.where(keep, guided, cond)
    if cfg_channels is None:
        return torch.cat([guided, guided], dim=0)
    c = cfg_channels
    return torch.cat([guided, torch.cat([guided[:, :c], uncond[:, c:]], dim=1)], dim=0)


class ClassifierFreeGuidance:
    """A class-conditional ``model(x, t, y)`` as a guided ``fn(x, t, y)`` on a plain batch. The
    unconditional pass (label ``null_class``) is skipped when ``cfg_scale == 1`` or no sample is
    inside ``interval``; the first guided call is checked (:func:`check_guided`).
    """

    def __init__(self, model: ModelFn, cfg_scale: float, null_class: int,
                 cfg_channels: int | None = None, interval: tuple[float, float] | None = None
                 ) -> None:
        self.model, self.cfg_scale, self.null_class = model, float(cfg_scale), int(null_class)
        self.cfg_channels, self.interval = cfg_channels, interval
        self.checked = False  # check_guided ran on a guided step

    def __call__(self, x: Tensor, t: Tensor, y: Tensor, **kwargs) -> Tensor:
        t = torch.as_tensor(t, device=x.device, dtype=x.dtype)
        t = t.expand(len(x)) if t.dim() == 0 else t
        # the mask (a host sync per step on a GPU) only where an interval makes one
        active = None if self.interval is None else in_interval(t, self.interval, len(x))
        if self.cfg_scale == 1.0 or (active is not None and not bool(active.any())):
            return self.model(x, t, y, **kwargs)
        null = torch.full_like(y, self.null_class)
        out = self.model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]), **kwargs)
        cond, uncond = out.chunk(2, dim=0)
        guided = mix(cond, uncond, self.cfg_scale, self.cfg_channels)
        if not self.checked:
            check_guided(cond, uncond, guided, self.cfg_scale)
            self.checked = True
        if active is None:
            return guided
        return torch.where(active.view(-1, *([1] * (x.dim() - 1))), guided, cond)
