"""Reading and verifying checkpoint files: our training checkpoints and the official SiT/DiT files,
as dicts of tensors, and loading their weights into a model that fits them (building the model from
a file is ``loading.load_model``), and ``LoadedModel``: such a model with what its file says about
sampling.

Accepted layouts: a bare state dict (the released ``SiT-XL-2-256.pt`` is the EMA weights), a
training checkpoint ``{model, ema, opt, args, ...}`` (DiT/SiT and ours), or a ``.safetensors`` file.
Pickles are opened with ``weights_only=True``; when a ``<file>.sha256`` sidecar exists it is
verified first.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, KeysView
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..utils.checksums import (
    PAYLOAD_DIGEST_KEY,
    ChecksumError,
    verify_payload_digest,
    verify_sha256,
    verify_sidecar,
)
from ..utils.errors import CheckpointError, one_line
from ..utils.run_files import truncation

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers


#: Top-level keys of the training checkpoints this codebase writes (sit_vit5.training.checkpoint).
CHECKPOINT_KEYS = frozenset({"model", "ema", "opt", "args", "step", "epoch", "batch_in_epoch",
                             "rng", "versions", "model_name", "scaler", "repa", PAYLOAD_DIGEST_KEY})


def read_checkpoint(path: str | os.PathLike, sha256: str | None = None) -> dict:
    """Read a checkpoint file into a dict without executing code (weights_only / safetensors).

    Checked before unpickling: ``sha256`` or the ``.sha256`` sidecar. Without either, checked after:
    the SHA-256 of the content stored inside the file (``payload_sha256``, written by our training
    checkpoints), so a damaged ``.pt`` copied without its sidecar is refused too (with a verified
    file digest it would only repeat that check, touching every page of an XL checkpoint's memory
    map at once); a checkpoint of ours (``args`` a dict) with a key we never write is refused as
    well (a damaged key name, of the digest say, must not pass for a file without one)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if sha256:
            verify_sha256(path, sha256)
        file_verified = bool(sha256) or verify_sidecar(path)
    except ChecksumError as err:
        cut = truncation(path)
        what = f"is truncated or not a checkpoint ({cut})" if cut else "is corrupt or was altered"
        raise CheckpointError(f"checkpoint {path} {what}: {err}") from err
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception as err:  # safetensors' own (Rust) error: not an OSError
            raise CheckpointError(f"{path}: not a readable .safetensors file "
                                  f"({one_line(err)})") from err
    # official DiT/SiT training checkpoints store argparse.Namespace as "args": an attribute bag
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            cut = truncation(path)
            if cut is not None:
                raise CheckpointError(f"{path}: truncated or not a checkpoint ({cut}); copy or "
                                      "download it again") from err
            raise CheckpointError(f"{path}: {_unreadable_reason(path, err)}") from err
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    unknown = sorted(map(str, set(obj) - CHECKPOINT_KEYS))
    if isinstance(obj.get("args"), dict) and unknown:
        raise CheckpointError(f"checkpoint {path} is corrupt or was altered: unexpected "
                              f"key(s) {unknown}")
    try:
        if not file_verified:
            verify_payload_digest(obj, path)
    except ChecksumError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or was altered: {err}") from None
    return obj


