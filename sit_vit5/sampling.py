"""Image generation from trained models: checkpoint loading, per-index deterministic sampling, grids and bulk
(FID) sampling into an ADM-compatible ``.npz``.

Determinism: sample ``i`` of a run with global seed ``s`` draws its initial noise, its SDE noise and (when
labels are random) its label from its own generators, seeded by ``sample_seed(s, i, stream)``. Its image
therefore does not depend on which process made it, on the batch it was in, or on what was sampled before;
bulk sampling can be sharded over any number of processes, batched at any size, and resumed. Two caveats:
(1) a model's float numerics can differ by ~1e-7 between batch sizes (CPU and GPU matmul kernels depend on
the batch shape), which can move a pixel across a uint8 boundary (±1) in rare cases; (2) adaptive ODE solvers
(dopri5, ...) choose their steps from the error of the whole batch, so their images depend on the batch
composition within the solver tolerance. Fixed-step ODE solvers and all SDE samplers have no such coupling.

Bulk layout (``out_dir``)::

    settings.json                 what the samples depend on; a resumed run must match it
    parts/0000000-0000031.npz     one file per generated batch: indices, images (uint8 NHWC), labels
    images/000000.png             optional single images
    samples_{N}x{H}x{W}x3.npz     arr_0 uint8 [N, H, W, 3], arr_1 int64 labels [N] (index order)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from tqdm.auto import tqdm

from .config import model_kwargs
from .diffusion import GaussianDiffusion
from .guidance import ClassifierFreeGuidance
from .io import atomic_write, atomic_write_text
from .models import CheckpointError, create_model, list_models, name_objective
from .models.checkpoint import check_state_dict, read_checkpoint, strip_wrappers
from .objective import (
    DDPM_DEFAULTS,
    SAMPLE_METHODS,
    DiffusionSampler,
    create_objective,
    ddpm_settings,
    guided_channels,
    objective_name,
    prepare_model,
    transport_kwargs,
)
from .transport import Sampler, Transport
from .transport.integrators import is_adaptive

NOISE_STREAM, LABEL_STREAM = 0, 1  # per-sample generator streams: noise (initial + SDE) and label
MODES = ("ode", "sde", "ddpm", "ddim")  # ode / sde: objective sit; ddpm / ddim: objective ddpm (DiT)
DEFAULT_SAMPLING_METHOD = {"ode": "dopri5", "sde": "Euler"}  # SiT's sample.py defaults
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
SD_VAE_EMA = "stabilityai/sd-vae-ft-ema"


# ----------------------------------------------------------------------------- seeds, uint8


def sample_seed(global_seed: int, index: int, stream: int = NOISE_STREAM) -> int:
    """A 63-bit seed for sample ``index`` of a run seeded ``global_seed`` (NumPy SeedSequence hashing)."""
    if global_seed < 0 or index < 0:
        raise ValueError(f"seeds and indices must be >= 0, got global_seed={global_seed}, index={index}")
    words = np.random.SeedSequence([int(global_seed), int(index), int(stream)]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def random_labels(indices: Sequence[int], global_seed: int, num_classes: int) -> np.ndarray:
    """Uniform labels in ``[0, num_classes)`` (int64, one per index), each from its sample's own generator."""
    gens = (torch.Generator().manual_seed(sample_seed(global_seed, i, LABEL_STREAM)) for i in indices)
    return np.array([int(torch.randint(num_classes, (1,), generator=g)) for g in gens], dtype=np.int64)


def to_uint8(x: Tensor) -> np.ndarray:
    """Images ``(N, C, H, W)`` nominally in [-1, 1] -> uint8 ``(N, H, W, C)`` on the CPU.

    Exactly DiT/SiT's ``clamp(127.5 * x + 128, 0, 255)`` then a truncating cast. For values >= 0 truncation
    is floor, so this is ``floor(127.5 * (x + 1) + 0.5)``: round-half-up of the usual [-1, 1] -> [0, 255]
    map (not round-half-to-even as ``torch.round`` would do; the two differ only on exact ties).
    """
    return torch.clamp(127.5 * x.float() + 128.0, 0, 255).permute(0, 2, 3, 1).to("cpu", torch.uint8).numpy()


