"""diffusers' DiT format (``DiTTransformer2DModel``, the layout of the hub's
``facebook/DiT-XL-2-256``) in both directions, for our DiT-objective model (the SiT network with
``learn_sigma``, ``DiT-*`` names).

    model = from_diffusers_dit("facebook/DiT-XL-2-256")  # folder, pipeline folder or hub id
    to_diffusers_dit(model).save_pretrained("dit/transformer")  # DiTPipeline's transformer

The networks agree layer for layer; the layouts differ in three ways, all in ``RENAMES``: diffusers
splits qkv into ``to_q / to_k / to_v``; it gives every block its own copy of the timestep and class
embedders (converted DiTs hold identical copies; the final layer reads block 0's); it recomputes the
fixed sin-cos table instead of storing it. Two numerical conventions differ as well, and a
converted model keeps diffusers' through two constructor options: the timestep sinusoid divides by
``half - 1`` where DiT divides by ``half`` (``t_freq_shift=1``; DiT's own weights, trained with 0,
run this way in diffusers too), and the norm before the MLP uses the config's ``norm_eps`` (1e-5
unless set; ours 1e-6: ``mlp_norm_eps``). Without them the outputs differ (tiny random model: by
1.1 with DiT's frequencies, by 1.3e-5 with eps 1e-6). Inputs are DiT's: integer timesteps 0..999
and labels with ``num_classes`` as the null class; with ``learn_sigma`` both return 2C channels
(noise, then the variance values).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..latent_norm import LatentNorm
from ..names import SD_VAE_SCALING_FACTOR
from ..vae import SD_VAE_EMA
from .checkpoint_files import CheckpointError, LoadedModel, check_state_dict
from .layers import sincos_pos_embed_2d
from .pretrained import _CONFIG_KWARGS
from .registry import SIZES
from .sit import SiT
from .switches import SIT_SWITCHES

if TYPE_CHECKING:
    from diffusers import DiTTransformer2DModel

#: Ours -> diffusers' parameter prefixes ("{i}": block index). A name of ours without "{i}" mapped
#: to one with it is shared: copied into every block there. "{q,k,v}": our fused qkv, split in 3.
RENAMES: tuple[tuple[str, str], ...] = (
    ("x_embedder.proj", "pos_embed.proj"),
    ("t_embedder.mlp.0", "transformer_blocks.{i}.norm1.emb.timestep_embedder.linear_1"),
    ("t_embedder.mlp.2", "transformer_blocks.{i}.norm1.emb.timestep_embedder.linear_2"),
    ("y_embedder.embedding_table",
    "transformer_blocks.{i}.norm1.emb.class_embedder.embedding_table"),
    ("blocks.{i}.adaLN_modulation.1", "transformer_blocks.{i}.norm1.linear"),
    ("blocks.{i}.attn.qkv", "transformer_blocks.{i}.attn1.to_{q,k,v}"),
    ("blocks.{i}.attn.proj", "transformer_blocks.{i}.attn1.to_out.0"),
    ("blocks.{i}.mlp.fc1", "transformer_blocks.{i}.ff.net.0.proj"),
    ("blocks.{i}.mlp.fc2", "transformer_blocks.{i}.ff.net.2"),
    ("final_layer.adaLN_modulation.1", "proj_out_1"), ("final_layer.linear", "proj_out_2"),
)
#: diffusers' FeedForward activation name <-> our mlp_act
ACTIVATIONS = {"gelu-approximate": "gelu_tanh", "gelu": "gelu"}
#: the class names a DiT folder's config.json carries (the hub's predates DiTTransformer2DModel)
DIT_CLASS_NAMES = ("DiTTransformer2DModel", "Transformer2DModel")
#: config keys (some Transformer2DModel-era) that must keep these values for the DiT layout
_DIT_ONLY = {"norm_type": "ada_norm_zero", "norm_elementwise_affine": False,
             "cross_attention_dim": None, "num_vector_embeds": None, "only_cross_attention": False,
             "double_self_attention": False}
#: DDIMScheduler's defaults for the keys a scheduler_config.json may leave out
DDIM_DEFAULTS = {"num_train_timesteps": 1000, "beta_schedule": "linear", "beta_start": 1e-4,
                 "beta_end": 0.02}


def _expand(name: str, block: int | None) -> list[str]:
    """The full names of one table entry for ``block`` (three for the split qkv)."""
    name = name if block is None else name.replace("{i}", str(block))
    return [name.replace("{q,k,v}", p) for p in "qkv"] if "{q,k,v}" in name else [name]


def to_diffusers_state(state: dict[str, Tensor], depth: int) -> dict[str, Tensor]:
    """Our state dict (``depth`` blocks) -> DiTTransformer2DModel's (the fixed ``pos_embed``
    dropped)."""
    out = {}
    for ours, theirs in RENAMES:
        for block in range(depth) if "{i}" in theirs else [None]:
            src = ours.replace("{i}", str(block)) if "{i}" in ours else ours
            for suffix in ("weight", "bias"):
                if f"{src}.{suffix}" not in state:
                    continue
                tensor, names = state[f"{src}.{suffix}"], _expand(theirs, block)
                parts = tensor.chunk(3) if len(names) == 3 else (tensor,)
                out.update({f"{n}.{suffix}": p.clone() for n, p in zip(names, parts)})
    return out


def from_diffusers_state(state: dict[str, Tensor], depth: int, source: str = "the DiT folder"
                         ) -> dict[str, Tensor]:
    """DiTTransformer2DModel's state dict -> ours (without ``pos_embed``). Raises CheckpointError on
    tensors the table does not name, or per-block embedders that are not copies of one another."""
    out, used = {}, set()
    for ours, theirs in RENAMES:
        for block in range(depth) if "{i}" in ours else [None]:
            dst = ours.replace("{i}", str(block)) if block is not None else ours
            copies = range(depth) if "{i}" in theirs and block is None else [block]
            for suffix in ("weight", "bias"):
                found = [[f"{n}.{suffix}" for n in _expand(theirs, b)] for b in copies]
                if not all(n in state for names in found for n in names):
                    continue
                tensors = [torch.cat([state[n] for n in names]) for names in found]
                if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
                    raise CheckpointError(
                        f"{source}: the blocks' copies of {theirs.replace('{i}', 'N')}.{suffix} "
                        "differ; our DiT shares one timestep and class embedder (a converted DiT "
                        "has identical copies)")
                used.update(n for names in found for n in names)
                out[f"{dst}.{suffix}"] = tensors[0].clone()
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise CheckpointError(f"{source}: tensors the DiT layout does not have: {unexpected[:8]}")
    return out


def _check_dit_only(config: dict[str, Any], source: str) -> None:
    wrong = {k: config[k] for k, v in _DIT_ONLY.items() if k in config and config[k] != v}
    if wrong:
        raise CheckpointError(f"{source}: not a DiT configuration ({wrong}; DiT needs {_DIT_ONLY})")


def _model_kwargs(config: dict[str, Any], source: str) -> dict[str, Any]:
    """SiT constructor keywords of a DiTTransformer2DModel config (raises CheckpointError)."""
    _check_dit_only(config, source)
    act = config.get("activation_fn", "gelu-approximate")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{source}: activation_fn={act!r}; convertible: "
                              f"{sorted(ACTIVATIONS)}")
    heads, in_ch = config.get("num_attention_heads", 16), config.get("in_channels", 4)
    out_ch = config.get("out_channels") or in_ch
    if out_ch not in (in_ch, 2 * in_ch):
        raise CheckpointError(f"{source}: out_channels={out_ch} is neither in_channels={in_ch} nor "
                              "twice it (learned sigma)")
    return dict(
        input_size=config.get("sample_size", 32), patch_size=config.get("patch_size", 2),
        in_channels=in_ch, hidden_size=heads * config.get("attention_head_dim", 72),
        depth=config.get("num_layers", 28), num_heads=heads, mlp_ratio=4.0,
        class_dropout_prob=0.1,  # diffusers' LabelEmbedding always has the null-class row
        num_classes=config.get("num_embeds_ada_norm", 1000), learn_sigma=out_ch == 2 * in_ch,
        qkv_bias=config.get("attention_bias", True), mlp_act=ACTIVATIONS[act],
        t_freq_shift=1, mlp_norm_eps=config.get("norm_eps", 1e-5),
    )


def dit_model_name(model: SiT) -> str:
    """The registry name (``DiT-XL/2`` ...) of a model's sizes, else a description of them."""
    sizes = (len(model.blocks), model.x_embedder.proj.out_channels, model.num_heads)
    size = next((s for s, v in SIZES.items() if v == sizes), None)
    if size is not None:
        return f"DiT-{size}/{model.patch_size}"
    return f"DiT (depth {sizes[0]}, hidden {sizes[1]}, heads {sizes[2]}, patch {model.patch_size})"


