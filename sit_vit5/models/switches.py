"""The architecture switches: every component ViT-5 changes, as one table with SiT's values, and
the one check of a model's switches and sizes (run by the model and by the config's ``model``
section, so a bad value is named before torch builds anything). ViT-5's values: ``vit5.py``."""

from __future__ import annotations

import math
from typing import Any

from ..utils.errors import ConfigError
from .layers import MLP_ACTS, MLPS, NORMS, resolve_layer_scale_init

#: Architecture switches and their SiT values; ViT5 overrides them (see vit5.py).
SIT_SWITCHES: dict = dict(
    norm="layernorm",  # block + final norm (no affine, eps 1e-6)
    qk_norm=False,  # per-head RMSNorm on q and k
    qkv_bias=True,
    layer_scale_init=None,  # LayerScale gamma init; None = off
    mlp="gelu",  # gelu | swiglu (FLOP-matched) | swiglu_vit5 (official: 4·D hidden, no biases)
    mlp_act="gelu_tanh",  # the GELU MLP's activation: gelu_tanh (SiT) | gelu (exact, ViT-5 code)
    pos_embed="fixed",  # fixed (frozen sin-cos) | learned (init sin-cos) | none
    rope=False,  # 2-D RoPE on patch tokens
    rope_theta=10000.0,
    num_registers=0,
    register_rope_theta=None,  # None = registers get no rotation
)
POS_EMBED_KINDS = ("fixed", "learned", "none")
#: the valid values of each choice-valued switch (configs are checked against these)
SWITCH_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": tuple(NORMS), "mlp": tuple(MLPS), "mlp_act": tuple(MLP_ACTS),
    "pos_embed": POS_EMBED_KINDS,
}
def rope_thetas(sw: dict[str, Any]) -> tuple[float | None, float | None]:
    """(patch theta, register theta) of a model with switches ``sw``; None = that part is not
    rotated. Registers rotate with their own theta whenever they have one, with or without patch
    RoPE."""
    patch = sw["rope_theta"] if sw["rope"] else None
    register = sw["register_rope_theta"] if sw["num_registers"] else None
    return patch, register


def check_switches(switches: dict[str, Any], prefix: str = "") -> None:
    """The choice-valued switches given in ``switches`` and LayerScale's named inits: ConfigError
    (a ValueError) naming ``<prefix>key=value`` and the valid values (``prefix`` "model." for the
    config)."""
    for key, choices in SWITCH_CHOICES.items():
        if key in switches and switches[key] not in choices:
            raise ConfigError(f"{prefix}{key}={switches[key]!r}; valid: {', '.join(choices)}")
    try:
        resolve_layer_scale_init(switches.get("layer_scale_init"))
    except ValueError as err:
        raise ConfigError(f"{prefix}{err}") from None


def check_architecture(hidden_size: int, num_heads: int, switches: dict[str, Any],
                       prefix: str = "") -> None:
    """The one check of a model's sizes and switches, for ``SiT.__init__`` and for the config's
    ``model`` section (``prefix`` "model."): :func:`check_switches`, heads that divide the width,
    a head dim 2-D RoPE can rotate (when anything rotates) and a square register grid (with
    register RoPE). ConfigError (a ValueError) naming ``<prefix>key=value``."""
    check_switches(switches, prefix)
    if hidden_size % num_heads:
        raise ConfigError(f"{prefix}hidden_size={hidden_size} is not divisible by "
                          f"{prefix}num_heads={num_heads}")
    patch_theta, register_theta = rope_thetas(switches)
    offs = [f"{prefix}{off}" for off, theta in (("rope=false", patch_theta),
                                                 ("register_rope_theta=null", register_theta))
            if theta is not None]  # the switches that would turn RoPE off
    head_dim = hidden_size // num_heads
    if offs and head_dim % 4:  # rows and columns each rotate channel pairs
        raise ConfigError(f"{prefix}hidden_size={hidden_size} / {prefix}num_heads={num_heads} = "
                          f"head dim {head_dim}: 2-D RoPE needs a head dim divisible by 4 (or "
                          f"{' and '.join(offs)})")
    regs = switches["num_registers"]
    if register_theta is not None and math.isqrt(regs) ** 2 != regs:
        raise ConfigError(f"{prefix}num_registers={regs}: register RoPE needs a perfect square "
                          f"(or {prefix}register_rope_theta=null)")
