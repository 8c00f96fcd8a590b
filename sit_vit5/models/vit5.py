"""ViT-5 (Wang et al. 2026) as a SiT diffusion backbone.

The paper only says ViT-5 is "plugged into SiT"; our choices where it is silent: SiT's conditioning
is kept (adaLN-Zero, c = t_emb + y_emb, same embedders and final layer), the modulated norms are
RMSNorm without a learnable weight (adaLN supplies the per-channel scale, as DiT drops LayerNorm's
affine), the learnable APE starts from the 2-D sin-cos table, registers share the adaLN modulation
and are dropped before the final layer, and LayerScale multiplies the adaLN gate. Every component is
a switch; with all switches at their SiT values (``switches.SIT_SWITCHES``) this class computes
exactly the SiT function.

LayerScale starts at γ0 = 1, the MLP keeps SiT's tanh GELU: why, with results: docs/DESIGN.md §3.
"""

from __future__ import annotations

from diffusers import ModelMixin  # noqa: F401  diffusers' pipeline loader looks it up here

from .layers import LAYER_SCALE_INITS  # noqa: F401  re-exported: the recipe's named inits
from .sit import SiT
from .switches import SIT_SWITCHES

#: The ViT-5 recipe (official classification code, commit b7b0796), generative LayerScale init.
VIT5_SWITCHES: dict = dict(
    norm="rmsnorm",
    qk_norm=True,
    qkv_bias=False,
    layer_scale_init=1.0,  # "generative"; the classification 1e-4 handicaps adaLN-Zero (DESIGN §3)
    mlp="gelu",  # SwiGLU + LayerScale is the paper's negative result: ablation only
    mlp_act="gelu_tanh",  # deviation: the official code uses exact GELU ("gelu"); we keep SiT's
    pos_embed="learned",  # APE and RoPE together
    rope=True,
    rope_theta=10000.0,
    num_registers=4,
    register_rope_theta=100.0,  # registers on a 2x2 grid with higher-frequency RoPE
)
assert VIT5_SWITCHES.keys() == SIT_SWITCHES.keys()


class ViT5(SiT):
    """SiT with ViT-5 block internals; any ``VIT5_SWITCHES`` entry can be overridden by keyword."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{**VIT5_SWITCHES, **kwargs})
