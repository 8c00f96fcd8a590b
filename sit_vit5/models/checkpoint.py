"""Loading model weights: our training checkpoints and the official SiT/DiT files, and
``load_model``, the one way from a checkpoint file to a ready model plus what it says about sampling
from it.

Accepted layouts: a bare state dict (the released ``SiT-XL-2-256.pt`` is the EMA weights), a
training checkpoint ``{model, ema, opt, args, ...}`` (DiT/SiT and ours), or a ``.safetensors`` file.
Pickles are opened with ``weights_only=True``; when a ``<file>.sha256`` sidecar exists it is
verified first.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import SitVit5Error
from ..io import PAYLOAD_DIGEST_KEY, ChecksumError, verify_payload_digest, verify_sha256, verify_sidecar
from ..vae import SD_VAE_EMA, SD_VAE_SCALING_FACTOR
from .registry import create_model, list_models, model_kwargs, name_objective

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
#: the transport section's create_transport keys (the rest belong to the ddpm objective)
_TRANSPORT_KEYS = ("path_type", "prediction", "loss_weight", "train_eps", "sample_eps")


class CheckpointError(SitVit5Error, RuntimeError):
    """A checkpoint that cannot be read or does not fit the model."""


#: Top-level keys of the training checkpoints this codebase writes (sit_vit5.training.checkpoint).
CHECKPOINT_KEYS = frozenset({"model", "ema", "opt", "args", "step", "epoch", "batch_in_epoch", "rng",
                             "versions", "model_name", "scaler", PAYLOAD_DIGEST_KEY})


def read_checkpoint(path: str | os.PathLike, sha256: str | None = None) -> dict:
    """Read a checkpoint file into a dict without executing code (weights_only / safetensors).

    Checked before unpickling: ``sha256`` or the ``.sha256`` sidecar. Without either, checked after:
    the SHA-256 of the content stored inside the file (``payload_sha256``, written by our training
    checkpoints), so a damaged ``.pt`` copied without its sidecar is refused too (with a verified
    file digest it would only repeat that check, touching every page of an XL checkpoint's memory
    map at once); a checkpoint of ours (``args`` a
    dict) with a key we never write is refused as well (a damaged key name, of the digest say, must
    not pass for a file without one)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if sha256:
            verify_sha256(path, sha256)
        file_verified = bool(sha256) or verify_sidecar(path)
    except ChecksumError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or was altered: {err}") from err
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    # Official DiT/SiT training checkpoints store argparse.Namespace as "args": a plain attribute bag.
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot be read as a weights-only checkpoint ({err})") from err
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    unknown = sorted(map(str, set(obj) - CHECKPOINT_KEYS))
    if isinstance(obj.get("args"), dict) and unknown:
        raise CheckpointError(f"checkpoint {path} is corrupt or was altered: unexpected key(s) {unknown}")
    try:
        if not file_verified:
            verify_payload_digest(obj, path)
    except ChecksumError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or was altered: {err}") from None
    return obj


def load_state_dict(path: str | os.PathLike, which: str = "ema", sha256: str | None = None) -> dict[str, Tensor]:
    """The model state dict stored in ``path``: ``which`` = "ema" (default) or "model" of a training
    checkpoint."""
    obj = read_checkpoint(path, sha256)
    if which not in ("ema", "model"):
        raise ValueError(f"which must be 'ema' or 'model', got {which!r}")
    if "model" in obj or "ema" in obj:
        if which not in obj:
            raise CheckpointError(f"{path}: has no {which!r} entry (keys: {sorted(obj)})")
        obj = obj[which]
    return strip_wrappers(obj)