def dit_folder(path: str | os.PathLike) -> tuple[Path, str | None] | None:
    """``(folder, subfolder)`` of a local diffusers DiT folder (a transformer folder, or a pipeline
    folder whose transformer is one), None when ``path`` is not one."""
    path = Path(path)
    index = path / "model_index.json"
    if index.is_file():
        entry = json.loads(index.read_text()).get("transformer") or [None, None]
        if entry[1] in DIT_CLASS_NAMES and (path / "transformer" / "config.json").is_file():
            return path, "transformer"
        return None
    config = path / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("_class_name") in DIT_CLASS_NAMES:
        return path, None
    return None


def from_diffusers_dit(source: str | os.PathLike | DiTTransformer2DModel, **kwargs: Any) -> SiT:
    """Our DiT model with the weights of a DiTTransformer2DModel: an instance, a local folder (a
    transformer folder or a pipeline folder) or a hub id (``kwargs``: diffusers' from_pretrained
    keywords: cache_dir, local_files_only, revision, subfolder ...). CPU, eval mode, no gradients;
    its forward gives diffusers' output for the same inputs (all 2C channels with a learned sigma).
    """
    from diffusers import DiTTransformer2DModel

    if isinstance(source, DiTTransformer2DModel):
        dit, where = source, "the DiTTransformer2DModel"
    else:
        where = os.fspath(source)
        config_kwargs = {k: v for k, v in kwargs.items() if k in _CONFIG_KWARGS}
        if os.path.isdir(where) and "subfolder" not in kwargs:
            local = dit_folder(where)
            if local is None:
                raise CheckpointError(f"{where}: not a diffusers DiT folder (no config.json or "
                                      f"model_index.json naming one of {list(DIT_CLASS_NAMES)})")
            config_kwargs["subfolder"] = kwargs["subfolder"] = local[1]
        try:
            config = DiTTransformer2DModel.load_config(where, **config_kwargs)
        except OSError:
            if "subfolder" in kwargs:
                raise
            # a hub pipeline repo (facebook/DiT-XL-2-256): the transformer is in its subfolder
            config_kwargs["subfolder"] = kwargs["subfolder"] = "transformer"
            config = DiTTransformer2DModel.load_config(where, **config_kwargs)
        if config.get("_class_name") not in DIT_CLASS_NAMES:
            raise CheckpointError(f"{where}: config.json is for class "
                                  f"{config.get('_class_name')!r}, expected one of "
                                  f"{list(DIT_CLASS_NAMES)}")
        _check_dit_only(config, where)  # before diffusers drops the keys its DiT class ignores
        dit, info = DiTTransformer2DModel.from_pretrained(where, output_loading_info=True, **kwargs)
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise CheckpointError(f"{where}: the weights do not fit DiTTransformer2DModel: {bad}")
    model = SiT(**_model_kwargs(dict(dit.config), where))
    state = from_diffusers_state(dit.state_dict(), len(model.blocks), where)
    state["pos_embed"] = model.pos_embed.detach().clone()  # the fixed table diffusers recomputes
    state = {k: v.float() for k, v in state.items()}
    check_state_dict(model, state, source=where)
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)


