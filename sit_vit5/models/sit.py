"""SiT/DiT backbone exactly as published (Peebles & Xie 2023; Ma et al. 2024).

State-dict keys, initialisation and forward match the official code, so a released checkpoint loads
with ``strict=True``. The class takes the architecture switches ViT-5 changes (``switches.py``,
defaults = SiT), so that the two backbones share every line where the architectures agree.

Hub-native: the classes are diffusers ``ModelMixin`` + ``ConfigMixin`` models, so
``model.save_pretrained(dir)`` writes ``config.json`` (every constructor argument and switch) and
``diffusion_pytorch_model.safetensors`` (the same DiT key names),
``SiT.from_pretrained(dir_or_repo_id)`` / ``ViT5.from_pretrained(...)`` rebuild them (strictly:
``pretrained.py``),
``push_to_hub(repo_id)`` uploads them, and a model can be a component of a
``diffusers.DiffusionPipeline`` (``sit_vit5.pipeline.SiTPipeline``).

Shapes: B batch, C channels, H x W input, p patch size, (h, w) = (H/p, W/p) patch grid, T = h*w
patch tokens, R registers, N = T + R the sequence the blocks see (layers.py's N), D hidden width.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..guidance import forward_with_cfg
from .layers import (
    Block,
    FinalLayer,
    LabelEmbedder,
    PatchEmbed,
    TimestepEmbedder,
    resolve_layer_scale_init,
    sincos_pos_embed_2d,
)
from .pretrained import StrictPretrained
from .rope import RopeTables
from .switches import SIT_SWITCHES, check_architecture, rope_thetas


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls run in: the autocast dtype when autocast is on for x's device, else
    x.dtype."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class SiT(StrictPretrained, ModelMixin, ConfigMixin):
    """Class-conditional velocity network: (x (B, C, H, W), t (B,) in [0, 1], y (B,)) ->
    (B, C_out, H, W), C_out = 2C with ``learn_sigma`` (every official file), else C; a
    :class:`~sit_vit5.models.backbone.Backbone`.

    The output is DiT's contract: the prediction, then DiT's variance half. Official SiT's forward
    drops that half and returns C channels; code ported from SiT's repository takes
    ``model(x, t, y)[:, :C]`` (equal to it to 0.0).

    ``t_freq_shift`` (0) and ``mlp_norm_eps`` (1e-6) are DiT/SiT's timestep frequencies and MLP-norm
    eps; a model converted from diffusers' ``DiTTransformer2DModel`` keeps that class's 1 and its
    ``norm_eps`` (``sit_vit5.models.diffusers_dit``).
    """

    # grad_checkpointing is a runtime choice, not part of the architecture a saved model records
    ignore_for_config = ["grad_checkpointing"]

    @staticmethod
    def _get_init_keys(input_class: type) -> set[str]:
        """Constructor keys diffusers passes back from config.json: the signature's and every switch
        (switches arrive through ``**switches``, which diffusers cannot see in the signature)."""
        return {*inspect.signature(SiT.__init__).parameters, *SIT_SWITCHES} - {"switches"}

    def __init__(
        self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
        hidden_size: int = 1152, depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1, num_classes: int = 1000, learn_sigma: bool = True,
        grad_checkpointing: bool = False, t_freq_shift: int = 0, mlp_norm_eps: float = 1e-6,
        interval_embed: bool = False, **switches,
    ) -> None:
        super().__init__()
        unknown = set(switches) - set(SIT_SWITCHES)
        if unknown:
            raise TypeError(f"unknown model option(s) {sorted(unknown)}; "
                            f"valid switches: {sorted(SIT_SWITCHES)}")
        sw = {**SIT_SWITCHES, **switches}
        check_architecture(hidden_size, num_heads, sw)  # the layers below trust these values
        # names resolved here, for every backbone: config.json records the number
        sw["layer_scale_init"] = resolve_layer_scale_init(sw["layer_scale_init"])
        if t_freq_shift not in (0, 1) or not mlp_norm_eps > 0:
            raise ValueError(f"t_freq_shift must be 0 (DiT/SiT) or 1 (diffusers' DiT), got "
                             f"{t_freq_shift!r}; mlp_norm_eps must be > 0, got {mlp_norm_eps!r}")
        self.switches = sw
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma, self.num_classes, self.num_heads = learn_sigma, num_classes, num_heads
        self.hidden_size = hidden_size
        self.grad_checkpointing = grad_checkpointing
        self.grid = (input_size // patch_size, input_size // patch_size)  # training (rows, cols)
        self.num_registers = sw["num_registers"]

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size, freq_shift=t_freq_shift)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        n_patches = self.grid[0] * self.grid[1]
        if sw["pos_embed"] == "none":
            self.pos_embed = None
        else:  # DiT keeps the fixed table as a frozen Parameter (key "pos_embed")
            table = torch.zeros(1, n_patches, hidden_size)  # on cpu: a parameter, moved by .to
            self.pos_embed = nn.Parameter(table, requires_grad=sw["pos_embed"] == "learned")
        if self.num_registers:
            self.register_tokens = nn.Parameter(
                torch.zeros(1, self.num_registers, hidden_size))  # on cpu: a parameter
        patch_theta, register_theta = rope_thetas(sw)
        self.rope = None
        if patch_theta is not None or register_theta is not None:
            self.rope = RopeTables(hidden_size // num_heads, self.grid, patch_theta,
                                   self.num_registers, register_theta)
        block_keys = ("norm", "qk_norm", "qkv_bias", "layer_scale_init", "mlp", "mlp_act")
        block_sw = {k: sw[k] for k in block_keys}
        self.blocks = nn.ModuleList(
            [Block(hidden_size, num_heads, mlp_ratio, mlp_norm_eps=mlp_norm_eps, **block_sw)
             for _ in range(depth)]
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, sw["norm"])
        # MeanFlow's second time (objective/meanflow.py): an embedding of the interval h = r - t,
        # added to c. Off (None, no parameters) for the sit and ddpm objectives. Registered and
        # initialised last, so the other weights draw the same random numbers as without it.
        self.interval_embed, self.h_embedder = interval_embed, None
        if interval_embed:
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws: not from ours
                self.h_embedder = TimestepEmbedder(hidden_size, freq_shift=t_freq_shift)
        self.initialize_weights()
        # config.json: the resolved architecture (ViT5's switch defaults included), not just what
        # was passed. Registered last: the switch `pos_embed` shares its name with the parameter.
        self.register_to_config(
            input_size=input_size, patch_size=patch_size, in_channels=in_channels,
            hidden_size=hidden_size, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
            class_dropout_prob=class_dropout_prob, num_classes=num_classes, learn_sigma=learn_sigma,
            t_freq_shift=t_freq_shift, mlp_norm_eps=mlp_norm_eps, **sw,
        )
        if interval_embed:  # only then: a flow model's config.json stays as it was
            self.register_to_config(interval_embed=True)

    def __getattr__(self, name: str):
        # parameters and submodules first, then diffusers' config-key fallback (pos_embed is both)
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            return super().__getattr__(name)

    def initialize_weights(self) -> None:
        """DiT init: xavier Linears, N(0, 0.02) embedders, zero adaLN and output => the output is
        exactly 0."""

        interval = set() if self.h_embedder is None else set(self.h_embedder.modules())

        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear) and module not in interval:
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        if self.pos_embed is not None:
            table = sincos_pos_embed_2d(self.pos_embed.shape[-1], *self.grid)  # (T, D)
            self.pos_embed.data.copy_(table.unsqueeze(0))
        if self.num_registers:
            nn.init.trunc_normal_(self.register_tokens, std=0.02)  # ViT-5: registers ~ TN(0, 0.02)
        w = self.x_embedder.proj.weight.data  # patch conv initialised like a Linear
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for layer in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        if self.h_embedder is not None:  # last: the draws above are those of a model without it
            first, last = self.h_embedder.mlp[0], self.h_embedder.mlp[2]
            nn.init.normal_(first.weight, std=0.02)  # as the t embedder
            nn.init.zeros_(first.bias)
            nn.init.zeros_(last.weight)  # zero: at init the interval changes nothing
            nn.init.zeros_(last.bias)

    @property
    def has_null_class(self) -> bool:
        """Whether the label table has the null row ``num_classes`` (trained with class dropout)."""
        return self.y_embedder.embedding_table.num_embeddings > self.num_classes

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in the backward pass (saves activation memory, ~30% more
        compute)."""
        self.grad_checkpointing = enabled

    def pos_embed_for(self, grid: tuple[int, int]) -> Tensor:
        """Absolute position table (1, h*w, D); resampled bicubically when the grid differs from
        training."""
        if grid == self.grid:
            return self.pos_embed
        table = self.pos_embed.reshape(1, *self.grid, -1).permute(0, 3, 1, 2)  # (1, D, h0, w0)
        table = F.interpolate(table.float(), size=grid, mode="bicubic", align_corners=False)
        table = table.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)  # (1, h*w, D)
        return table.to(self.pos_embed.dtype)

    def unpatchify(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """(B, h*w, p*p*C) -> (B, C, h*p, w*p)."""
        (h, w), p, c = grid, self.patch_size, self.out_channels
        x = x.reshape(x.shape[0], h, w, p, p, c)  # (B, h, w, p, p, C)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def interval_embedding(self, interval: Tensor | float, batch: int) -> Tensor:
        """(B, D): ``h_embedder(h) - h_embedder(0)`` for the interval ``h`` (a number, () or (B,),
        in units of t). Exactly 0 at h = 0 for any weights, so r = t is the model's (t, y) function;
        the constant it drops would only duplicate the t embedder's last bias."""
        if self.h_embedder is None:
            raise ValueError("this model has no interval embedding (built with "
                             "interval_embed=False: a sit or ddpm model); it takes no interval")
        h = torch.as_tensor(interval, device=self.h_embedder.mlp[0].weight.device)
        h = h.reshape(-1).expand(batch) if h.numel() == 1 else h.reshape(batch)
        both = self.h_embedder(torch.cat([h, h.new_zeros(1)]))  # (B + 1, D): one call
        return both[:-1] - both[-1:]

    def forward(self, x: Tensor, t: Tensor, y: Tensor, interval: Tensor | float | None = None,
                force_drop_ids: Tensor | None = None) -> Tensor:
        """The full output (B, C_out, H, W): C channels, or 2C with learn_sigma (as DiT: the
        prediction, then DiT's variance values, which SiT's transport ignores); the objective reads
        what it needs. Official SiT's forward returns only ``[:, :C]`` (see the class docstring).

        ``interval`` (MeanFlow, a model with ``interval_embed``): the interval h = r - t of the
        average velocity, a number or (B,), in units of t; None = 0 (the instantaneous velocity).
        ``force_drop_ids`` (B,): 1 = use the null label; given, it replaces the random label
        dropout of training (MeanFlow's target must know which labels were dropped)."""
        p = self.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"input spatial size {tuple(x.shape[-2:])} is not divisible by "
                             f"patch size {p}")
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        x = self.x_embedder(x)  # (B, T, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed_for(grid)
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop_ids)  # (B, D)
        if interval is not None:
            c = c + self.interval_embedding(interval, len(c))
        if self.num_registers:
            registers = self.register_tokens.expand(x.shape[0], -1, -1).to(x.dtype)  # (B, R, D)
            x = torch.cat([x, registers], dim=1)  # (B, N, D), N = T + R
        rope = None
        if self.rope is not None:
            rope = self.rope(grid, x.device, _compute_dtype(x))
        for block in self.blocks:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, c, rope, use_reentrant=False)
            else:
                x = block(x, c, rope)
        # registers are dropped before the output layer
        x = self.final_layer(x[:, : grid[0] * grid[1]], c)  # (B, T, p*p*C_out)
        x = self.unpatchify(x, grid)  # (B, C_out, H, W)
        return x

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float,
                         cfg_channels: int | None = None,
                         interval: tuple[float, float] | None = None) -> Tensor:
        """Guided forward on a doubled batch (``x = cat([z, z])``, ``y = cat([labels, null])``), as
        in SiT.

        ``cfg_channels=None`` guides all channels; ``3`` reproduces the official legacy mode.
        """
        return forward_with_cfg(self.forward, x, t, y, cfg_scale, cfg_channels, interval)