def _to_rgb(images: np.ndarray) -> np.ndarray:
    """NHWC uint8 with 1 or 3 channels -> 3 channels (the ADM format needs RGB; gray is replicated)."""
    return np.repeat(images, 3, axis=3) if images.shape[3] == 1 else images


def save_png(image: np.ndarray, path: str | os.PathLike) -> None:
    """One uint8 HWC image (1 channel: grayscale PNG, 3: RGB), written atomically."""
    pil = Image.fromarray(image[..., 0] if image.shape[2] == 1 else image)
    atomic_write(path, lambda f: pil.save(f, format="PNG"))


# ----------------------------------------------------------------------------- sampling settings


@dataclass(frozen=True)
class SampleSpec:
    """How to integrate from noise to data, and how to guide. Defaults are SiT's sample.py defaults.

    ``mode``: ode | sde (objective sit) or ddpm | ddim (objective ddpm: ancestral DDPM as DiT, or DDIM with
    eta 0, on ``num_steps`` respaced steps; ``sampling_method`` and the SDE keys do not apply and
    ``cfg_interval`` is refused). ``sampling_method``: ODE: a torchdiffeq method (dopri5, euler, heun2, midpoint, rk4,
    ...); SDE: Euler | Heun; None = dopri5 / Euler. ``num_steps``: grid points (fixed-step ODE: num_steps - 1
    steps; adaptive ODE: only where the solution is reported). ``atol``/``rtol``: adaptive ODE tolerances.
    ``diffusion_form``/``diffusion_norm``/``last_step``/``last_step_size``: SDE only (see
    ``sit_vit5.transport.Sampler.sample_sde``). ``cfg_scale`` 1 = no guidance; ``cfg_channels`` None = guide
    all channels, 3 = the SiT/DiT legacy mode; ``cfg_interval`` (t_lo, t_hi) = guide only there.
    """

    mode: str = "ode"
    sampling_method: str | None = None
    num_steps: int = 250
    atol: float = 1e-6
    rtol: float = 1e-3
    diffusion_form: str = "sigma"
    diffusion_norm: float = 1.0
    last_step: str | None = "Mean"
    last_step_size: float = 0.04
    cfg_scale: float = 1.0
    cfg_channels: int | None = None
    cfg_interval: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; valid: {', '.join(MODES)}")
        diffusion_mode = self.mode not in DEFAULT_SAMPLING_METHOD
        if diffusion_mode and self.sampling_method is not None:
            raise ValueError(f"sampling_method={self.sampling_method!r} applies to ode / sde, not mode={self.mode!r}")
        if diffusion_mode and self.cfg_interval is not None:
            raise ValueError(f"cfg_interval is defined on the transport's t in [0, 1]; mode={self.mode!r} "
                             "(objective ddpm) does not support it")
        if self.sampling_method is None and not diffusion_mode:  # frozen: set through object.__setattr__
            object.__setattr__(self, "sampling_method", DEFAULT_SAMPLING_METHOD[self.mode])
        if self.last_step == "none":
            object.__setattr__(self, "last_step", None)
        if self.cfg_interval is not None:
            lo, hi = (float(v) for v in self.cfg_interval)
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"cfg_interval=({lo}, {hi}): need 0 <= t_lo <= t_hi <= 1")
            object.__setattr__(self, "cfg_interval", (lo, hi))
        if self.cfg_channels is not None and self.cfg_channels < 1:
            raise ValueError(f"cfg_channels={self.cfg_channels}: must be >= 1 (or None for all channels)")

    @property
    def batch_coupled(self) -> bool:
        """True when images depend on the batch composition (adaptive ODE step-size control)."""
        return self.mode == "ode" and is_adaptive(self.sampling_method)

    def build(self, sampler: Sampler | DiffusionSampler) -> Callable[..., Any]:
        """The sampling function ``fn(z, model_fn, *, generator, **model_kwargs)`` of a transport
        :class:`Sampler` (ode / sde) or a :class:`DiffusionSampler` (ddpm / ddim)."""
        objective = "ddpm" if isinstance(sampler, DiffusionSampler) else "sit"
        if self.mode not in SAMPLE_METHODS[objective]:
            raise ValueError(f"mode={self.mode!r} cannot sample a model trained with the {objective} objective; "
                             f"valid: {', '.join(SAMPLE_METHODS[objective])}")
        if objective == "ddpm":
            return sampler.build(self.mode, self.num_steps)
        if self.mode == "ode":
            return sampler.sample_ode(
                sampling_method=self.sampling_method, num_steps=self.num_steps, atol=self.atol, rtol=self.rtol
            )
        return sampler.sample_sde(
            sampling_method=self.sampling_method,
            diffusion_form=self.diffusion_form,
            diffusion_norm=self.diffusion_norm,
            last_step=self.last_step,
            last_step_size=self.last_step_size,
            num_steps=self.num_steps,
        )


