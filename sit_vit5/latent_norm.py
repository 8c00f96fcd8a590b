"""Latent normalisation: how a VAE's posterior ``x`` becomes the latent ``z`` the model sees.

    z = (x − shift) · scale        x = z / scale + shift        (per channel, or one number)

This is diffusers' convention for VAEs with a shift (SD3 / FLUX: ``scaling_factor``,
``shift_factor``). SD-VAE (DiT / SiT): scale 0.18215, no shift. Per-channel statistics
(LightningDiT's VA-VAE): shift = mean, scale = 1 / std of the training set's posterior means.
The ``vae`` config section holds it as ``scaling_factor`` and ``shift_factor`` (a number or a
list of one per channel); checkpoints, exported pipelines and ``sample.py`` take it from the run.
Plain Python until a tensor is touched: the config checks import no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .names import SD_VAE_SCALING_FACTOR
from .utils.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

Value = float | tuple[float, ...]
#: the config keys, for messages (the cache writer's command line passes its flags instead)
CONFIG_KEYS = {"scaling_factor": "vae.scaling_factor", "shift_factor": "vae.shift_factor",
               "latent_stats": "vae.latent_stats"}


def _value(raw: Any, key: str, positive: bool) -> Value:
    """A number or a non-empty list of finite numbers (``positive``: each > 0)."""
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    if not items or any(isinstance(v, bool) or not isinstance(v, (int, float))
                        or not math.isfinite(v) or (positive and v <= 0) for v in items):
        need = "positive " if positive else ""
        raise ConfigError(f"{key}={raw!r}: expected a finite {need}number or a list of one "
                          "per latent channel")
    values = tuple(float(v) for v in items)
    return values if isinstance(raw, (list, tuple)) else values[0]


def _length(value: Value | None) -> int | None:
    return len(value) if isinstance(value, tuple) else None


def _per_channel(value: Value, channels: int) -> tuple[float, ...]:
    return value if isinstance(value, tuple) else (value,) * channels


@dataclass(frozen=True)
class LatentNorm:
    """``z = (x − shift)·scale``; each a number or one value per channel (``shift`` None: 0)."""

    scale: Value = SD_VAE_SCALING_FACTOR
    shift: Value | None = None

    @classmethod
    def from_section(cls, section: Mapping[str, Any], keys: Mapping[str, str] = CONFIG_KEYS
                     ) -> LatentNorm:
        """From a ``vae`` section's ``scaling_factor`` / ``shift_factor`` (missing: SD-VAE's);
        ConfigError naming the key (``keys``: how messages name them)."""
        scale = _value(section.get("scaling_factor", SD_VAE_SCALING_FACTOR),
                       keys["scaling_factor"], positive=True)
        shift = section.get("shift_factor")
        shift = None if shift is None else _value(shift, keys["shift_factor"], positive=False)
        lengths = {n for n in (_length(scale), _length(shift)) if n is not None}
        if len(lengths) > 1:
            raise ConfigError(f"{keys['scaling_factor']} has {_length(scale)} values but "
                              f"{keys['shift_factor']} {_length(shift)}: one per latent "
                              "channel")
        return cls(scale, shift)

    @classmethod
    def from_stats(cls, mean: Sequence[float], std: Sequence[float]) -> LatentNorm:
        """Per-channel standardisation: shift = ``mean``, scale = 1 / ``std``."""
        return cls(tuple(1.0 / float(s) for s in std), tuple(float(m) for m in mean))

    @classmethod
    def from_vae_config(cls, config: Mapping[str, Any]) -> LatentNorm:
        """What a diffusers AutoencoderKL config says: ``latents_mean`` / ``latents_std`` (with
        ``scaling_factor``) when present, else ``scaling_factor`` / ``shift_factor``."""
        scale = float(config.get("scaling_factor") or SD_VAE_SCALING_FACTOR)
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if mean is not None and std is not None:
            return cls(tuple(scale / float(s) for s in std), tuple(float(m) for m in mean))
        shift = config.get("shift_factor")
        return cls(scale, None if shift is None else float(shift))

    def section(self) -> dict[str, Any]:
        """The ``vae`` section keys (lists for per-channel values): JSON / YAML safe, exact."""
        def plain(value: Value | None) -> Any:
            return list(value) if isinstance(value, tuple) else value
        return {"scaling_factor": plain(self.scale), "shift_factor": plain(self.shift)}

    def vae_config(self) -> dict[str, Any]:
        """diffusers AutoencoderKL config keys for pipelines that read them: per-channel values as
        ``latents_mean`` / ``latents_std`` with scaling_factor 1 (1/scale: exact to ~1 ulp)."""
        if self.per_channel:
            n = self.channels
            shift, scale = _per_channel(self.shift or 0.0, n), _per_channel(self.scale, n)
            return {"scaling_factor": 1.0, "shift_factor": None, "latents_mean": list(shift),
                    "latents_std": [1.0 / s for s in scale]}
        return {"scaling_factor": self.scale, "shift_factor": self.shift, "latents_mean": None,
                "latents_std": None}

    @property
    def per_channel(self) -> bool:
        """Whether either value is a list (one per channel)."""
        return isinstance(self.scale, tuple) or isinstance(self.shift, tuple)

    @property
    def channels(self) -> int | None:
        """How many channels the per-channel values are for (None: numbers only)."""
        return _length(self.scale) or _length(self.shift)

    def check_channels(self, channels: int, what: str = "the latents",
                       keys: Mapping[str, str] = CONFIG_KEYS) -> None:
        """ConfigError unless per-channel values have ``channels`` entries."""
        if self.channels not in (None, channels):
            key = keys["scaling_factor" if isinstance(self.scale, tuple) else "shift_factor"]
            raise ConfigError(f"{key} has {self.channels} values, but {what} "
                              f"{'has' if what[-1] != 's' else 'have'} {channels} channels")

    def check_vae(self, config: Mapping[str, Any], vae_name: str,
                  keys: Mapping[str, str] = CONFIG_KEYS) -> None:
        """Refuse what is ambiguous about a VAE's own shift: a number as shift for a VAE whose
        config has none, or no shift (and no per-channel values) for a VAE whose config has one."""
        own = config.get("shift_factor")
        if self.per_channel:
            return
        if self.shift is not None and own is None:
            raise ConfigError(
                f"{keys['shift_factor']}={self.shift} but the VAE {vae_name} has no shift_factor "
                f"in its config: drop the shift, or give one value per channel "
                f"({keys['latent_stats']}: cache)")
        if self.shift is None and own is not None:
            raise ConfigError(
                f"the VAE {vae_name} has shift_factor {own} and scaling_factor "
                f"{config.get('scaling_factor')} in its config, but {keys['shift_factor']} is "
                f"unset: set {keys['shift_factor']} and {keys['scaling_factor']} (the VAE's "
                f"values), or {keys['latent_stats']}: cache")

    def _like(self, value: Value, like: Tensor) -> float | Tensor:
        if not isinstance(value, tuple):
            return value  # a Python number: the SD-VAE path stays bit for bit as before
        import torch

        return torch.tensor(value, dtype=like.dtype, device=like.device).view(-1, 1, 1)

    def normalize(self, x: Tensor) -> Tensor:
        """Latents ``[..., C, h, w]`` from posterior values of the same shape."""
        if self.shift is not None:
            x = x - self._like(self.shift, x)
        return x * self._like(self.scale, x)

    def denormalize(self, z: Tensor) -> Tensor:
        """Posterior values from latents ``[..., C, h, w]`` (the inverse of :meth:`normalize`)."""
        x = z / self._like(self.scale, z)
        return x if self.shift is None else x + self._like(self.shift, x)

    def scale_std(self, std: Tensor) -> Tensor:
        """A posterior std ``[..., C, h, w]`` in latent units (the shift does not move it)."""
        return std * self._like(self.scale, std)

    def affine_to(self, to: LatentNorm, channels: int) -> tuple[Tensor, Tensor]:
        """``(gain, offset)``, float32 ``[C, 1, 1]``: latents normalised by this norm map to
        ``to``'s as ``z·gain + offset`` (a std as ``std·gain``); computed in float64."""
        import torch

        s_from, s_to = _per_channel(self.scale, channels), _per_channel(to.scale, channels)
        h_from = _per_channel(self.shift or 0.0, channels)
        h_to = _per_channel(to.shift or 0.0, channels)
        gain = [b / a for a, b in zip(s_from, s_to, strict=True)]
        offset = [(hf - ht) * st for hf, ht, st in zip(h_from, h_to, s_to, strict=True)]
        gain_t = torch.tensor(gain, dtype=torch.float32)  # on cpu: used in loader workers
        offset_t = torch.tensor(offset, dtype=torch.float32)  # on cpu: used in loader workers
        return gain_t.view(-1, 1, 1), offset_t.view(-1, 1, 1)