def strip_wrappers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Keys without the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes."""
    out = {}
    for key, value in state.items():
        for prefix in _WRAPPER_PREFIXES:
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def _depth(keys) -> int:
    """Number of transformer blocks named in state-dict ``keys`` (``blocks.N.``)."""
    ids = {int(k.split(".")[1]) for k in keys if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    return max(ids) + 1 if ids else 0


def _hints(model: nn.Module, shapes: dict[str, tuple[tuple, tuple]], own_keys, state_keys) -> list[str]:
    """Likely causes of a mismatch; each hint fires only when the shapes it reads really show it."""
    hints = []
    hidden = shapes.get("t_embedder.mlp.0.bias")  # (hidden_size,) in every SiT / ViT-5
    if hidden:
        hints.append(f"hidden size differs: the checkpoint has hidden_size={hidden[1][0]}, "
                     f"the model {hidden[0][0]}")
    depth_model, depth_ckpt = _depth(own_keys), _depth(state_keys)
    if depth_model != depth_ckpt:
        hints.append(f"depth differs: the checkpoint has depth={depth_ckpt}, the model {depth_model}")
    out_bias = shapes.get("final_layer.linear.bias")
    if out_bias and not hidden:
        (want,), (got,) = out_bias
        if got == 2 * want:
            hints.append("the checkpoint has twice the output channels: build the model with learn_sigma=True")
        elif 2 * got == want:
            hints.append("the checkpoint has half the output channels: build the model with learn_sigma=False")
    pos = shapes.get("pos_embed")
    if pos and pos[0][1] != pos[1][1]:  # the number of positions, not the width, differs
        n = pos[1][1]
        side = round(n**0.5) * getattr(model, "patch_size", 1)
        hints.append(f"pos_embed holds {n} positions: the checkpoint was trained with input_size={side}")
    proj = shapes.get("x_embedder.proj.weight")  # (hidden, in_channels, patch, patch)
    if proj and not hidden:
        (_, c_want, p_want, _), (_, c_got, p_got, _) = proj
        if p_want != p_got:
            hints.append(f"the checkpoint was trained with patch size {p_got}, the model has {p_want}")
        if c_want != c_got:
            hints.append(f"the checkpoint has in_channels={c_got}, the model {c_want}")
    return hints


def check_state_dict(model: nn.Module, state: dict[str, Tensor], source: str = "checkpoint") -> None:
    """Raise CheckpointError listing missing / unexpected keys and shape mismatches, with likely
    causes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    common = own.keys() & state.keys()
    shapes = {k: (tuple(own[k].shape), tuple(state[k].shape)) for k in common if own[k].shape != state[k].shape}
    if not (missing or unexpected or shapes):
        return
    lines = [f"{source} does not fit {type(model).__name__}:"]
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            lines.append(f"  {label} keys ({len(keys)}): {keys[:12]}{' ...' if len(keys) > 12 else ''}")
    for key, (want, got) in sorted(shapes.items()):
        lines.append(f"  {key}: model {want} vs checkpoint {got}")
    lines += [f"  hint: {h}" for h in _hints(model, shapes, own.keys(), state.keys())]
    raise CheckpointError("\n".join(lines))


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, which: str = "ema", sha256: str | None = None
) -> nn.Module:
    """Load weights from ``path`` into ``model`` (strict); returns the model."""
    state = load_state_dict(path, which, sha256)
    check_state_dict(model, state, source=os.fspath(path))
    model.load_state_dict(state, strict=True)
    return model


# ----------------------------------------------------------------------------- checkpoint -> model


@dataclass
class LoadedModel:
    """A model built and loaded from a checkpoint, and what the checkpoint says about sampling from
    it.

    ``source``: "ours" (training checkpoint of this codebase, config in ``args``), "official"
    (bare state dict such as SiT-XL-2-256.pt, or a DiT/SiT training checkpoint with argparse
    ``args``) or "diffusers" (a DiTTransformer2DModel folder). ``input_size``: the model's
    training input side (latent side for latent models).
    ``transport``: ``create_transport`` kwargs (objective sit). ``objective``: sit | ddpm (DiT), as
    recorded (ours) or as told (official); ``diffusion``: the ddpm keys of the transport section
    (objective ddpm) or {}; ``create_objective(objective_config)`` builds either. ``vae``:
    ``{"name": hub id | directory | "none", "scaling_factor"}``.
    ``sample``: the checkpoint's ``sample`` config section (ours) or {}. ``step``: the training step
    if recorded; ``which``: "ema" | "model" for training checkpoints, None for bare state dicts.
    """

    model: nn.Module
    name: str
    source: str
    input_size: int
    in_channels: int
    num_classes: int
    transport: dict[str, Any]
    vae: dict[str, Any]
    sample: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    which: str | None = None
    objective: str = "sit"
    diffusion: dict[str, Any] = field(default_factory=dict)

    @property
    def objective_config(self) -> dict[str, Any]:
        """The transport config section to build the objective from (``create_objective``)."""
        return {"objective": self.objective, **self.transport, **self.diffusion}