@dataclass
class Generated:
    """One generated batch: ``images`` uint8 ``(B, H, W, C)`` (C = 1 or 3), ``labels`` int64 ``(B,)``,
    ``pixels`` float ``(B, C, H, W)`` before quantization (CPU), ``nfe`` model evaluations of the sampler."""

    indices: np.ndarray
    images: np.ndarray
    labels: np.ndarray
    pixels: Tensor
    nfe: int | None


@dataclass
class SamplingPipeline:
    """Model + objective + sampler settings + decoder: ``generate(indices, global_seed)`` -> images.

    ``transport`` is the model's objective: a :class:`Transport` (sit) or a :class:`GaussianDiffusion` (ddpm,
    see ``ModelInfo.create_objective``); under ddpm, guidance of "all channels" means the C noise channels.

    ``latent_shape`` is ``(C, h, w)`` of the model input; ``decode`` maps samples to images in [-1, 1]
    ``(B, 3 or C, H, W)`` (None: pixel-space model, identity). ``precision`` bf16 runs the model under
    autocast (the integrator stays fp32). The initial noise is drawn on the CPU from per-sample generators,
    so it is the same on every device.
    """

    model: nn.Module
    transport: Transport | GaussianDiffusion
    spec: SampleSpec
    latent_shape: tuple[int, int, int]
    num_classes: int
    decode: Callable[[Tensor], Tensor] | None = None
    device: torch.device | str = "cpu"
    precision: str = "fp32"
    sampler: Sampler | DiffusionSampler = field(init=False, repr=False)
    sample_fn: Callable[..., Any] = field(init=False, repr=False)
    model_fn: Callable[..., Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; valid: {', '.join(PRECISIONS)}")
        spec = self.spec
        if spec.cfg_channels is not None and spec.cfg_channels > self.latent_shape[0]:
            raise ValueError(f"cfg_channels={spec.cfg_channels} but the model has {self.latent_shape[0]} channels")
        table = getattr(getattr(self.model, "y_embedder", None), "embedding_table", None)
        if spec.cfg_scale != 1.0 and table is not None and table.num_embeddings <= self.num_classes:
            raise ValueError(f"cfg_scale={spec.cfg_scale} needs a null class, but the model was built with "
                             "class_dropout_prob=0 (no null row in its label table); use cfg_scale 1")
        self.device = torch.device(self.device)
        self.model = self.model.to(self.device).eval()  # eval: no label dropout
        ddpm = isinstance(self.transport, GaussianDiffusion)
        self.sampler = DiffusionSampler(self.transport) if ddpm else Sampler(self.transport)
        self.sample_fn = spec.build(self.sampler)
        self.model_fn = self._forward
        if spec.cfg_scale != 1.0:
            channels = guided_channels({"objective": "ddpm" if ddpm else "sit"}, spec.cfg_channels,
                                       self.latent_shape[0])
            self.model_fn = ClassifierFreeGuidance(
                self._forward, spec.cfg_scale, null_class=self.num_classes,
                cfg_channels=channels, interval=spec.cfg_interval,
            )

    def _forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        dtype = PRECISIONS[self.precision]
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            return self.model(x, t, y).float()

    @torch.no_grad()
    def generate(
        self, indices: Sequence[int], global_seed: int, labels: Sequence[int] | None = None
    ) -> Generated:
        """Images of samples ``indices``; ``labels`` None = uniform random labels from the per-sample seeds."""
        indices = np.asarray(indices, dtype=np.int64)
        if labels is None:
            labels = random_labels(indices.tolist(), global_seed, self.num_classes)
        labels = np.asarray(labels, dtype=np.int64)
        if len(labels) != len(indices):
            raise ValueError(f"{len(labels)} labels for {len(indices)} samples")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got {sorted(set(labels.tolist()))}")
        gens = [torch.Generator().manual_seed(sample_seed(global_seed, int(i))) for i in indices]
        z = torch.stack([torch.randn(self.latent_shape, generator=g) for g in gens]).to(self.device)
        y = torch.from_numpy(labels).to(self.device)
        x = self.sample_fn(z, self.model_fn, generator=gens, y=y)[-1]  # the same gens go on to the SDE noise
        pixels = self.decode(x) if self.decode is not None else x
        return Generated(indices, to_uint8(pixels), labels, pixels.float().cpu(), self.sampler.last_nfe)


# ----------------------------------------------------------------------------- checkpoints


@dataclass
class ModelInfo:
    """What a checkpoint says about sampling from it.

    ``source``: "ours" (training checkpoint of this codebase, config in ``args``) or "official" (bare state
    dict, e.g. SiT-XL-2-256.pt, or a DiT/SiT training checkpoint with an argparse ``args``). ``input_size``:
    the model's training input side (latent side for latent models). ``transport``: ``create_transport``
    kwargs (objective sit). ``vae``: ``{"name": hub id | directory | "none", "scaling_factor": float}``.
    ``sample_defaults``: the checkpoint's ``sample`` config section (ours) or {}. ``objective``: sit | ddpm;
    ``ddpm``: the ddpm keys of the transport section (objective ddpm) or {}.
    """

    name: str
    source: str
    input_size: int
    in_channels: int
    num_classes: int
    transport: dict[str, Any]
    vae: dict[str, Any]
    sample_defaults: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    which: str | None = None
    objective: str = "sit"
    ddpm: dict[str, Any] = field(default_factory=dict)

    def create_objective(self, transport: dict[str, Any] | None = None) -> Transport | GaussianDiffusion:
        """The model's objective: a Transport (``transport`` kwargs replace the stored ones) or the trained
        GaussianDiffusion."""
        return create_objective({"objective": self.objective, **(transport or self.transport), **self.ddpm})


def _is_our_config(args: Any) -> bool:
    return isinstance(args, dict) and isinstance(args.get("model"), dict) and "name" in args["model"]


def _infer_architecture(state: dict[str, Tensor], input_size: int | None, path: str) -> dict[str, Any]:
    """create_model overrides read off a DiT/SiT state dict: in_channels, learn_sigma, num_classes, input_size."""
    for key in ("x_embedder.proj.weight", "final_layer.linear.weight", "y_embedder.embedding_table.weight"):
        if key not in state:
            raise CheckpointError(f"{path}: no {key!r}; not a SiT/DiT state dict (keys: {sorted(state)[:8]} ...)")
    proj = state["x_embedder.proj.weight"]  # (D, C, p, p)
    in_channels, patch = proj.shape[1], proj.shape[-1]
    out_channels = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    arch = dict(
        in_channels=in_channels,
        learn_sigma=out_channels == 2 * in_channels,
        num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1,  # last row = null class
    )
    if "pos_embed" in state:
        trained = math.isqrt(state["pos_embed"].shape[1]) * patch
        if input_size is not None and input_size != trained:
            warnings.warn(f"{path}: pos_embed was trained at input side {trained}, not {input_size}; using "
                          f"{trained} (sampling at another size interpolates the table)", stacklevel=3)
        arch["input_size"] = trained
    elif input_size is not None:
        arch["input_size"] = input_size
    else:
        raise CheckpointError(f"{path}: no pos_embed to read the training size from; pass the image size")
    return arch


def load_model_for_sampling(
    ckpt: str | os.PathLike,
    model_name: str | None = None,
    which: str = "ema",
    input_size: int | None = None,
    sha256: str | None = None,
    overrides: dict[str, Any] | None = None,
    objective: str | None = None,
) -> tuple[nn.Module, ModelInfo]:
    """Build the model stored in ``ckpt`` and load its weights (``which``: ema | model), on the CPU, eval mode.

    Our training checkpoints rebuild the model, transport and VAE settings from their ``args`` config;
    ``model_name`` must then be None or equal to the trained name. Any other layout (the released bare EMA
    state dict, a DiT/SiT training checkpoint, .safetensors) needs ``model_name`` (e.g. "SiT-XL/2", or the
    ``args.model`` of an official training checkpoint); in_channels, learn_sigma, num_classes and the
    training input size are read off the tensors. Official defaults: Linear path, velocity prediction, and
    the SD-VAE ft-EMA decoder for 4-channel models (pixel space otherwise). ``input_size`` (model input
    side) is only needed when the state dict has no ``pos_embed``. ``overrides``: ``create_model`` keywords for
    a bare state dict whose architecture is not the registry's (depth, hidden_size, num_heads, switches).

    Objective (sit | ddpm): ours record it in their config (``objective``, if given, must agree). Official
    files cannot tell (DiT and SiT share the key layout): the model name does (``DiT-*`` = ddpm, other names =
    sit), or ``objective`` for a SiT name; a contradiction is an error, never a guess.
    """
    path = os.fspath(ckpt)
    if which not in ("ema", "model"):
        raise ValueError(f"which={which!r}; valid: ema, model")
    obj = read_checkpoint(path, sha256)
    args = obj.get("args")
    nested = "model" in obj or "ema" in obj
    if nested and which not in obj:
        raise CheckpointError(f"{path}: has no {which!r} weights (keys: {sorted(obj)})")
    state = strip_wrappers(obj[which] if nested else obj)
    if _is_our_config(args):
        cfg_model = args["model"]
        if model_name is not None and model_name != cfg_model["name"]:
            raise ValueError(f"{path} was trained as {cfg_model['name']!r}, not {model_name!r}; drop the model name "
                             "(our checkpoints carry their architecture)")
        model = create_model(cfg_model["name"], **model_kwargs(cfg_model))
        saved = args.get("transport") or {}
        trained = objective_name(saved)
        if objective is not None and objective != trained:
            raise ValueError(f"{path} was trained with transport.objective={trained}; its output means {trained}, "
                             "so drop the objective (our checkpoints carry it)")
        ddpm = ddpm_settings(saved) if trained == "ddpm" else {}
        vae = dict(args.get("vae") or {"name": "none"})
        info = ModelInfo(cfg_model["name"], "ours", model.input_size, model.in_channels, model.num_classes,
                         transport_kwargs(saved), vae, dict(args.get("sample") or {}), obj.get("step"),
                         which if nested else None, trained, ddpm)
    else:
        official = vars(args) if isinstance(args, argparse.Namespace) else {}
        model_name = model_name or official.get("model")
        if model_name is None:
            raise ValueError(f"{path} is a bare state dict without a config: name its architecture (model_name / "
                             f"--model), e.g. SiT-XL/2; valid: {', '.join(list_models())}")
        implied = name_objective(model_name)
        if objective is not None and implied is not None and objective != implied:
            raise ValueError(f"{model_name} names the {implied} objective, not {objective}: use the SiT-* name for "
                             f"a SiT network trained with {objective}")
        objective = objective or implied or "sit"
        arch = _infer_architecture(state, input_size, path)
        model = create_model(model_name, **{**arch, **(overrides or {})})
        transport = {k: official[k] for k in ("path_type", "prediction", "loss_weight", "train_eps", "sample_eps")
                     if official.get(k) is not None}
        vae_name = f"stabilityai/sd-vae-ft-{official['vae']}" if official.get("vae") else SD_VAE_EMA
        vae = {"name": vae_name if arch["in_channels"] == 4 else "none", "scaling_factor": 0.18215}
        ddpm = {}
        if objective == "ddpm":  # DiT: learned-range variance when the file has the sigma half, else beta_t
            if transport:
                raise ValueError(f"{path}: its args set the transport ({transport}) but the objective is ddpm")
            ddpm = {**DDPM_DEFAULTS, "ddpm_variance": "learned" if arch["learn_sigma"] else "fixed_large"}
        info = ModelInfo(model_name, "official", arch["input_size"], arch["in_channels"], arch["num_classes"],
                         transport, vae, {}, obj.get("step") if nested else None, which if nested else None,
                         objective, ddpm)
    check_state_dict(model, state, source=path)
    model.load_state_dict(state, strict=True)
    prepare_model(model, info.objective)
    return model.eval().requires_grad_(False), info


def vae_enabled(vae: dict[str, Any]) -> bool:
    """Whether a ``vae`` config names a decoder (``name`` none/None = pixel space)."""
    return vae.get("name") is not None and str(vae["name"]).lower() != "none"


# ----------------------------------------------------------------------------- grid


@dataclass
class GridResult:
    """What ``sample_grid`` wrote and measured."""

    grid: Path
    images: list[Path]
    labels: np.ndarray
    nfe: int | None
    seconds: float
    images_per_second: float


def sample_grid(
    pipe: SamplingPipeline,
    out_dir: str | os.PathLike,
    num_images: int,
    labels: Sequence[int] | None = None,
    global_seed: int = 0,
    batch_size: int = 32,
    nrow: int | None = None,
    progress: bool = True,
) -> GridResult:
    """Generate samples ``0 .. num_images-1`` and write ``out_dir/grid.png`` and ``out_dir/{i:06d}.png``.

    ``labels`` None = random labels (image i is then bulk sample i of the same seed); otherwise one label per
    image. Tiny images are upscaled (nearest) to >= 64 px in the grid only; the single PNGs keep their size.
    """
    from .training.loop import save_grid

    if labels is not None and len(labels) != num_images:
        raise ValueError(f"{len(labels)} labels for {num_images} images")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches: list[Generated] = []
    start = time.perf_counter()
    for lo in tqdm(range(0, num_images, batch_size), disable=not progress, desc="grid", unit="batch"):
        idx = list(range(lo, min(lo + batch_size, num_images)))
        batches.append(pipe.generate(idx, global_seed, None if labels is None else labels[lo : lo + len(idx)]))
    seconds = time.perf_counter() - start
    images = np.concatenate([b.images for b in batches])
    paths = []
    for i, image in enumerate(images):
        paths.append(out / f"{i:06d}.png")
        save_png(image, paths[-1])
    grid = out / "grid.png"
    save_grid(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, grid, nrow)
    return GridResult(grid, paths, np.concatenate([b.labels for b in batches]), batches[-1].nfe, seconds,
                      num_images / max(seconds, 1e-9))


# ----------------------------------------------------------------------------- bulk


class ResumeError(ValueError):
    """An output directory holding samples made with other settings."""


@dataclass
class BulkResult:
    """What one ``sample_bulk`` call did: ``npz`` is the merged file (None if this process did not merge or
    samples are still missing); ``generated``/``skipped`` count this process's indices."""

    npz: Path | None
    generated: int
    skipped: int
    nfe: int | None
    seconds: float
    images_per_second: float


def _part_name(indices: np.ndarray) -> str:
    return f"{int(indices[0]):07d}-{int(indices[-1]):07d}.npz"


def _save_part(parts_dir: Path, batch: Generated) -> Path:
    """Write one batch as ``parts/{first:07d}-{last:07d}.npz`` atomically (resume trusts complete files only)."""

    path = parts_dir / _part_name(batch.indices)
    atomic_write(path, lambda f: np.savez(f, indices=batch.indices, images=batch.images, labels=batch.labels))
    return path


def scan_parts(parts_dir: str | os.PathLike) -> dict[int, tuple[Path, int]]:
    """Map each finished sample index to ``(part file, row)``; temporary files (``.tmp-*``) are ignored."""
    found: dict[int, tuple[Path, int]] = {}
    parts_dir = Path(parts_dir)
    if not parts_dir.is_dir():
        return found
    for part in sorted(parts_dir.glob("[0-9]*.npz")):
        try:
            with np.load(part, allow_pickle=False) as f:
                indices = f["indices"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            warnings.warn(f"ignoring unreadable part {part} ({err}); its samples will be regenerated", stacklevel=2)
            continue
        for row, i in enumerate(indices.tolist()):
            found.setdefault(i, (part, row))
    return found


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record ``settings`` in ``out/settings.json`` on first use; on resume, raise if any key differs."""
    path = out / "settings.json"
    settings = json.loads(json.dumps(settings, default=str))  # tuples -> lists, paths -> str, as stored
    if path.is_file():
        saved = json.loads(path.read_text())
        diffs = [f"{k}: {saved.get(k)!r} (in {path}) != {settings.get(k)!r} (now)"
                 for k in sorted(set(saved) | set(settings)) if saved.get(k) != settings.get(k)]
        if diffs:
            raise ResumeError(f"{out} holds samples made with other settings:\n  " + "\n  ".join(diffs)
                              + "\nUse another output directory (or delete it) to start over.")
        return
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, text)  # same text from every rank


def _write_npz_streamed(
    path: Path, num: int, done: dict[int, tuple[Path, int]], progress: bool = True, cache_size: int = 64
) -> None:
    """Write ``arr_0`` uint8 [num, H, W, 3] and ``arr_1`` labels in index order, streaming rows from the parts
    (an uncompressed zip of .npy members, as ``np.savez`` writes) so the whole array is never in memory."""
    cache: OrderedDict[Path, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def row(i: int) -> tuple[np.ndarray, int]:
        part, r = done[i]
        if part not in cache:
            with np.load(part, allow_pickle=False) as f:
                cache[part] = (f["images"], f["labels"])
            if len(cache) > cache_size:
                cache.popitem(last=False)
        cache.move_to_end(part)
        images, labels = cache[part]
        return images[r], int(labels[r])

    first, _ = row(0)
    height, width, _ = first.shape
    labels = np.empty(num, dtype=np.int64)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": (num, height, width, 3)}

    def write(file) -> None:
        with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, header)
                for lo in tqdm(range(0, num, 1024), desc="merge", unit="chunk", leave=False, disable=not progress):
                    chunk = []
                    for i in range(lo, min(lo + 1024, num)):
                        image, labels[i] = row(i)
                        if image.shape[:2] != (height, width):
                            raise ValueError(f"{done[i][0]}: image {i} is {image.shape}, others {first.shape}")
                        chunk.append(image)
                    f.write(_to_rgb(np.stack(chunk)).tobytes())
            with zf.open("arr_1.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, labels, allow_pickle=False)

    atomic_write(path, write)


def merge_parts(out_dir: str | os.PathLike, num_samples: int, progress: bool = True) -> Path:
    """Merge ``out_dir/parts`` into ``out_dir/samples_{N}x{H}x{W}x3.npz`` (arr_0 uint8 NHWC RGB, arr_1 int64
    labels, samples 0..N-1 in index order); raises if any of them is missing."""
    out = Path(out_dir)
    done = scan_parts(out / "parts")
    missing = [i for i in range(num_samples) if i not in done]
    if missing:
        raise ValueError(f"{out}: {len(missing)} of {num_samples} samples are missing (first: {missing[:5]}); "
                         "run the sampler again to finish them")
    with np.load(done[0][0], allow_pickle=False) as f:
        _, height, width, _ = f["images"].shape
    path = out / f"samples_{num_samples}x{height}x{width}x3.npz"
    _write_npz_streamed(path, num_samples, done, progress)
    return path


def _default_barrier() -> Callable[[], None] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.barrier
    return None


def sample_bulk(
    pipe: SamplingPipeline,
    num_samples: int,
    out_dir: str | os.PathLike,
    *,
    global_seed: int = 0,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    png: bool = False,
    settings: dict[str, Any] | None = None,
    barrier: Callable[[], None] | None = None,
    progress: bool = True,
) -> BulkResult:
    """Generate samples ``0 .. num_samples-1`` with uniform random labels; this process does ``i % world_size
    == rank``, in batches of ``batch_size``, skipping indices already in ``out_dir/parts`` (resume).

    ``settings`` (JSON-able: checkpoint, image size, ...) is recorded with the sampler settings and the seed
    in ``settings.json``; resuming with different ones raises ResumeError (``num_samples`` may grow: samples
    are per-index). After a barrier (``barrier``, default torch.distributed's when initialised) rank 0
    merges all parts into the npz; without a barrier, whichever process finds all samples done merges.
    """
    if num_samples < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need num_samples, batch_size, world_size >= 1 and 0 <= rank < world_size; got "
                         f"{num_samples}, {batch_size}, {world_size}, rank {rank}")
    if pipe.spec.batch_coupled:
        warnings.warn(f"sampling_method={pipe.spec.sampling_method!r} is adaptive: each batch shares its step "
                      "sizes, so images depend on batch composition (within the solver tolerance); use a fixed-"
                      "step method (euler, heun2, rk4) or the SDE for index-exact reproducibility", stacklevel=2)
    barrier = barrier or _default_barrier()
    out = Path(out_dir)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    _check_settings(out, {"global_seed": global_seed, "spec": asdict(pipe.spec),
                          "latent_shape": list(pipe.latent_shape), "num_classes": pipe.num_classes,
                          **(settings or {})})
    done = scan_parts(parts)
    mine = range(rank, num_samples, world_size)
    todo = [i for i in mine if i not in done]
    nfe, start = None, time.perf_counter()
    with tqdm(total=len(mine), initial=len(mine) - len(todo), disable=not progress or rank != 0,
              desc=f"sampling (rank 0 of {world_size})", unit="img", dynamic_ncols=True) as bar:
        for lo in range(0, len(todo), batch_size):
            batch = pipe.generate(todo[lo : lo + batch_size], global_seed)
            if png:
                for i, image in zip(batch.indices, batch.images):
                    save_png(image, out / "images" / f"{int(i):06d}.png")
            _save_part(parts, batch)  # last: a part on disk means its PNGs are there too
            nfe = batch.nfe
            bar.update(len(batch.indices))
    seconds = time.perf_counter() - start
    if barrier is not None:
        barrier()
    npz = None
    if rank == 0 or barrier is None:
        done = scan_parts(parts)
        if all(i in done for i in range(num_samples)):
            npz = merge_parts(out, num_samples, progress)
    return BulkResult(npz, len(todo), len(mine) - len(todo), nfe, seconds, len(todo) / max(seconds, 1e-9))


__all__ = [
    "BulkResult",
    "Generated",
    "GridResult",
    "ModelInfo",
    "ResumeError",
    "SampleSpec",
    "SamplingPipeline",
    "load_model_for_sampling",
    "merge_parts",
    "random_labels",
    "sample_bulk",
    "sample_grid",
    "sample_seed",
    "save_png",
    "scan_parts",
    "to_uint8",
    "vae_enabled",
]