def load_dit_folder(path: str | os.PathLike, model_name: str | None = None,
                    objective: str | None = None) -> LoadedModel:
    """``load_model`` for a local diffusers DiT folder: the converted model (objective ddpm, DiT's
    learned or fixed variance) and, for a pipeline folder, its ``vae/`` and that VAE's latent scale
    (else the SD-VAE ft-EMA for 4-channel models, as for DiT's own files)."""
    if objective not in (None, "ddpm"):
        raise ValueError(f"{path} is a diffusers DiT (objective ddpm), not {objective}")
    model = from_diffusers_dit(path)
    name = dit_model_name(model)
    if model_name is not None and model_name != name:
        raise ValueError(f"{path} holds a {name}, not {model_name!r}; drop the model name (the "
                         "folder's config.json carries the architecture)")
    vae = {"name": SD_VAE_EMA if model.in_channels == 4 else "none",
           "scaling_factor": SD_VAE_SCALING_FACTOR}
    vae_config = Path(path) / "vae" / "config.json"
    if vae_config.is_file():
        norm = LatentNorm.from_vae_config(json.loads(vae_config.read_text()))
        vae = {"name": str(vae_config.parent), **norm.section()}
    variance = "learned" if model.learn_sigma else "fixed_large"
    objective = {"objective": "ddpm", "ddpm_variance": variance, **folder_schedule(path)}
    return LoadedModel(model, name, "diffusers", model.input_size, model.in_channels,
                       model.num_classes, objective=objective, vae=vae)