def _is_our_config(args: Any) -> bool:
    return (isinstance(args, dict) and isinstance(args.get("model"), dict)
            and "name" in args["model"])


def _infer_architecture(state: dict[str, Tensor], input_size: int | None, path: str
                        ) -> dict[str, Any]:
    """create_model overrides read off a DiT/SiT state dict: in_channels, learn_sigma, num_classes,
    input_size."""
    for key in ("x_embedder.proj.weight", "final_layer.linear.weight",
                "y_embedder.embedding_table.weight"):
        if key not in state:
            raise CheckpointError(f"{path}: no {key!r}; not a SiT/DiT state dict "
                                  f"(keys: {sorted(state)[:8]} ...)")
    proj = state["x_embedder.proj.weight"]  # (D, C, p, p)
    in_channels, patch = proj.shape[1], proj.shape[-1]
    out_channels = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    arch = dict(
        in_channels=in_channels,
        learn_sigma=out_channels == 2 * in_channels,
        # the table's last row is the null class
        num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1,
    )
    if "pos_embed" in state:
        trained = math.isqrt(state["pos_embed"].shape[1]) * patch
        if input_size is not None and input_size != trained:
            warnings.warn(f"{path}: pos_embed was trained at input side {trained}, not "
                          f"{input_size}; using {trained} (sampling at another size interpolates "
                          "the table)", stacklevel=3)
        arch["input_size"] = trained
    elif input_size is not None:
        arch["input_size"] = input_size
    else:
        raise CheckpointError(f"{path}: no pos_embed to read the training size from; pass the "
                              "image size")
    return arch


