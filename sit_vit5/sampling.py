"""Image generation from trained models: checkpoint loading, per-index deterministic sampling, grids
and bulk (FID) sampling into an ADM-compatible ``.npz``.

Determinism: sample ``i`` of a run with global seed ``s`` draws its initial noise, its SDE noise and
(when labels are random) its label from its own generators, seeded by ``sample_seed(s, i, stream)``.
Its image therefore does not depend on which process made it, on the batch it was in, or on what was
sampled before; bulk sampling can be sharded over any number of processes, batched at any size, and
resumed. Two caveats: (1) a model's float numerics can differ by ~1e-7 between batch sizes (CPU and
GPU matmul kernels depend on the batch shape), which can move a pixel across a uint8 boundary (±1)
in rare cases; (2) adaptive ODE solvers (dopri5, ...) choose their steps from the error of the whole
batch, so their images depend on the batch composition within the solver tolerance. Fixed-step ODE
solvers and all SDE samplers have no such coupling.

Bulk layout (``out_dir``)::

    settings.json                 what the samples depend on; a resumed run must match it
    parts/0000000-0000031.npz     one file per generated batch: indices, images (uint8 NHWC), labels
    images/000000.png             optional single images
    samples_{N}x{H}x{W}x3.npz     arr_0 uint8 [N, H, W, 3], arr_1 int64 labels [N] (index order)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .diffusion import GaussianDiffusion
from .guidance import ClassifierFreeGuidance
from .images import save_png, save_uint8_grid, to_rgb, to_uint8
from .io import atomic_write, atomic_write_text
from .models.checkpoint import LoadedModel
from .objective import SAMPLE_METHODS, DiffusionSampler, create_objective, guided_channels, prepare_model
from .precision import PRECISION_OF_DTYPE, autocast, check_precision
from .transport import Sampler, Transport
from .transport.integrators import is_adaptive
from .transport.rng import sample_seed

NOISE_STREAM, LABEL_STREAM = 0, 1  # per-sample generator streams: noise (initial + SDE) and label
DEFAULT_SAMPLING_METHOD = {"ode": "dopri5", "sde": "Euler"}  # SiT's sample.py defaults per method
#: every sampler: ode | sde for the transport (objective sit), ddpm | ddim for DiT's diffusion
METHODS = (*SAMPLE_METHODS["sit"], *SAMPLE_METHODS["ddpm"])


def random_labels(indices: Sequence[int], global_seed: int, num_classes: int) -> np.ndarray:
    """Uniform labels in ``[0, num_classes)`` (int64, one per index), each from its sample's own
    generator."""
    seeds = [sample_seed(global_seed, i, LABEL_STREAM) for i in indices]
    labels = [int(torch.randint(num_classes, (1,), generator=torch.Generator().manual_seed(s)))
              for s in seeds]
    return np.array(labels, dtype=np.int64)


# ----------------------------------------------------------------------------- sampling settings


@dataclass(frozen=True)
class SampleSpec:
    """How to integrate from noise to data, and how to guide: the one home of every sampler default.

    Field names are the config's ``sample`` keys and sample.py's flags (``--num-steps`` =
    num_steps). Defaults are SiT's sample.py defaults. ``method``: ode | sde (objective sit), or
    ddpm | ddim (objective ddpm: DiT's ancestral sampler, or DDIM with eta 0, on ``num_steps``
    respaced steps; ``sampling_method`` and the ODE/SDE keys do not apply, ``cfg_interval`` is
    refused). ``sampling_method``:
    ODE: a torchdiffeq method (dopri5, euler, heun2, midpoint, rk4, ...); SDE: Euler | Heun; None =
    dopri5 / Euler. ``num_steps``: grid points (fixed-step ODE: num_steps - 1 steps; adaptive ODE:
    only where the solution is reported). ``atol``/``rtol``: adaptive ODE tolerances.
    ``diffusion_form``/``diffusion_norm``/``last_step``/``last_step_size``: SDE only (see
    ``sit_vit5.transport.Sampler.sample_sde``). ``cfg_scale`` 1 = no guidance; ``cfg_channels`` None
    = guide all channels, 3 = the SiT/DiT legacy mode; ``cfg_interval`` (t_lo, t_hi) = guide only
    there.
    """

    method: str = "ode"
    sampling_method: str | None = None
    num_steps: int = 250
    atol: float = 1e-6
    rtol: float = 1e-3
    # sigma, not SiT's Sampler-API default SBDM: it is SiT's sample.py default, the setting
    # behind the published FID 2.06 (docs/DESIGN.md §4)
    diffusion_form: str = "sigma"
    diffusion_norm: float = 1.0
    last_step: str | None = "Mean"
    last_step_size: float = 0.04
    cfg_scale: float = 1.0
    cfg_channels: int | None = None
    cfg_interval: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; valid: {', '.join(METHODS)}")
        numbers = ("atol", "rtol", "diffusion_norm", "last_step_size", "cfg_scale")
        for name, kinds in (("num_steps", int), *((n, (int, float)) for n in numbers)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ValueError(f"{name}={value!r}: expected "
                                 + ("an int" if kinds is int else "a number"))
        diffusion = self.method in SAMPLE_METHODS["ddpm"]
        if diffusion and self.sampling_method is not None:
            raise ValueError(f"sampling_method={self.sampling_method!r} applies to ode / sde, not "
                             f"method={self.method!r}")
        if diffusion and self.cfg_interval is not None:
            raise ValueError(f"cfg_interval is defined on the transport's t in [0, 1]; method="
                             f"{self.method!r} (objective ddpm) does not support it")
        if self.sampling_method is None and not diffusion:  # frozen: set via object.__setattr__
            object.__setattr__(self, "sampling_method", DEFAULT_SAMPLING_METHOD[self.method])
        if self.last_step == "none":
            object.__setattr__(self, "last_step", None)
        if self.cfg_interval is not None:
            lo, hi = (float(v) for v in self.cfg_interval)
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"cfg_interval=({lo}, {hi}): need 0 <= t_lo <= t_hi <= 1")
            object.__setattr__(self, "cfg_interval", (lo, hi))
        if self.cfg_channels is not None and self.cfg_channels < 1:
            raise ValueError(f"cfg_channels={self.cfg_channels}: must be >= 1 (or None for all "
                             "channels)")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The field names: config ``sample`` keys and CLI flag names (``_`` -> ``-``)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, *layers: Mapping[str, Any]) -> SampleSpec:
        """The spec from ``layers`` of settings, highest priority first (e.g. CLI flags, then a
        checkpoint's ``sample`` section): each field takes its first non-None value, else the
        default.

        Keys that are not fields (a config section's ``num_images``, ...) are ignored. A layer's
        ``sampling_method`` is used only with the method it was written for: the layer's own
        ``method`` if it sets one (so a checkpoint's ODE solver does not leak into an SDE run), else
        whichever method wins.
        """
        known = [{k: v for k, v in layer.items() if k in cls.keys() and v is not None}
                 for layer in layers]
        method = next((layer["method"] for layer in known if "method" in layer), cls.method)
        if method in SAMPLE_METHODS["ddpm"]:  # a config's ODE/SDE solver (default euler): unused
            known = [{k: v for k, v in layer.items() if k != "sampling_method"} for layer in known]
        values: dict[str, Any] = {"method": method}
        for layer in known:
            if layer.get("method", method) != method:
                layer = {k: v for k, v in layer.items() if k != "sampling_method"}
            for key, value in layer.items():
                values.setdefault(key, value)
        if values.get("cfg_interval") is not None:
            values["cfg_interval"] = tuple(values["cfg_interval"])
        return cls(**values)

    @property
    def batch_coupled(self) -> bool:
        """True when images depend on the batch composition (adaptive ODE step-size control)."""
        return self.method == "ode" and is_adaptive(self.sampling_method)

    def build(self, sampler: Sampler | DiffusionSampler) -> Callable[..., Any]:
        """The sampling function ``fn(z, model_fn, *, generator, **model_kwargs)`` of a transport
        :class:`Sampler` (ode / sde) or a :class:`DiffusionSampler` (ddpm / ddim)."""
        objective = "ddpm" if isinstance(sampler, DiffusionSampler) else "sit"
        if self.method not in SAMPLE_METHODS[objective]:
            raise ValueError(f"method={self.method!r} cannot sample a model trained with the "
                             f"{objective} objective; valid: {', '.join(SAMPLE_METHODS[objective])}")
        if objective == "ddpm":
            return sampler.build(self.method, self.num_steps)
        if self.method == "ode":
            return sampler.sample_ode(sampling_method=self.sampling_method,
                                      num_steps=self.num_steps, atol=self.atol, rtol=self.rtol)
        return sampler.sample_sde(
            sampling_method=self.sampling_method,
            diffusion_form=self.diffusion_form,
            diffusion_norm=self.diffusion_norm,
            last_step=self.last_step,
            last_step_size=self.last_step_size,
            num_steps=self.num_steps,
        )


class NonFiniteSampleError(RuntimeError):
    """Samples with NaN/inf values: the model (e.g. an EMA holding a NaN) produced garbage; the
    message names the weights' source and the sample indices."""


@dataclass
class Generated:
    """One generated batch: ``images`` uint8 ``(B, H, W, C)`` (C = 1 or 3), ``labels`` int64
    ``(B,)``, ``pixels`` float ``(B, C, H, W)`` before quantization (CPU), ``nfe`` model evaluations
    of the sampler."""

    indices: np.ndarray
    images: np.ndarray
    labels: np.ndarray
    pixels: Tensor
    nfe: int | None


@dataclass
class SamplingPipeline:
    """Model + objective + sampler settings + decoder: ``generate(indices, global_seed)`` -> images.

    ``transport`` is the model's objective: a :class:`Transport` (sit) or a
    :class:`GaussianDiffusion` (ddpm; the model is then set to return its variance half, and
    guidance of "all channels" means the C noise channels, as DiT's).

    ``latent_shape`` is ``(C, h, w)`` of the model input; ``decode`` maps samples to images in [-1,
    1] ``(B, 3 or C, H, W)`` (None: identity). ``pixel_space``: the model generates images in [-1,
    1] itself (None: when ``decode`` is None); DDPM / DDIM then clip their x0 predictions to that
    range, as ADM does for images (DiT's latents are unbounded: no clipping). ``precision`` bf16 /
    fp16 runs the model under autocast (the integrator stays fp32); a model with bf16 / fp16 weights
    (loaded with ``torch_dtype=``) runs under autocast in their dtype. ``compile``: the model's
    forward runs ``torch.compile``-d (inductor; the first batch of each shape compiles). The initial
    noise is drawn in float32 on the CPU from per-sample generators, so it is the same on every
    device and in every precision. The model is moved to ``device`` in eval mode.
    """

    model: nn.Module
    transport: Transport | GaussianDiffusion
    spec: SampleSpec
    latent_shape: tuple[int, int, int]
    num_classes: int
    decode: Callable[[Tensor], Tensor] | None = None
    device: torch.device | str = "cpu"
    precision: str = "fp32"
    source: str = "the model"  # what errors call the weights (sample.py: the checkpoint path)
    pixel_space: bool | None = None
    compile: bool = False
    sampler: Sampler | DiffusionSampler = field(init=False, repr=False)
    sample_fn: Callable[..., Any] = field(init=False, repr=False)
    model_fn: Callable[..., Tensor] = field(init=False, repr=False)
    net: Callable[..., Tensor] = field(init=False, repr=False)  # the model, or its compiled forward

    def __post_init__(self) -> None:
        check_precision(self.precision)
        spec, channels = self.spec, self.latent_shape[0]
        if spec.cfg_channels is not None and spec.cfg_channels > channels:
            raise ValueError(f"cfg_channels={spec.cfg_channels} but the model has {channels} "
                             "channels")
        table = getattr(getattr(self.model, "y_embedder", None), "embedding_table", None)
        if spec.cfg_scale != 1.0 and table is not None and table.num_embeddings <= self.num_classes:
            raise ValueError(f"cfg_scale={spec.cfg_scale} needs a null class, but the model was "
                             "built with class_dropout_prob=0 (no null row in its label table); "
                             "use cfg_scale 1")
        if spec.cfg_scale < 0:
            warnings.warn(f"cfg_scale={spec.cfg_scale} < 0 steers samples away from their class",
                          stacklevel=2)
        self.device = torch.device(self.device)
        objective = "ddpm" if isinstance(self.transport, GaussianDiffusion) else "sit"
        # eval: no label dropout
        self.model = prepare_model(self.model, objective).to(self.device).eval()
        weights = next(self.model.parameters(), torch.empty(0)).dtype  # float32 for a weightless fn
        if weights != torch.float32:  # half weights (torch_dtype= at load): autocast in their dtype
            if self.precision not in ("fp32", PRECISION_OF_DTYPE.get(weights)):
                raise ValueError(f"precision={self.precision!r} but the model's weights are {weights}; "
                                 "use the weights' precision or load them in float32")
            self.precision = PRECISION_OF_DTYPE[weights]
        self.net = torch.compile(self.model) if self.compile else self.model
        if objective == "ddpm":
            pixels = self.decode is None if self.pixel_space is None else self.pixel_space
            self.sampler = DiffusionSampler(self.transport, clip_denoised=pixels)
        else:
            self.sampler = Sampler(self.transport)
        self.sample_fn = spec.build(self.sampler)
        self.model_fn = self._forward
        if spec.cfg_scale != 1.0:
            self.model_fn = ClassifierFreeGuidance(
                self._forward, spec.cfg_scale, null_class=self.num_classes,
                cfg_channels=guided_channels({"objective": objective}, spec.cfg_channels, channels),
                interval=spec.cfg_interval,
            )

    @classmethod
    def for_model(cls, loaded: LoadedModel, spec: SampleSpec, **kwargs: Any) -> SamplingPipeline:
        """The pipeline of a loaded checkpoint at its training size, with its objective (transport
        or DiT's diffusion); ``kwargs``: ``decode``, ``device``, ``precision``, ``pixel_space`` (default:
        from the checkpoint's ``vae.name``: "none" = pixel space)."""
        side = loaded.input_size
        kwargs.setdefault("pixel_space", loaded.vae.get("name", "none") == "none")
        return cls(loaded.model, create_objective(loaded.objective_config), spec,
                   (loaded.in_channels, side, side), loaded.num_classes, **kwargs)

    def _forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        with autocast(self.device, self.precision):
            return self.net(x, t, y).float()

    @torch.no_grad()
    def generate(
        self, indices: Sequence[int], global_seed: int, labels: Sequence[int] | None = None
    ) -> Generated:
        """Images of samples ``indices``; ``labels`` None = uniform random labels from the
        per-sample seeds."""
        indices = np.asarray(indices, dtype=np.int64)
        if labels is None:
            labels = random_labels(indices.tolist(), global_seed, self.num_classes)
        labels = np.asarray(labels, dtype=np.int64)
        if len(labels) != len(indices):
            raise ValueError(f"{len(labels)} labels for {len(indices)} samples")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got "
                             f"{sorted(set(labels.tolist()))}")
        gens = [torch.Generator().manual_seed(sample_seed(global_seed, int(i))) for i in indices]
        z = torch.stack([torch.randn(self.latent_shape, generator=g) for g in gens]).to(self.device)
        y = torch.from_numpy(labels).to(self.device)
        # the same generators go on to draw the SDE noise
        x = self.sample_fn(z, self.model_fn, generator=gens, y=y)[-1]
        if not bool(torch.isfinite(x).all()):  # one reduction per batch; NaN weights end up here
            raise NonFiniteSampleError(
                f"non-finite values (NaN/inf) in samples {int(indices[0])}..{int(indices[-1])} from "
                f"{self.source}: the model's outputs are not finite (NaN/inf weights?); nothing "
                "was written for them")
        pixels = self.decode(x) if self.decode is not None else x
        return Generated(indices, to_uint8(pixels), labels, pixels.float().cpu(),
                         self.sampler.last_nfe)


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


def generate_first(
    pipe: SamplingPipeline,
    num_images: int,
    labels: Sequence[int] | None = None,
    global_seed: int = 0,
    batch_size: int = 32,
    progress: bool = True,
) -> list[Generated]:
    """Samples ``0 .. num_images-1`` in batches of ``batch_size``; ``labels`` None = random labels,
    else one label per image."""
    if labels is not None and len(labels) != num_images:
        raise ValueError(f"{len(labels)} labels for {num_images} images")
    batches = []
    starts = range(0, num_images, batch_size)
    for lo in tqdm(starts, disable=not progress, desc="grid", unit="batch"):
        idx = list(range(lo, min(lo + batch_size, num_images)))
        batches.append(pipe.generate(idx, global_seed,
                                     None if labels is None else labels[lo : lo + len(idx)]))
    return batches


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
    """Generate samples ``0 .. num_images-1`` and write ``out_dir/grid.png`` and
    ``out_dir/{i:06d}.png``.

    ``labels`` None = random labels (image i is then bulk sample i of the same seed); otherwise one
    label per image. Tiny images are upscaled (nearest) to >= 64 px in the grid only; the single
    PNGs keep their size.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    batches = generate_first(pipe, num_images, labels, global_seed, batch_size, progress)
    seconds = time.perf_counter() - start
    images = np.concatenate([b.images for b in batches])
    paths = []
    for i, image in enumerate(images):
        paths.append(out / f"{i:06d}.png")
        save_png(image, paths[-1])
    grid = out / "grid.png"
    save_uint8_grid(images, grid, nrow)
    return GridResult(grid, paths, np.concatenate([b.labels for b in batches]), batches[-1].nfe,
                      seconds, num_images / max(seconds, 1e-9))


# ----------------------------------------------------------------------------- bulk


class ResumeError(ValueError):
    """An output directory holding samples made with other settings."""


@dataclass
class BulkResult:
    """What one ``sample_bulk`` call did: ``npz`` is the merged file (None if this process did not
    merge or samples are still missing); ``generated``/``skipped`` count this process's indices."""

    npz: Path | None
    generated: int
    skipped: int
    nfe: int | None
    seconds: float
    images_per_second: float


def _part_name(indices: np.ndarray) -> str:
    """``{first:07d}-{last:07d}.npz`` for a contiguous run of indices; ``...-step{k}.npz`` for every
    k-th index (one process of k); else ``...-{count}-{sha8}.npz`` (a resume's leftovers), so a
    name never claims indices the part does not hold and two different sets never share one."""
    first, last = int(indices[0]), int(indices[-1])
    gaps = np.unique(np.diff(indices)) if len(indices) > 1 else np.array([1])
    if len(gaps) == 1 and gaps[0] == 1:
        return f"{first:07d}-{last:07d}.npz"
    if len(gaps) == 1 and gaps[0] > 1:
        return f"{first:07d}-{last:07d}-step{int(gaps[0])}.npz"
    digest = hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()[:8]
    return f"{first:07d}-{last:07d}-{len(indices)}-{digest}.npz"


def _save_part(parts_dir: Path, batch: Generated) -> Path:
    """Write one batch as ``parts/<_part_name>`` atomically (resume trusts complete files only)."""

    path = parts_dir / _part_name(batch.indices)
    atomic_write(path, lambda f: np.savez(f, indices=batch.indices, images=batch.images,
                                          labels=batch.labels))
    return path


def scan_parts(parts_dir: str | os.PathLike, remove_unreadable: bool = False
               ) -> dict[int, tuple[Path, int]]:
    """Map each finished sample index to ``(part file, row)``; temporary files (``.tmp-*``) are
    ignored. An unreadable part (truncated or damaged after it was written: parts are written
    atomically) is skipped with a warning, and with ``remove_unreadable`` deleted, so that its
    samples are made again and it is not warned about forever."""
    found: dict[int, tuple[Path, int]] = {}
    parts_dir = Path(parts_dir)
    if not parts_dir.is_dir():
        return found
    for part in sorted(parts_dir.glob("[0-9]*.npz")):
        try:
            with np.load(part, allow_pickle=False) as f:
                indices = f["indices"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            if remove_unreadable:
                part.unlink(missing_ok=True)
            warnings.warn(f"{'removed' if remove_unreadable else 'ignoring'} unreadable part "
                          f"{part} ({err}); its samples will be regenerated", stacklevel=2)
            continue
        for row, i in enumerate(indices.tolist()):
            found.setdefault(i, (part, row))
    return found


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record ``settings`` in ``out/settings.json`` on first use; on resume, raise if any key
    differs."""
    path = out / "settings.json"
    # tuples -> lists, paths -> str: compare what would be stored
    settings = json.loads(json.dumps(settings, default=str))
    if path.is_file():
        saved = json.loads(path.read_text())
        diffs = [f"{k}: {saved.get(k)!r} (in {path}) != {settings.get(k)!r} (now)"
                 for k in sorted(set(saved) | set(settings)) if saved.get(k) != settings.get(k)]
        if diffs:
            raise ResumeError(f"{out} holds samples made with other settings:\n  "
                              + "\n  ".join(diffs)
                              + "\nUse another output directory (or delete it) to start over.")
        return
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, text)  # same text from every rank


def _write_npz_streamed(
    path: Path, num: int, done: dict[int, tuple[Path, int]], progress: bool = True,
    cache_size: int = 64,
) -> None:
    """Write ``arr_0`` uint8 [num, H, W, 3] and ``arr_1`` labels in index order, streaming rows from
    the parts (an uncompressed zip of .npy members, as ``np.savez`` writes) so the whole array is
    never in memory."""
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
                for lo in tqdm(range(0, num, 1024), desc="merge", unit="chunk", leave=False,
                               disable=not progress):
                    chunk = []
                    for i in range(lo, min(lo + 1024, num)):
                        image, labels[i] = row(i)
                        if image.shape[:2] != (height, width):
                            raise ValueError(f"{done[i][0]}: image {i} is {image.shape}, "
                                             f"others {first.shape}")
                        chunk.append(image)
                    f.write(to_rgb(np.stack(chunk)).tobytes())
            with zf.open("arr_1.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, labels, allow_pickle=False)

    atomic_write(path, write)


def merge_parts(out_dir: str | os.PathLike, num_samples: int, progress: bool = True) -> Path:
    """Merge ``out_dir/parts`` into ``out_dir/samples_{N}x{H}x{W}x3.npz`` (arr_0 uint8 NHWC RGB,
    arr_1 int64 labels, samples 0..N-1 in index order); raises if any of them is missing."""
    out = Path(out_dir)
    done = scan_parts(out / "parts")
    missing = [i for i in range(num_samples) if i not in done]
    if missing:
        raise ValueError(f"{out}: {len(missing)} of {num_samples} samples are missing "
                         f"(first: {missing[:5]}); "
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
    """Generate samples ``0 .. num_samples-1`` with uniform random labels; this process does ``i %
    world_size == rank``, in batches of ``batch_size``, skipping indices already in
    ``out_dir/parts`` (resume).

    ``settings`` (JSON-able: checkpoint, image size, ...) is recorded with the sampler settings and
    the seed in ``settings.json``; resuming with different ones raises ResumeError (``num_samples``
    may grow: samples are per-index). After a barrier (``barrier``, default torch.distributed's when
    initialised) rank 0 merges all parts into the npz; without a barrier, whichever process finds
    all samples done merges.
    """
    if num_samples < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError("need num_samples, batch_size, world_size >= 1 and 0 <= rank < "
                         "world_size; got "
                         f"{num_samples}, {batch_size}, {world_size}, rank {rank}")
    if pipe.spec.batch_coupled:
        warnings.warn(f"sampling_method={pipe.spec.sampling_method!r} is adaptive: each batch "
                      "shares its step sizes, so images depend on batch composition (within the "
                      "solver tolerance); use a fixed-step method (euler, heun2, rk4) or the SDE "
                      "for index-exact reproducibility", stacklevel=2)
    barrier = barrier or _default_barrier()
    out = Path(out_dir)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    _check_settings(out, {"global_seed": global_seed, "spec": asdict(pipe.spec),
                          "latent_shape": list(pipe.latent_shape), "num_classes": pipe.num_classes,
                          **(settings or {})})
    done = scan_parts(parts, remove_unreadable=True)
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
    return BulkResult(npz, len(todo), len(mine) - len(todo), nfe, seconds,
                      len(todo) / max(seconds, 1e-9))


__all__ = [
    "BulkResult",
    "Generated",
    "GridResult",
    "NonFiniteSampleError",
    "ResumeError",
    "SampleSpec",
    "SamplingPipeline",
    "generate_first",
    "merge_parts",
    "random_labels",
    "sample_bulk",
    "sample_grid",
    "scan_parts",
]
