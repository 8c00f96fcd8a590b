"""``load_model``: the one way from a checkpoint file to a ready model, plus what the file says
about sampling from it (objective, VAE, sample settings).

Our training checkpoints carry their config (``args``) and rebuild from it; official SiT/DiT files
(a bare state dict, a DiT/SiT training checkpoint with argparse ``args``, ``.safetensors``) need a
model name, and the rest of the architecture is read off the tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from torch import Tensor

from ..names import SD_VAE_SCALING_FACTOR
from ..transport import TRANSPORT_KEYS
from ..vae import SD_VAE_EMA
from .checkpoint_files import (
    CheckpointError,
    LoadedModel,
    check_state_dict,
    read_checkpoint,
    strip_wrappers,
)
from .registry import (
    BACKBONES,
    SIZES,
    create_model,
    list_models,
    model_kwargs,
    name_objective,
    name_objective_conflict,
)


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
            # stacklevel: the caller of load_model
            warnings.warn(f"{path}: pos_embed was trained at input side {trained}, not "
                          f"{input_size}; using {trained} (sampling at another size interpolates "
                          "the table)", stacklevel=4)
        arch["input_size"] = trained
    elif input_size is not None:
        arch["input_size"] = input_size
    else:
        raise CheckpointError(f"{path}: no pos_embed to read the training size from; pass the "
                              "image size")
    return arch


def _weights(obj: dict, which: str, path: str) -> tuple[dict[str, Tensor], int | None, str | None]:
    """The state dict to load (``which`` of a training checkpoint, else the file itself), the
    recorded step and ``which`` (both None for a bare state dict)."""
    nested = "model" in obj or "ema" in obj
    if nested and which not in obj:
        raise CheckpointError(f"{path}: has no {which!r} weights (keys: {sorted(obj)})")
    if not nested:
        return strip_wrappers(obj), None, None
    return strip_wrappers(obj[which]), obj.get("step"), which


def _ours(args: dict, model_name: str | None, objective: str | None, path: str, step: int | None,
          which: str | None) -> LoadedModel:
    """The model, objective, VAE and sample settings our checkpoint's config ``args`` records."""
    section = args["model"]
    if model_name is not None and model_name != section["name"]:
        raise ValueError(f"{path} was trained as {section['name']!r}, not {model_name!r}; "
                         "drop the model name (our checkpoints carry their architecture)")
    model = create_model(section["name"], **model_kwargs(section))
    saved = {k: v for k, v in args.get("transport", {}).items() if v is not None}
    trained = saved.setdefault("objective", "sit")  # written before the key existed: sit
    if objective is not None and objective != trained:
        raise ValueError(f"{path} was trained with transport.objective={trained}; its output "
                         f"means {trained}, so drop the objective (our checkpoints carry it)")
    return LoadedModel(
        model, section["name"], "ours", model.input_size, model.in_channels, model.num_classes,
        objective=saved, vae=dict(args.get("vae") or {"name": "none"}),
        sample=dict(args.get("sample") or {}), step=step, which=which)


def _official_objective(model_name: str, objective: str | None) -> str:
    """sit | ddpm of an official file: the model name's (``DiT-*`` = ddpm) or the one asked for; a
    contradiction is a ValueError."""
    conflict = None
    if objective is not None:
        conflict = name_objective_conflict(model_name, objective, key="objective")
    if conflict:
        raise ValueError(conflict)
    return objective or name_objective(model_name) or "sit"


