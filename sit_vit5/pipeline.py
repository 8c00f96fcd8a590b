"""``SiTPipeline``: a diffusers ``DiffusionPipeline`` around our model, VAE and sampler settings.

    from sit_vit5 import SiTPipeline
    pipe = SiTPipeline.from_pretrained("exported/")  # written by python -m sit_vit5.export
    images = pipe([207, 360], num_inference_steps=50, guidance_scale=1.5, generator=0).images
    pipe.save_pretrained("copy/")                    # like any diffusers pipeline
    pipe.push_to_hub("me/my-sit")

Components: ``transformer`` (``SiT`` / ``ViT5``, a diffusers ``ModelMixin``), ``vae`` (an
``AutoencoderKL``; None for pixel-space models) and ``scheduler`` (``SiTScheduler``: the transport
and the sampler settings, ``scheduler/scheduler_config.json``). Images come from
``sit_vit5.sampling``'s ``SamplingPipeline``, the code behind ``sample.py``: the same seed and
settings give the same pixels as ``sample.py grid`` (image i of a call is sample i of the seed,
whatever the batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    ConfigMixin,
    DiffusionPipeline,
    ImagePipelineOutput,
    SchedulerMixin,
)
from diffusers.configuration_utils import register_to_config
from PIL import Image

from .models import SiT
from .objective import Objective, create_objective
from .sampling import SampleSpec, SamplingPipeline
from .vae import downsampling_factor

OUTPUT_TYPES = ("pil", "np", "pt")


class SiTScheduler(SchedulerMixin, ConfigMixin):
    """How to sample: ``transport`` (the objective's config section: ``objective`` sit with
    ``create_transport`` keywords path_type, prediction, ..., or ddpm with DiT's diffusion keys) and
    ``sampler`` (``SampleSpec`` fields: method, sampling_method, num_steps, cfg_scale, ...), plus
    where the latents come from (``vae``: the decoder's source id and scaling factor, for the
    record).

    Not a diffusers step-by-step scheduler: the transport's ODE/SDE integrators run the whole
    trajectory; this object only carries the settings through ``save_pretrained`` /
    ``from_pretrained``.
    """

    config_name = "scheduler_config.json"

    @register_to_config
    def __init__(
        self,
        transport: dict[str, Any] | None = None,
        sampler: dict[str, Any] | None = None,
        vae: dict[str, Any] | None = None,
    ) -> None:
        self.spec()  # fail now, naming the field, rather than at the first call

    def spec(self, **overrides: Any) -> SampleSpec:
        """The sampler settings as a ``SampleSpec``, with ``overrides`` (None values ignored)
        applied."""
        settings = {
            **(self.config.sampler or {}),
            **{k: v for k, v in overrides.items() if v is not None},
        }
        return SampleSpec(**settings)

    def transport(self) -> Objective:
        """The objective the model was trained with: SiT's ``Transport`` or DiT's diffusion."""
        return create_objective(self.config.transport or {})


def scheduler_from(
    transport: dict[str, Any], spec: SampleSpec, vae: dict[str, Any] | None = None
) -> SiTScheduler:
    """A ``SiTScheduler`` holding ``transport`` (the objective's config section) and every field of
    ``spec``."""
    sampler = dataclasses.asdict(spec)
    return SiTScheduler(transport=dict(transport), sampler=sampler, vae=dict(vae) if vae else None)


class SiTPipeline(DiffusionPipeline):
    """Class-conditional image generation with a SiT / ViT-5 model (see the module docstring)."""

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(
        self, transformer: SiT, scheduler: SiTScheduler, vae: AutoencoderKL | None = None
    ) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)

    def vae_scale_factor(self) -> int:
        """Pixels per latent along each side (1 for a pixel-space model)."""
        return 1 if self.vae is None else downsampling_factor(self.vae)

    def sampling_pipeline(
        self,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
    ) -> SamplingPipeline:
        """The ``sit_vit5.sampling.SamplingPipeline`` this pipeline's settings describe (what
        sample.py runs)."""
        spec = self.scheduler.spec(num_steps=num_inference_steps, cfg_scale=guidance_scale)
        return SamplingPipeline.for_components(
            self.transformer, self.scheduler.transport(), spec, self.vae, self.device
        )

    @staticmethod
    def _global_seed(generator: int | torch.Generator | None) -> int:
        if isinstance(generator, (list, tuple)):
            raise TypeError(
                "generator: pass one seed (int) or one torch.Generator; image i uses its own "
                "stream derived from it (per-image generator lists are not supported)"
            )
        if generator is None:
            return int(torch.randint(0, 2**62, ()))
        if isinstance(generator, torch.Generator):
            return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        if isinstance(generator, (int, np.integer)) and generator >= 0:
            return int(generator)
        raise TypeError(
            f"generator must be a seed >= 0, a torch.Generator or None, got {generator!r}"
        )

    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | list[int] | torch.Tensor,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        generator: int | torch.Generator | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        batch_size: int = 32,
    ) -> ImagePipelineOutput | tuple:
        """Images of ``class_labels`` (one image per label).

        ``num_inference_steps`` / ``guidance_scale``: override the scheduler's ``num_steps`` /
        ``cfg_scale`` (None = the exported defaults). ``generator``: an int is ``sample.py``'s
        ``--seed`` (image i is sample i of that seed: identical pixels); a ``torch.Generator`` draws
        such a seed; None = random. ``output_type``: "pil" (list of PIL images), "np" (uint8 array
        (N, H, W, C), the pixels sample.py writes) or "pt" (float tensor (N, C, H, W) in about [-1,
        1], before quantisation).
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; valid: {', '.join(OUTPUT_TYPES)}")
        labels = torch.as_tensor(class_labels).reshape(-1).tolist()
        seed = self._global_seed(generator)
        pipe = self.sampling_pipeline(num_inference_steps, guidance_scale)
        batches = [
            pipe.generate(
                range(lo, min(lo + batch_size, len(labels))), seed, labels[lo : lo + batch_size]
            )
            for lo in self.progress_bar(range(0, len(labels), batch_size))
        ]
        if output_type == "pt":
            images: Any = torch.cat([b.pixels for b in batches])
        else:
            images = np.concatenate([b.images for b in batches])
            if output_type == "pil":
                images = [Image.fromarray(im[..., 0] if im.shape[2] == 1 else im) for im in images]
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)


__all__ = ["OUTPUT_TYPES", "SiTPipeline", "SiTScheduler", "scheduler_from"]