#: the first bytes of the files torch.load reads: a zip archive (torch >= 1.6) or a pickle
_TORCH_FILE_HEADS = (b"PK\x03\x04", b"\x80")
#: what torch's weights-only unpickler names when a file needs code to load
_UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _unreadable_reason(path: str, err: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed, in one line: not a torch file at all, a
    pickle that would run code (our words: torch's advice to drop weights_only is not ours), or
    torch's message."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not head.startswith(_TORCH_FILE_HEADS):
        return (f"not a checkpoint: neither a torch.save file nor .safetensors (it begins with "
                f"{head!r})")
    unsafe = _UNSAFE_GLOBAL.search(str(err))
    if unsafe or "weights_only" in str(err).replace("Weights only", "weights_only"):
        what = f"it names {unsafe[1]}" if unsafe else "it holds more than weights"
        return (f"refused: loading this pickle would run code ({what}); only weights-only "
                "checkpoints (tensors, numbers, strings, containers) and .safetensors files are "
                "read. Save the state dict again from a source you trust")
    return f"cannot be read as a weights-only checkpoint ({one_line(err)})"


def load_state_dict(path: str | os.PathLike, which: str = "ema", sha256: str | None = None
                    ) -> dict[str, Tensor]:
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


def _depth(keys: Iterable[str]) -> int:
    """Number of transformer blocks named in state-dict ``keys`` (``blocks.N.``)."""
    ids = {int(k.split(".")[1]) for k in keys
           if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    return max(ids) + 1 if ids else 0


def _hints(model: nn.Module, shapes: dict[str, tuple[tuple, tuple]], own_keys: KeysView[str],
           state_keys: KeysView[str]) -> list[str]:
    """Likely causes of a mismatch; each hint fires only when the shapes it reads really show it."""
    hints = []
    hidden = shapes.get("t_embedder.mlp.0.bias")  # (hidden_size,) in every SiT / ViT-5
    if hidden:
        hints.append(f"hidden size differs: the checkpoint has hidden_size={hidden[1][0]}, "
                     f"the model {hidden[0][0]}")
    depth_model, depth_ckpt = _depth(own_keys), _depth(state_keys)
    if depth_model != depth_ckpt:
        hints.append(f"depth differs: the checkpoint has depth={depth_ckpt}, the model "
                     f"{depth_model}")
    out_bias = shapes.get("final_layer.linear.bias")
    if out_bias and not hidden:
        (want,), (got,) = out_bias
        if got == 2 * want:
            hints.append("the checkpoint has twice the output channels: build the model with "
                         "learn_sigma=True")
        elif 2 * got == want:
            hints.append("the checkpoint has half the output channels: build the model with "
                         "learn_sigma=False")
    pos = shapes.get("pos_embed")
    if pos and pos[0][1] != pos[1][1]:  # the number of positions, not the width, differs
        n = pos[1][1]
        side = round(n**0.5) * getattr(model, "patch_size", 1)
        hints.append(f"pos_embed holds {n} positions: the checkpoint was trained with "
                     f"input_size={side}")
    proj = shapes.get("x_embedder.proj.weight")  # (hidden, in_channels, patch, patch)
    if proj and not hidden:
        (_, c_want, p_want, _), (_, c_got, p_got, _) = proj
        if p_want != p_got:
            hints.append(f"the checkpoint was trained with patch size {p_got}, the model has "
                         f"{p_want}")
        if c_want != c_got:
            hints.append(f"the checkpoint has in_channels={c_got}, the model {c_want}")
    return hints


def check_state_dict(model: nn.Module, state: dict[str, Tensor], source: str = "checkpoint"
                     ) -> None:
    """Raise CheckpointError listing missing / unexpected keys and shape mismatches, with likely
    causes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    common = own.keys() & state.keys()
    shapes = {k: (tuple(own[k].shape), tuple(state[k].shape))
              for k in common if own[k].shape != state[k].shape}
    if not (missing or unexpected or shapes):
        return
    lines = [f"{source} does not fit {type(model).__name__}:"]
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            more = " ..." if len(keys) > 12 else ""
            lines.append(f"  {label} keys ({len(keys)}): {keys[:12]}{more}")
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


@dataclass
class LoadedModel:
    """A model built and loaded from a checkpoint, and what the checkpoint says about sampling from
    it.

    ``source``: "ours" (training checkpoint of this codebase, config in ``args``), "official" (bare
    state dict such as SiT-XL-2-256.pt, or a DiT/SiT training checkpoint with argparse ``args``),
    "diffusers" (a DiTTransformer2DModel folder), "export" (a folder ``python -m sit_vit5.export``
    wrote: transport, sampler and VAE recorded in its scheduler) or "pretrained" (a SiT / ViT5
    ``save_pretrained`` folder or ``.safetensors`` beside its ``config.json``). ``input_size``: the
    model's training input side (latent side for latent models). ``objective``: the config's
    ``transport`` section the objective is built from (``create_objective(loaded.objective)``):
    ``objective`` sit | ddpm (DiT), as recorded (ours) or as told (official), and that
    objective's keys. ``vae``: ``{"name": hub id | directory | "none", "scaling_factor"}``.
    ``sample``: the checkpoint's ``sample`` config section (ours, export) or {}. ``step``: the
    training step if recorded; ``which``: "ema" | "model" for training
    checkpoints, None for bare state dicts.
    """

    model: nn.Module
    name: str
    source: str
    input_size: int
    in_channels: int
    num_classes: int
    objective: dict[str, Any]
    vae: dict[str, Any]
    sample: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    which: str | None = None

    @property
    def objective_name(self) -> str:
        """sit | ddpm: what the model's output means."""
        return self.objective.get("objective") or "sit"