def diffusers_schedule(noise_schedule: str, steps: int) -> dict[str, Any]:
    """The diffusers scheduler settings of one of our noise schedules (sit_vit5.diffusion.schedule:
    DDPM's linear 1e-4..0.02 scaled by 1000 / steps, IDDPM's cosine = "squaredcos_cap_v2")."""
    if noise_schedule == "linear":
        return dict(num_train_timesteps=steps, beta_schedule="linear",
                    beta_start=1e-4 * 1000 / steps, beta_end=0.02 * 1000 / steps)
    if noise_schedule in ("cosine", "squaredcos_cap_v2"):
        return dict(num_train_timesteps=steps, beta_schedule="squaredcos_cap_v2")
    raise CheckpointError(f"noise_schedule={noise_schedule!r} has no diffusers scheduler setting")


def folder_schedule(path: str | os.PathLike) -> dict[str, Any]:
    """The ddpm keys (diffusion_steps, noise_schedule) a pipeline folder's scheduler config names;
    {} (DiT's linear 1000 steps) without one. Raises CheckpointError for betas we do not have."""
    file = Path(path) / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        return {}
    cfg = json.loads(file.read_text())
    steps = cfg.get("num_train_timesteps", 1000)
    for kind in ("linear", "cosine"):
        want = diffusers_schedule(kind, steps)
        got = {k: cfg.get(k, DDIM_DEFAULTS.get(k)) for k in want}
        if not cfg.get("trained_betas") and all(
                got[k] == v if isinstance(v, (int, str)) else abs(got[k] - v) < 1e-9
                for k, v in want.items()):
            return {"diffusion_steps": steps, "noise_schedule": kind}
    raise CheckpointError(f"{file}: a noise schedule the ddpm objective does not have "
                          f"(beta_schedule={cfg.get('beta_schedule')!r}, beta_start/end, "
                          "trained_betas); ours: DDPM's linear (scaled to the steps) or cosine")


def dit_config(model: SiT) -> dict[str, Any]:
    """DiTTransformer2DModel constructor keywords for ``model`` (raises CheckpointError for an
    architecture that class cannot express)."""
    sw = model.switches
    unused = ("qkv_bias", "mlp_act", "rope_theta", "register_rope_theta")  # mapped, or moot without
    fixed = {k: v for k, v in SIT_SWITCHES.items() if k not in unused}
    off = {k: sw[k] for k, v in fixed.items() if sw[k] != v}
    problems = [f"switches {off} (DiT has {({k: fixed[k] for k in off})})"] if off else []
    hidden = model.x_embedder.proj.out_channels
    if model.blocks[0].mlp.fc1.out_features != 4 * hidden:
        problems.append("an MLP ratio other than 4")
    if model.y_embedder.embedding_table.num_embeddings != model.num_classes + 1:
        problems.append("no null-class row (class_dropout_prob=0)")
    if problems:
        raise CheckpointError(f"{type(model).__name__} with {'; '.join(problems)} has no "
                              "DiTTransformer2DModel equivalent")
    return dict(
        num_attention_heads=model.num_heads, attention_head_dim=hidden // model.num_heads,
        in_channels=model.in_channels, out_channels=model.out_channels,
        num_layers=len(model.blocks),
        attention_bias=sw["qkv_bias"], sample_size=model.input_size, patch_size=model.patch_size,
        activation_fn={v: k for k, v in ACTIVATIONS.items()}[sw["mlp_act"]],
        num_embeds_ada_norm=model.num_classes, norm_type="ada_norm_zero",
        norm_elementwise_affine=False, norm_eps=model.blocks[0].norm2.eps,
    )


