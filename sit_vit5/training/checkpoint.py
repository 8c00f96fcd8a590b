"""Training checkpoints: atomic writes, SHA-256 sidecars, a latest pointer, rotation, RNG states.

A checkpoint is one ``torch.save`` file of tensors and plain containers (loads with
``weights_only=True``). Keys (``model, ema, opt, args`` as in DiT/SiT): ``model``, ``ema`` (state
dicts, DiT key names), ``opt`` (AdamW), ``args`` (the resolved config), ``step``, ``epoch``,
``batch_in_epoch``, ``rng``, ``versions``, ``model_name``, ``payload_sha256`` (checked at every
load), ``scaler`` (fp16 runs) and ``repa`` (projector, its AdamW state, encoder SHA-256).

Layout of ``<out_dir>/checkpoints``::

    0005000.pt              regular checkpoint (the newest ``keep_last`` on the schedule are kept)
    0100000-milestone.pt    milestone checkpoint (never deleted)
    <file>.sha256           ``sha256sum``-format digest of <file>, verified before unpickling
    latest.json             {"file": "0005000.pt", "step": 5000}, replaced once <file> is complete

Files are written to a temporary, fsynced and renamed, so a crash leaves no half file; a full disk
stops the run naming the file and the previous (intact) checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import DEFAULTS
from ..models.checkpoint_files import CheckpointError, read_checkpoint
from ..utils.atomic_files import TMP_PREFIX, atomic_torch_save, atomic_write_text
from ..utils.checksums import PAYLOAD_DIGEST_KEY, payload_sha256, sha256_file, sidecar
from ..utils.errors import find_errno
from ..utils.run_files import (
    CKPT_DIR,
    LATEST,
    checkpoint_name,
    checkpoints_of,
    latest_checkpoint,
    list_checkpoints,
    resume_file,
    resume_target,
)

__all__ = ["CKPT_DIR", "LATEST", "CheckpointError", "CheckpointWriteError",
           "IncompatibleCheckpointError", "checkpoint_name", "latest_checkpoint",
           "list_checkpoints", "read_checkpoint", "save_checkpoint", "sha256_file"]


#: Config keys that must match to resume (anything else may change: steps, lr, logging, ...).
RESUME_FIXED = ("model", "transport", "vae", "data.image_size", "data.global_batch_size",
                "train.seed", "repa.encoder", "repa.weights", "repa.depth", "repa.projector_dim",
                "repa.resolution", "repa.mean", "repa.std", "repa.interpolation")  # not repa.coeff
#: Model keys that do not change the architecture or the function it computes.
RESUME_FREE_MODEL_KEYS = ("grad_checkpointing",)


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint made with another model or config than the run that tries to resume from it."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full); the previous one is untouched."""


# ----------------------------------------------------------------------------- save / load


def _sweep(ckpt_dir: Path) -> None:
    """Remove a killed writer's temporaries and sidecars whose checkpoint was deleted."""
    for stale in ckpt_dir.glob(f"{TMP_PREFIX}*"):
        stale.unlink(missing_ok=True)
    for side in ckpt_dir.glob("*.pt.sha256"):
        if not side.with_suffix("").exists():
            side.unlink(missing_ok=True)


