"""The sampling pipeline: model + objective + ``SampleSpec`` + decoder -> images of given sample
indices, each from its own seed (see :mod:`sit_vit5.sampling`), and its builders for each source."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers import AutoencoderKL
from torch import Tensor, nn

from ..guidance import ClassifierFreeGuidance
from ..images import to_uint8
from ..latent_norm import LatentNorm
from ..objective import Objective, as_objective, create_objective
from ..sample_spec import SampleSpec, check_cfg_scale
from ..stepwise import Steps, denoise
from ..transport import Sampler, Transport
from ..transport.rng import sample_seed
from ..utils.checksums import json_safe, payload_sha256
from ..utils.errors import ConfigError, SettingError, SitVit5Error
from ..utils.precision import PRECISION_OF_DTYPE, autocast, check_precision
from ..vae import (
    SD_VAE_EMA,
    decoder,
    downsampling_factor,
    load_vae,
    vae_enabled,
)

if TYPE_CHECKING:
    from ..diffusion import DiffusionSampler, GaussianDiffusion
    from ..models.checkpoint_files import LoadedModel

NOISE_STREAM, LABEL_STREAM = 0, 1  # per-sample generator streams: noise (initial + SDE) and label




@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters with requires_grad off inside the block, as they were after it."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    module.requires_grad_(False)
    try:
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


def random_labels(indices: Sequence[int], global_seed: int, num_classes: int) -> np.ndarray:
    """Uniform labels in ``[0, num_classes)`` (int64, one per index), each from its sample's own
    generator."""
    seeds = [sample_seed(global_seed, i, LABEL_STREAM) for i in indices]
    labels = [int(torch.randint(num_classes, (1,), generator=torch.Generator().manual_seed(s)))
              for s in seeds]
    return np.array(labels, dtype=np.int64)



class NonFiniteSampleError(SitVit5Error, RuntimeError):
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

    ``objective`` is the model's :class:`~sit_vit5.objective.Objective` (or the SiT ``Transport`` /
    DiT ``GaussianDiffusion`` it wraps): it builds the sampler and reads the model's full output.
    Build one from its source with :meth:`for_model` (a loaded checkpoint), :meth:`for_run` (a
    training run's config and EMA) or :meth:`for_components` (a diffusers pipeline's parts); they
    own the decoder, latent shape and image-size checks.

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
    objective: Objective | Transport | GaussianDiffusion
    spec: SampleSpec
    latent_shape: tuple[int, int, int]
    num_classes: int
    decode: Callable[[Tensor], Tensor] | None = None
    device: torch.device | str = "cpu"
    precision: str = "fp32"
    source: str = "the model"  # what errors call the weights (sample.py: the checkpoint path)
    pixel_space: bool | None = None
    compile: bool = False
    allow_negative_cfg: bool = False  # a cfg_scale < 0 steers away from the class: only when asked
    vae_factor: int = 1  # pixels per latent along a side (1: no decoder)
    vae: nn.Module | None = field(default=None, repr=False)  # the decoder's module, for its digest
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
        if spec.cfg_scale != 1.0 and not getattr(self.model, "has_null_class", True):
            raise ValueError(f"cfg_scale={spec.cfg_scale} needs a null class, but the model was "
                             "built with class_dropout_prob=0 (no null row in its label table); "
                             "use cfg_scale 1")
        check_cfg_scale(spec.cfg_scale, self.allow_negative_cfg)
        if spec.cfg_scale < 0:
            warnings.warn(f"cfg_scale={spec.cfg_scale} < 0 steers samples away from their class",
                          stacklevel=2)
        self.device = torch.device(self.device)
        objective = self.objective = as_objective(self.objective)
        self.model = self.model.to(self.device).eval()  # eval: no label dropout
        weights = next(self.model.parameters(), torch.empty(0)).dtype  # float32 for a weightless fn
        if weights != torch.float32:  # half weights (torch_dtype= at load): autocast in their dtype
            if self.precision not in ("fp32", PRECISION_OF_DTYPE.get(weights)):
                raise ValueError(f"precision={self.precision!r} but the model's weights are "
                                 f"{weights}; use the weights' precision or load them in float32")
            self.precision = PRECISION_OF_DTYPE[weights]
        self.net = torch.compile(self.model) if self.compile else self.model
        self.pixel_space = self.decode is None if self.pixel_space is None else self.pixel_space
        built = objective.sampler(spec, pixel_space=self.pixel_space)
        self.sampler, self.sample_fn = built.sampler, built.sample
        self.model_fn = self._forward
        if spec.cfg_scale != 1.0:
            self.model_fn = ClassifierFreeGuidance(
                self._forward, spec.cfg_scale, null_class=self.num_classes,
                cfg_channels=spec.cfg_channels or channels,  # never a 2C output's variance half
                interval=spec.cfg_interval,
            )

    # ------------------------------------------------------------------------- builders

    @classmethod
    def for_model(
        cls, loaded: LoadedModel, spec: SampleSpec, *, objective: Objective | None = None,
        vae: str | AutoencoderKL | None = None, image_size: int | None = None, **kwargs: Any,
    ) -> SamplingPipeline:
        """The pipeline of a loaded checkpoint with its objective (or ``objective``).

        ``vae``: None = no decoding (the model's outputs, at its training size); a decoder (hub
        id, folder or module; "none" for a pixel model) decodes at ``image_size`` pixels (default:
        the training size), with the checkpoint's latent normalisation. ``kwargs``: ``device``,
        ``precision``, ``compile``, ``source``, ``allow_negative_cfg``."""
        kwargs.setdefault("pixel_space", not vae_enabled(loaded.vae.get("name", "none")))
        objective = objective or create_objective(loaded.objective)
        if vae is None:
            side = loaded.input_size
            return cls(loaded.model, objective, spec, (loaded.in_channels, side, side),
                       loaded.num_classes, **kwargs)
        if isinstance(vae, (str, os.PathLike)):
            vae = load_vae(vae, device=kwargs.get("device", "cpu")) if vae_enabled(vae) else None
        return cls._decoding(loaded.model, objective, spec, loaded.num_classes, vae,
                             _norm(loaded.vae, "the checkpoint's vae"), image_size, **kwargs)

    @classmethod
    def for_run(cls, cfg: Mapping[str, Any], ema: nn.Module, objective: Objective,
                device: torch.device | str, vae: AutoencoderKL | None = None) -> SamplingPipeline:
        """The pipeline of a training run: its EMA model, objective and ``sample`` section, decoded
        with the run's VAE (``vae``: None = a pixel-space run) and latent normalisation."""
        spec = SampleSpec.resolve(cfg["sample"])
        return cls._decoding(ema, objective, spec, cfg["model"]["num_classes"], vae,
                             _norm(cfg["vae"], "vae"), None, device=device,
                             pixel_space=not vae_enabled(cfg["vae"]["name"]),
                             source=f"the EMA of the run in {cfg['train']['out_dir']}")

    @classmethod
    def for_components(cls, model: nn.Module, objective: Objective, spec: SampleSpec,
                       vae: AutoencoderKL | None, device: torch.device | str,
                       norm: LatentNorm | None = None) -> SamplingPipeline:
        """The pipeline of a diffusers ``SiTPipeline``'s parts (``vae`` None: pixel space), at the
        model's training size, with ``norm`` (None: what the VAE's config says)."""
        return cls._decoding(model, objective, spec, model.num_classes, vae, norm, None,
                             device=device)

    @classmethod
    def _decoding(cls, model: nn.Module, objective: Objective, spec: SampleSpec,
                  num_classes: int, vae: AutoencoderKL | None, norm: LatentNorm | None,
                  image_size: int | None, **kwargs: Any) -> SamplingPipeline:
        """``model`` with ``vae``'s decoder (None: pixel space) and latent normalisation ``norm``
        (None: the VAE config's): the latent shape from the image size, checked against the VAE
        factor, the patch size and the VAE's latent channels."""
        channels, trained_side, patch = model.in_channels, model.input_size, model.patch_size
        decode, factor = None, 1
        if vae is not None:
            factor = downsampling_factor(vae)
            if vae.config.latent_channels != channels:
                raise SettingError("vae", vae.config.get("_name_or_path") or "the decoder",
                                   f": {vae.config.latent_channels}-channel latents, but the "
                                   f"model works on {channels} channels")
            name = vae.config.get("_name_or_path") or "the decoder"
            try:
                if norm is None:
                    norm = LatentNorm.from_vae_config(vae.config)
                else:
                    norm.check_vae(vae.config, name)
                norm.check_channels(channels, "the model's latents")
            except ConfigError as err:
                raise SettingError("vae", name, f": {err}") from None
            decode = decoder(vae, norm)
        elif channels not in (1, 3):
            raise SettingError("vae", "none", f": the model makes {channels}-channel latents; "
                               f"name a decoder (e.g. {SD_VAE_EMA})")
        image_size = image_size or trained_side * factor
        side = image_size // factor
        if image_size % factor or side % patch:
            raise SettingError("image_size", image_size, f": must be a multiple of "
                               f"{factor * patch} (VAE factor {factor} x patch size {patch})")
        if side != trained_side:
            warnings.warn(f"image size {image_size}: the model was trained at "
                          f"{trained_side * factor}; sampling at another size interpolates its "
                          "position embedding", stacklevel=3)
        return cls(model, objective, spec, (channels, side, side), num_classes, decode,
                   vae_factor=factor, vae=vae, **kwargs)

    def steps(self, scheduler: Any = None) -> Steps:
        """The step-wise sampler for :meth:`generate`'s ``steps``: the objective's own steps, or a
        diffusers ``scheduler``'s, on this pipeline's spec, data range and device."""
        return self.objective.steps(self.spec, pixel_space=self.pixel_space, scheduler=scheduler,
                                    device=self.device)

    def input_digests(self) -> dict[str, str]:
        """SHA-256 of the weights the images come from: the model's and the decoder's (with its
        config). Content, not paths: a file replaced at the same path changes them. Hashes every
        parameter once (~1 s per GB on a CPU core)."""
        digests = {"weights_sha256": payload_sha256({"model": self.model.state_dict()})}
        if self.vae is not None:
            digests["vae_sha256"] = payload_sha256({"vae": self.vae.state_dict(),
                                                    "config": json_safe(dict(self.vae.config))})
        return digests

    @property
    def image_size(self) -> int:
        """Side of the output images in pixels (the latent side times the VAE factor)."""
        return self.latent_shape[1] * self.vae_factor

    def _forward(self, x: Tensor, t: Tensor, y: Tensor, **kwargs: Any) -> Tensor:
        """The model under this pipeline's autocast, float32 out; ``kwargs``: the sampler's extra
        keywords (MeanFlow's ``interval``)."""
        with autocast(self.device, self.precision):
            return self.net(x, t, y, **kwargs).float()

    @torch.no_grad()
    def generate(
        self, indices: Sequence[int], global_seed: int, labels: Sequence[int] | None = None, *,
        generators: Sequence[torch.Generator] | None = None, steps: Steps | None = None,
        tick: Callable[[], Any] | None = None,
    ) -> Generated:
        """Images of samples ``indices``: sample i's initial noise (float32) and any stochastic
        noise come from its own generator (``generators``, else sample.py's stream i of
        ``global_seed``), its class is ``labels[i]`` (None: uniform random labels from the
        per-sample seeds). ``steps``: sample step by step (``objective.steps``) instead of the
        whole-trajectory sampler; ``tick()`` is called once per model evaluation (a progress bar).
        """
        indices = np.asarray(indices, dtype=np.int64)
        if labels is None:
            labels = random_labels(indices.tolist(), global_seed, self.num_classes)
        labels = np.asarray(labels, dtype=np.int64)
        if len(labels) != len(indices):
            raise ValueError(f"{len(labels)} labels for {len(indices)} samples")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got "
                             f"{sorted(set(labels.tolist()))}")
        gens = list(generators) if generators is not None else [
            torch.Generator().manual_seed(sample_seed(global_seed, int(i))) for i in indices]
        where = f"samples {int(indices[0])}..{int(indices[-1])}" if len(indices) else "no samples"
        z = torch.stack([torch.randn(self.latent_shape, generator=g, device=g.device)
                         for g in gens]).to(self.device)
        y = torch.as_tensor(labels, dtype=torch.long).to(self.device)
        model_fn = self.model_fn if tick is None else _Ticking(self.model_fn, tick)
        # frozen while sampling: torch picks its matmul path by requires_grad (~1e-7 apart), so a
        # trainable model would not give the pixels of a loaded one; restored afterwards
        with frozen(self.model):
            if steps is None:
                x, nfe = self.sample_fn(z, model_fn, generator=gens, y=y)[-1], self.sampler.last_nfe
            else:
                x, nfe = denoise(steps, z, model_fn, gens, y=y), len(steps.timesteps)
        if not bool(torch.isfinite(x).all()):  # one reduction per batch; NaN weights end up here
            raise NonFiniteSampleError(
                f"non-finite values (NaN/inf) in {where} from {self.source}: the model's outputs "
                "are not finite (NaN/inf weights?)")
        pixels = self.decode(x) if self.decode is not None else x
        return Generated(indices, to_uint8(pixels), labels, pixels.float().cpu(), nfe)


def _norm(section: Mapping[str, Any], where: str) -> LatentNorm:
    """A ``vae`` section's normalisation (SettingError naming the key when it is unusable)."""
    try:
        return LatentNorm.from_section(section)
    except ConfigError as err:
        raise SettingError(where, dict(section).get("name"), f": {err}") from None


class _Ticking:
    """A model function that calls ``tick()`` once per evaluation (progress bars)."""

    def __init__(self, fn: Callable[..., Tensor], tick: Callable[[], Any]) -> None:
        self.fn, self.tick = fn, tick

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        out = self.fn(*args, **kwargs)
        self.tick()
        return out
