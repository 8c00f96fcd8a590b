"""``SiTPipeline``: a diffusers ``DiffusionPipeline`` around our model, VAE and sampler settings.

    from sit_vit5 import SiTPipeline
    pipe = SiTPipeline.from_pretrained("exported/")  # written by python -m sit_vit5.export
    images = pipe([207, 360], num_inference_steps=50, guidance_scale=1.5, generator=0).images
    pipe.save_pretrained("copy/")                    # like any diffusers pipeline
    pipe.push_to_hub("me/my-sit")

Components: ``transformer`` (``SiT`` / ``ViT5``, a diffusers ``ModelMixin``), ``vae`` (an
``AutoencoderKL``; None for pixel-space models) and ``scheduler`` (``SiTScheduler``: the transport
and the sampler settings, ``scheduler/scheduler_config.json``); ``id2label`` (optional, in
``model_index.json``) names the classes. Images come from ``sit_vit5.sampling``'s
``SamplingPipeline``, the code behind ``sample.py``: the same seed and settings give the same
pixels as ``sample.py grid`` (image i of a call is sample i of the seed, whatever the batch).

The scheduler can be swapped as in diffusers: ``pipe.scheduler =
FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)`` (SiT objective: our ODE Euler
step by step, diffusers' sigma = 1 - t), ``DDPMScheduler`` / ``DDIMScheduler`` (ddpm objective).
``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads a saved folder where
sit_vit5 is installed: ``save_pretrained`` writes a three-line ``pipeline.py`` that imports this
class (:mod:`sit_vit5.hub.loader`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, ImagePipelineOutput
from PIL import Image
from torch import Tensor

from ..latent_norm import LatentNorm
from ..models import SiT
from ..objective import create_objective
from ..sampling import SampleSpec, SamplingPipeline
from ..transport.rng import sample_seed
from ..vae import downsampling_factor
from .labels import class_ids, class_names, is_integer, label_ids, label_index
from .loader import loader_entry, write_loader
from .scheduler import SETTINGS, SiTScheduler

#: ``output_type`` values: diffusers' pil / np / pt (float in [0, 1]) and sample.py's uint8 pixels
OUTPUT_TYPES = ("pil", "np", "pt", "uint8")


class SiTPipeline(DiffusionPipeline):
    """Class-conditional image generation with a SiT / ViT-5 model (see the module docstring).

    ``id2label``: class id -> name (DiT's format: comma-separated synonyms allowed), saved in
    ``model_index.json``; None = ImageNet's names for a 1000-class model (torchvision's list),
    else none. ``labels`` maps each name to its id and ``get_label_ids`` looks names up, as in
    diffusers' ``DiTPipeline``.
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(
        self, transformer: SiT, scheduler: SiTScheduler, vae: AutoencoderKL | None = None,
        id2label: Mapping[int | str, str] | None = None,
    ) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        names = class_names(id2label, getattr(transformer, "num_classes", None))
        self.register_to_config(id2label=names or None)
        self.id2label = names
        self.labels = label_index(names)
        # the sampling settings, kept for a diffusers scheduler swapped in later
        self._settings = {k: scheduler.config.get(k) for k in SETTINGS}

    # ------------------------------------------------------------------ labels and generators

    def get_label_ids(self, label: str | Sequence[str]) -> list[int]:
        """Class ids of label names (``"golden retriever"`` or a list of names), as DiTPipeline's;
        an unknown name raises a one-line ValueError naming it."""
        return label_ids(self.labels, label)

    @staticmethod
    def _global_seed(generator: int | torch.Generator | None) -> int:
        """sample.py's ``--seed`` of a ``generator`` argument (None: a random one)."""
        if generator is None:
            return int(torch.randint(0, 2**62, ()))
        if isinstance(generator, torch.Generator):
            return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        if is_integer(generator) and generator >= 0:
            return int(generator)
        raise TypeError(f"generator: expected a torch.Generator, a list of them (one per image), a "
                        f"seed >= 0 (int) or None, got {generator!r} ({type(generator).__name__})")

    def _generators(self, generator: Any, count: int) -> list[torch.Generator]:
        """One generator per image: a list as given (diffusers' convention); a seed / generator /
        None -> sample.py's per-sample streams of that seed (image i = sample i)."""
        if isinstance(generator, (list, tuple)):
            if len(generator) != count:
                raise ValueError(f"generator: a list of {len(generator)} generators for {count} "
                                 "images; pass one per image, or one generator / seed for all")
            for g in generator:
                if not isinstance(g, torch.Generator):
                    raise TypeError(f"generator: list entries must be torch.Generator, got {g!r}")
            return list(generator)
        seed = self._global_seed(generator)
        return [torch.Generator().manual_seed(sample_seed(seed, i)) for i in range(count)]

    # ------------------------------------------------------------------ sampling

    def vae_scale_factor(self) -> int:
        """Pixels per latent along each side (1 for a pixel-space model)."""
        return 1 if self.vae is None else downsampling_factor(self.vae)

    def _own_settings(self) -> bool:
        """Whether the scheduler carries the sampling settings: the SiTScheduler does, and so
        does a diffusers one made ``from_config`` of it (or saved by this pipeline)."""
        return isinstance(self.scheduler, SiTScheduler) or \
            self.scheduler.config.get("transport") is not None

    def sampling_settings(self) -> dict[str, Any]:
        """The ``transport`` / ``sampler`` / ``vae`` sections: the SiTScheduler's, else those a
        diffusers scheduler carries over from ``from_config``, else this pipeline's original
        ones."""
        if self._own_settings():
            return {k: self.scheduler.config.get(k) for k in SETTINGS}
        return dict(self._settings)

    def sampling_pipeline(
        self, num_inference_steps: int | None = None, guidance_scale: float | None = None,
    ) -> SamplingPipeline:
        """The ``sit_vit5.sampling.SamplingPipeline`` this pipeline's settings describe (what
        sample.py runs), on the execution device."""
        settings = self.sampling_settings()
        overrides = {"num_steps": num_inference_steps, "cfg_scale": guidance_scale}
        spec = SampleSpec.resolve(overrides, settings["sampler"] or {})
        vae_section = settings["vae"] or {}  # the run's normalisation, exact (else the VAE's)
        norm = LatentNorm.from_section(vae_section) if "scaling_factor" in vae_section else None
        return SamplingPipeline.for_components(
            self.transformer, create_objective(settings["transport"] or {}), spec, self.vae,
            self._execution_device, norm)

    @torch.no_grad()
    def __call__(
        self, class_labels: int | str | Sequence[int | str] | Tensor,
        num_inference_steps: int | None = None, guidance_scale: float | None = None,
        generator: int | torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil", return_dict: bool = True, batch_size: int = 32,
    ) -> ImagePipelineOutput | tuple:
        """Images of ``class_labels`` (one image per label: class ids, or label names when the
        pipeline has ``id2label``).

        ``num_inference_steps`` / ``guidance_scale``: override the scheduler's ``num_steps`` (ODE:
        grid points; DDPM / DDIM: steps) / ``cfg_scale`` (None = the exported defaults).
        ``generator``: a list of ``torch.Generator`` (one per image: its noise, as in diffusers); an
        int is ``sample.py``'s ``--seed`` (image i is sample i of that seed: identical pixels); a
        ``torch.Generator`` draws such a seed; None = random. ``output_type``: "pil" (PIL images),
        "np" (float32 array (N, H, W, C) in [0, 1]), "pt" (float tensor (N, C, H, W) in [0, 1]),
        as diffusers returns them, or "uint8" (uint8 array (N, H, W, C): the pixels sample.py
        writes, which "pil" holds too). The progress bar ticks once per model evaluation.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; valid: {', '.join(OUTPUT_TYPES)}")
        labels = class_ids(class_labels, self.labels, self.transformer.num_classes)
        gens = self._generators(generator, len(labels))
        pipe = self.sampling_pipeline(num_inference_steps, guidance_scale)
        steps = None  # our whole-trajectory sampler, or a swapped-in diffusers scheduler's steps
        if not isinstance(self.scheduler, SiTScheduler):
            steps = pipe.steps(self.scheduler)
        starts = range(0, len(labels), batch_size)
        per_batch = pipe.objective.evaluations(pipe.spec) if steps is None else len(steps.timesteps)
        total = float("inf") if per_batch is None else per_batch * len(starts)  # inf: unknown
        with self.progress_bar(total=total) as bar:
            batches = [pipe.generate(range(lo, min(lo + batch_size, len(labels))), 0,
                                     labels[lo : lo + batch_size],
                                     generators=gens[lo : lo + batch_size],
                                     steps=steps, tick=bar.update) for lo in starts]
        pixels = torch.cat([b.pixels for b in batches])
        if output_type in ("np", "pt"):
            images: Any = (pixels / 2 + 0.5).clamp(0, 1)  # diffusers' postprocessing
            if output_type == "np":
                images = images.permute(0, 2, 3, 1).numpy()
        else:
            images = np.concatenate([b.images for b in batches])
            if output_type == "pil":
                images = [Image.fromarray(im[..., 0] if im.shape[2] == 1 else im) for im in images]
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    # ------------------------------------------------------------------ saving and loading

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        """diffusers' ``save_pretrained``, plus what diffusers' generic loader needs:
        ``pipeline.py`` (imports this class) named in ``model_index.json``'s ``_class_name``. A
        swapped-in diffusers scheduler also records the sampling settings."""
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in ("commit_message", "private", "create_pr", "token",
                                          "repo_id") if k in kwargs}
        if not self._own_settings():
            self.scheduler.register_to_config(**self._settings)
        super().save_pretrained(save_directory, *args, **kwargs)
        write_loader(save_directory, self.config_name, type(self).__name__)
        if push:
            self.push_to_hub(hub.pop("repo_id", Path(save_directory).name), **hub)

    @classmethod
    def _dict_from_json_file(cls, json_file: str | Path) -> dict[str, Any]:
        # our own class needs no code from the folder: read the loader entry as the plain name
        config = super()._dict_from_json_file(json_file)
        if config.get("_class_name") == loader_entry(cls.__name__):
            config["_class_name"] = cls.__name__
        return config