def save_checkpoint(state: dict[str, Any], ckpt_dir: str | os.PathLike, step: int,
                    milestone: bool = False, keep_last: int = 3, every: int | None = None) -> Path:
    """Write ``state`` (adding ``payload_sha256`` in place) as the checkpoint of ``step``, its
    sidecar, ``latest.json``, then delete regular checkpoints beyond the newest ``keep_last``.
    ``every``: the schedule (``train.ckpt_every``); an older regular checkpoint off it (a stop's,
    or an earlier final step) is superseded by this one: deleted, not counted, so a pre-emption
    costs no scheduled checkpoint. Returns its path. A full disk raises CheckpointWriteError,
    keeping the old files."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _sweep(ckpt_dir)
    path = ckpt_dir / checkpoint_name(step, milestone)
    previous = latest_checkpoint(ckpt_dir)
    try:
        state[PAYLOAD_DIGEST_KEY] = payload_sha256(state)
        atomic_torch_save(state, path)  # data file, then its .sha256 sidecar
        atomic_write_text(ckpt_dir / LATEST, json.dumps({"file": path.name, "step": step}) + "\n")
    except (OSError, RuntimeError) as err:
        full = find_errno(err, errno.ENOSPC) or find_errno(err, errno.EDQUOT)
        if path != previous:  # a data file without its sidecar or pointer is not a checkpoint
            path.unlink(missing_ok=True)
            sidecar(path).unlink(missing_ok=True)
        if full is None:
            raise
        kept = (f"the previous checkpoint {previous} is intact" if previous
                else "no earlier checkpoint exists")
        raise CheckpointWriteError(f"no space left on device writing {path}; {kept}") from err
    regular, superseded = [], []  # older regular checkpoints: on the schedule, or off it
    for s, p, is_milestone in list_checkpoints(ckpt_dir):
        if not is_milestone and p != path:
            (superseded if every and s % every else regular).append(p)
    for old in superseded + regular[: max(0, len(regular) - (keep_last - 1))]:
        old.unlink(missing_ok=True)
        sidecar(old).unlink(missing_ok=True)
    return path


def resolve_resume(spec: str, out_dir: str | os.PathLike) -> Path:
    """``"latest"``: ``out_dir``'s latest checkpoint; a run directory: its latest; a file: it."""
    found = resume_file(spec, out_dir)
    if found is not None:
        return found
    target = resume_target(spec, out_dir)
    if target.is_dir():
        raise CheckpointError(f"--resume {spec}: no checkpoint in {checkpoints_of(target)}")
    raise CheckpointError(f"--resume {spec}: {target} is neither a checkpoint file nor a run "
                          "directory")


# ----------------------------------------------------------------------------- RNG and versions


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA, if initialised) global RNG states, as tensors and lists."""
    py_version, py_keys, py_gauss = random.getstate()
    # the legacy global NumPy RNG is what third-party code draws from
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()  # noqa: NPY002
    state: dict[str, Any] = {
        "python": [py_version, list(py_keys), py_gauss],
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states saved by ``rng_state`` (CUDA only when the device count matches)."""
    py_version, py_keys, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_keys), py_gauss))
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32),  # noqa: NPY002
                         np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


def package_versions() -> dict[str, str]:
    """Versions of Python and the packages a checkpoint depends on (those installed)."""
    versions = {"python": sys.version.split()[0]}
    for name in ("sit-vit5", "torch", "torchvision", "accelerate", "diffusers", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


# ----------------------------------------------------------------------------- compatibility


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """A line per RESUME_FIXED key whose value differs; a key the saved config lacks counts as its
    default."""
    missing = "<unset>"
    lines = []
    for fixed in RESUME_FIXED:
        section, _, key = fixed.partition(".")
        old, new = saved.get(section, {}), current.get(section, {})
        keys = [key] if key else sorted(set(old) | set(new))
        for k in keys:
            if section == "model" and k in RESUME_FREE_MODEL_KEYS:
                continue
            a, b = old.get(k, DEFAULTS.get(section, {}).get(k, missing)), new.get(k, missing)
            if a != b:
                lines.append(f"{section}.{k}: {a!r} (checkpoint) != {b!r} (this run)")
    return lines


def check_compatible(checkpoint: dict[str, Any], cfg: dict[str, Any],
                     path: str | os.PathLike) -> None:
    """Raise IncompatibleCheckpointError naming every fixed key whose value differs."""
    saved = checkpoint.get("args")
    if not isinstance(saved, dict):
        raise IncompatibleCheckpointError(
            f"{path} holds no training config ('args'): not a training checkpoint of this codebase "
            "(load weights with sit_vit5.models.load_checkpoint)")
    diffs = config_differences(saved, cfg)
    if diffs:
        raise IncompatibleCheckpointError(
            f"cannot resume from {path}: it was trained with another model/config:\n  "
            + "\n  ".join(diffs) + f"\nResume keeps {', '.join(RESUME_FIXED)} fixed; "
            "start a new run (another train.out_dir) instead.")