def _official(args: Any, state: dict[str, Tensor], model_name: str | None,
              input_size: int | None, overrides: dict[str, Any] | None, objective: str | None,
              path: str, step: int | None, which: str | None) -> LoadedModel:
    """The model of an official file (architecture read off ``state``) with the official defaults:
    the args' transport or the Linear/velocity one, the SD-VAE ft-EMA for 4-channel models."""
    official = vars(args) if isinstance(args, argparse.Namespace) else {}
    model_name = model_name or official.get("model")
    if model_name is None:
        raise ValueError(f"{path} is a bare state dict without a config: name its "
                         "architecture (model_name / --model), e.g. SiT-XL/2; valid: "
                         + ", ".join(list_models()))
    objective = _official_objective(model_name, objective)
    arch = _infer_architecture(state, input_size, path)
    model = create_model(model_name, **{**arch, **(overrides or {})})
    told = {k: official[k] for k in TRANSPORT_KEYS if official.get(k) is not None}
    section = {"objective": objective, **told}
    if objective == "ddpm":
        if len(section) > 1:
            raise ValueError(
                f"{path}: its args set a transport ({section}), but the objective is ddpm")
        # DiT: the learned-range variance when the file has the sigma half, else fixed beta_t
        section["ddpm_variance"] = "learned" if arch["learn_sigma"] else "fixed_large"
    vae_name = f"stabilityai/sd-vae-ft-{official['vae']}" if official.get("vae") else SD_VAE_EMA
    vae = {"name": vae_name if arch["in_channels"] == 4 else "none",
           "scaling_factor": SD_VAE_SCALING_FACTOR}
    return LoadedModel(
        model, model_name, "official", arch["input_size"], arch["in_channels"], arch["num_classes"],
        objective=section, vae=vae, step=step, which=which)


#: ``_class_name`` of the config.json that ``save_pretrained`` writes for our transformers
PRETRAINED_CLASSES = ("SiT", "ViT5")


def pretrained_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``folder/config.json`` when ``save_pretrained`` wrote it for SiT or ViT5, else None."""
    file = Path(folder) / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("_class_name") in \
        PRETRAINED_CLASSES else None


def export_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a pipeline folder ``python -m sit_vit5.export`` wrote (its transformer
    SiT or ViT5: ``model_index.json``, ``transformer/``, ``scheduler/``)."""
    index = Path(path) / "model_index.json"
    try:
        entry = json.loads(index.read_text()).get("transformer") if index.is_file() else None
    except (OSError, ValueError):
        return False
    ours = isinstance(entry, list) and bool(entry) and entry[-1] in PRETRAINED_CLASSES
    return ours and pretrained_config(Path(path) / "transformer") is not None


def _pretrained_name(model: Any) -> str:
    """The registry name of a model's class and sizes (``ViT5-S/2``), else a description of them
    (a shrunk model: ``ViT5/2 (depth 4, hidden 64, heads 4)``)."""
    cls = type(model).__name__
    sizes = (model.config.depth, model.config.hidden_size, model.config.num_heads)
    size = next((s for s, v in SIZES.items() if v == sizes), None)
    if size is not None:
        return f"{cls}-{size}/{model.patch_size}"
    return f"{cls}/{model.patch_size} (depth {sizes[0]}, hidden {sizes[1]}, heads {sizes[2]})"