def to_diffusers_dit(model: SiT) -> DiTTransformer2DModel:
    """A DiTTransformer2DModel with ``model``'s weights (fp32, eval mode). A model with DiT's own
    timestep frequencies (``t_freq_shift=0``: every model trained here) is converted with a warning:
    diffusers has no setting for them, so its outputs are an approximation of this model's."""
    from diffusers import DiTTransformer2DModel

    if model.t_embedder.freq_shift != 1:
        warnings.warn("diffusers' DiTTransformer2DModel embeds timesteps with frequencies "
                      "1e4^(-i/127), this model with DiT's 1e4^(-i/128): the written model only "
                      "approximates it (as diffusers' facebook/DiT-XL-2-256 approximates DiT)",
                      stacklevel=2)
    fixed = sincos_pos_embed_2d(model.pos_embed.shape[-1], *model.grid)
    if not torch.allclose(model.pos_embed.detach()[0].float(), fixed, atol=1e-6):
        raise CheckpointError("the model's pos_embed is not the fixed sin-cos table, which "
                              "DiTTransformer2DModel recomputes instead of storing")
    dit = DiTTransformer2DModel(**dit_config(model))
    ours = {k: v.float() for k, v in model.state_dict().items()}
    state = to_diffusers_state(ours, len(model.blocks))
    own = dit.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:  # the table and diffusers' class disagree: a diffusers change
        raise CheckpointError(f"DiT conversion: missing {missing[:8]}, unexpected {unexpected[:8]}")
    dit.load_state_dict(state, strict=True)
    return dit.eval().requires_grad_(False)


def dit_scheduler(ddpm: dict[str, Any]) -> Any:
    """diffusers' DDIMScheduler on the noise schedule of ``ddpm`` (the resolved ddpm settings,
    ``objective.ddpm_settings``: DiT's linear 1000 steps by default), epsilon prediction."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(**diffusers_schedule(ddpm["noise_schedule"], ddpm["diffusion_steps"]),
                         clip_sample=False, prediction_type="epsilon")


def dit_pipeline(loaded: LoadedModel, vae: Any, ddpm: dict[str, Any]) -> Any:
    """diffusers' own ``DiTPipeline`` for a DiT-objective model: its DiTTransformer2DModel, ``vae``
    (an AutoencoderKL; DiTPipeline always decodes) and ``dit_scheduler(ddpm)``. Raises
    CheckpointError for a model DiTPipeline cannot sample (SiT objective, pixel space,
    architecture)."""
    from diffusers import DiTPipeline

    if loaded.objective_name != "ddpm":
        raise CheckpointError(f"{loaded.name} is a {loaded.objective_name}-objective model; "
                              "DiTPipeline samples DiT's (ddpm, epsilon): export it in our format")
    if vae is None:
        raise CheckpointError(f"{loaded.name} is a pixel-space model; DiTPipeline always decodes "
                              "latents with a VAE")
    return DiTPipeline(transformer=to_diffusers_dit(loaded.model), vae=vae,
                       scheduler=dit_scheduler(ddpm))


__all__ = ["ACTIVATIONS", "DIT_CLASS_NAMES", "RENAMES", "diffusers_schedule", "dit_config",
           "dit_folder", "dit_model_name", "dit_pipeline", "dit_scheduler", "folder_schedule",
           "from_diffusers_dit", "from_diffusers_state", "load_dit_folder", "to_diffusers_dit",
           "to_diffusers_state"]
