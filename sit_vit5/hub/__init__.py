"""The diffusers / Hugging Face Hub integration: ``SiTPipeline`` and its parts, one idea a module.

* :mod:`.scheduler`: ``SiTScheduler`` (how to sample; step-wise: the objective's steps).
* :mod:`.labels`: class-label names (``id2label``) and ``class_labels`` arguments.
* :mod:`.loader`: the ``pipeline.py`` that ``save_pretrained`` writes for diffusers' loader.
* :mod:`.pipeline`: ``SiTPipeline`` itself.

``sit_vit5.pipeline`` re-exports these names: exported folders import ``SiTPipeline`` from there.
"""

from ..diffusion.ddpm_sampler import diffusers_scheduler
from .labels import IMAGENET_CLASSES, imagenet_id2label, read_id2label
from .loader import LOADER_FILE, LOADER_SOURCE, STABLE_MODULE
from .scheduler import SETTINGS, SiTScheduler, scheduler_from
from .sit_pipeline import OUTPUT_TYPES, SiTPipeline

__all__ = [
    "IMAGENET_CLASSES", "LOADER_FILE", "LOADER_SOURCE", "OUTPUT_TYPES", "SETTINGS", "STABLE_MODULE",
    "SiTPipeline", "SiTScheduler", "diffusers_scheduler", "imagenet_id2label", "read_id2label",
    "scheduler_from",
]