def _pretrained_objective(path: str, model_name: str | None, objective: str | None,
                          recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The transport section of a save_pretrained model: the export's scheduler records it (a
    different ``objective`` is an error), else ``objective``, the name's, or SiT's defaults."""
    if recorded:
        trained = recorded.get("objective", "sit")
        if objective is not None and objective != trained:
            raise ValueError(f"{path} was exported with transport.objective={trained}; its "
                             "output means that, so drop the objective")
        return {k: v for k, v in recorded.items() if v is not None}
    if model_name is not None:
        return {"objective": _official_objective(model_name, objective)}
    return {"objective": objective or "sit"}


def _load_pretrained(folder: Path, state: dict[str, Tensor] | None, model_name: str | None,
                     objective: str | None, path: str) -> LoadedModel:
    """A SiT / ViT5 saved with ``save_pretrained`` (``folder/config.json``), with the weights
    ``state`` (None: the folder's own), and, in an export folder, its scheduler's transport,
    sampler and VAE settings (``folder`` is then its ``transformer/``)."""
    config = pretrained_config(folder)
    cls = BACKBONES[config["_class_name"]]
    if state is None:
        model = cls.from_pretrained(folder)
    else:
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
        check_state_dict(model, state, source=path)
        model.load_state_dict(state, strict=True)
    name = _pretrained_name(model)
    names = (cls.__name__, "DiT") if cls.__name__ == "SiT" else (cls.__name__,)
    if model_name is not None and model_name.split("-")[0] not in names:
        raise ValueError(f"{path} holds a {name} (its config.json), not {model_name!r}; drop the "
                         "model name")
    file = folder.parent / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(file.read_text()) if file.is_file() else {}
    # without an export's scheduler: the official files' default (SD-VAE ft-EMA for 4 channels)
    vae = dict(scheduler.get("vae") or {"name": SD_VAE_EMA if model.in_channels == 4 else "none",
                                        "scaling_factor": SD_VAE_SCALING_FACTOR})
    if vae.get("name") not in (None, "none") and (folder.parent / "vae" / "config.json").is_file():
        vae["name"] = str(folder.parent / "vae")  # the decoder the export bundled: no download
    return LoadedModel(
        model, name, "export" if scheduler else "pretrained", model.input_size, model.in_channels,
        model.num_classes, objective=_pretrained_objective(path, model_name, objective,
                                                           scheduler.get("transport")),
        vae=vae, sample=dict(scheduler.get("sampler") or {}))


def load_model(
    ckpt: str | os.PathLike, model_name: str | None = None, which: str = "ema",
    input_size: int | None = None, sha256: str | None = None,
    overrides: dict[str, Any] | None = None, objective: str | None = None,
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

    A directory is read as a pipeline folder ``python -m sit_vit5.export`` wrote (source
    "export": the transformer, and the transport, sampler and VAE its scheduler records), a SiT /
    ViT5 ``save_pretrained`` folder (source "pretrained": the transport from ``objective`` or the
    name, else SiT's Linear / velocity), or a diffusers DiT folder
    (``sit_vit5.models.diffusers_dit``: a ``DiTTransformer2DModel`` folder or a DiTPipeline folder;
    objective ddpm, source "diffusers"). A ``.safetensors`` file with a SiT / ViT5 ``config.json``
    beside it is built from that config (depth, width, switches: no ``model_name`` needed), as a
    "pretrained" model.

    ``objective`` (sit | ddpm): ours record it (a different one is an error). Official files cannot
    tell, DiT and SiT sharing their key layout: the model name does (``DiT-*`` = ddpm, other names
    sit), or ``objective`` with a SiT name; a contradiction is an error, never a guess.
    """
    path = os.fspath(ckpt)
    if which not in ("ema", "model"):
        raise ValueError(f"which={which!r}; valid: ema, model")
    if os.path.isdir(path):  # a diffusers DiT folder (facebook/DiT-XL-2-256's layout)
        from .diffusers_dit import load_dit_folder  # platform: only for such a folder

        if sha256 or overrides:
            raise ValueError(f"{path}: sha256 / overrides apply to checkpoint files, not folders")
        if export_folder(path):  # ours, from python -m sit_vit5.export
            return _eval(_load_pretrained(Path(path) / "transformer", None, model_name, objective,
                                          path))
        if pretrained_config(path) is not None:  # SiT / ViT5 save_pretrained folder
            return _eval(_load_pretrained(Path(path), None, model_name, objective, path))
        return load_dit_folder(path, model_name, objective)
    obj = read_checkpoint(path, sha256)
    state, step, which_loaded = _weights(obj, which, path)
    args = obj.get("args")
    if args is None and path.endswith(".safetensors") and pretrained_config(
            Path(path).parent) is not None:  # save_pretrained's weights: config.json beside them
        return _eval(_load_pretrained(Path(path).parent, state, model_name, objective, path))
    if _is_our_config(args):
        loaded = _ours(args, model_name, objective, path, step, which_loaded)
    else:
        loaded = _official(args, state, model_name, input_size, overrides, objective, path, step,
                           which_loaded)
    check_state_dict(loaded.model, state, source=path)
    loaded.model.load_state_dict(state, strict=True)
    return _eval(loaded)


def _eval(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` with its model in eval mode, without gradients."""
    loaded.model.eval().requires_grad_(False)
    return loaded