def load_model(
    ckpt: str | os.PathLike,
    model_name: str | None = None,
    which: str = "ema",
    input_size: int | None = None,
    sha256: str | None = None,
    overrides: dict[str, Any] | None = None,
    objective: str | None = None,
) -> LoadedModel:
    """Build the model stored in ``ckpt`` and load its weights (``which``: ema | model), on the CPU,
    in eval mode without gradients.

    Our training checkpoints rebuild the model, transport and VAE settings from their ``args``
    config; ``model_name`` must then be None or equal to the trained name. Any other layout (the
    released bare EMA state dict, a DiT/SiT training checkpoint, .safetensors) needs ``model_name``
    (e.g. "SiT-XL/2", or the ``args.model`` of an official training checkpoint); in_channels,
    learn_sigma, num_classes and the training input size are read off the tensors. Official
    defaults: Linear path, velocity prediction, and the SD-VAE ft-EMA decoder for 4-channel models
    (pixel space otherwise). ``input_size`` (model input side) is only needed when the state dict
    has no ``pos_embed``. ``overrides``: ``create_model`` keywords for a bare state dict whose
    architecture is not the registry's (depth, hidden_size, num_heads, switches).

    A directory is read as a diffusers DiT folder (``sit_vit5.models.diffusers_dit``: a
    ``DiTTransformer2DModel`` folder or a DiTPipeline folder; objective ddpm, source "diffusers").

    ``objective`` (sit | ddpm): ours record it (a different one is an error). Official files cannot
    tell, DiT and SiT sharing their key layout: the model name does (``DiT-*`` = ddpm, other names
    sit), or ``objective`` with a SiT name; a contradiction is an error, never a guess.
    """
    path = os.fspath(ckpt)
    if which not in ("ema", "model"):
        raise ValueError(f"which={which!r}; valid: ema, model")
    if os.path.isdir(path):  # a diffusers DiT folder (facebook/DiT-XL-2-256's layout)
        from .diffusers_dit import load_dit_folder

        if sha256 or overrides:
            raise ValueError(f"{path}: sha256 / overrides apply to checkpoint files, not folders")
        return load_dit_folder(path, model_name, objective)
    obj = read_checkpoint(path, sha256)
    args = obj.get("args")
    nested = "model" in obj or "ema" in obj
    if nested and which not in obj:
        raise CheckpointError(f"{path}: has no {which!r} weights (keys: {sorted(obj)})")
    state = strip_wrappers(obj[which] if nested else obj)
    step, which_loaded = obj.get("step") if nested else None, which if nested else None
    if _is_our_config(args):
        section = args["model"]
        if model_name is not None and model_name != section["name"]:
            raise ValueError(f"{path} was trained as {section['name']!r}, not {model_name!r}; "
                             "drop the model name (our checkpoints carry their architecture)")
        model = create_model(section["name"], **model_kwargs(section))
        saved = {k: v for k, v in args.get("transport", {}).items() if v is not None}
        trained = saved.pop("objective", "sit")
        transport = {k: v for k, v in saved.items() if k in _TRANSPORT_KEYS}
        diffusion = {k: v for k, v in saved.items() if k not in _TRANSPORT_KEYS}
        if objective is not None and objective != trained:
            raise ValueError(f"{path} was trained with transport.objective={trained}; its output "
                             f"means {trained}, so drop the objective (our checkpoints carry it)")
        loaded = LoadedModel(
            model, section["name"], "ours", model.input_size, model.in_channels, model.num_classes,
            transport=transport if trained == "sit" else {},
            vae=dict(args.get("vae") or {"name": "none"}), sample=dict(args.get("sample") or {}),
            step=step, which=which_loaded, objective=trained,
            diffusion=diffusion if trained == "ddpm" else {})
    else:
        official = vars(args) if isinstance(args, argparse.Namespace) else {}
        model_name = model_name or official.get("model")
        if model_name is None:
            raise ValueError(f"{path} is a bare state dict without a config: name its "
                             "architecture (model_name / --model), e.g. SiT-XL/2; valid: "
                             + ", ".join(list_models()))
        implied = name_objective(model_name)
        if objective is not None and implied is not None and objective != implied:
            raise ValueError(f"{model_name} names the {implied} objective, not {objective}: use the "
                             f"SiT-* name for a SiT network trained with {objective}")
        objective = objective or implied or "sit"
        arch = _infer_architecture(state, input_size, path)
        model = create_model(model_name, **{**arch, **(overrides or {})})
        transport = {k: official[k] for k in _TRANSPORT_KEYS if official.get(k) is not None}
        diffusion = {}
        if objective == "ddpm":
            if transport:
                raise ValueError(f"{path}: its args set a transport ({transport}), but the "
                                 "objective is ddpm")
            # DiT: the learned-range variance when the file has the sigma half, else fixed beta_t
            diffusion = {"ddpm_variance": "learned" if arch["learn_sigma"] else "fixed_large"}
        vae_name = f"stabilityai/sd-vae-ft-{official['vae']}" if official.get("vae") else SD_VAE_EMA
        loaded = LoadedModel(
            model, model_name, "official", arch["input_size"], arch["in_channels"],
            arch["num_classes"],
            transport=transport,
            vae={"name": vae_name if arch["in_channels"] == 4 else "none",
                 "scaling_factor": SD_VAE_SCALING_FACTOR},
            step=step, which=which_loaded, objective=objective, diffusion=diffusion)
    check_state_dict(model, state, source=path)
    model.load_state_dict(state, strict=True)
    model.eval().requires_grad_(False)
    return loaded
