"""The diffusers / Hugging Face Hub integration: ``SiTPipeline`` and its parts, one idea a module.

* :mod:`.scheduler`: ``SiTScheduler`` (how to sample; step-wise ODE Euler, DDPM, DDIM).
* :mod:`.adapters`: diffusers' own schedulers (FlowMatchEuler, DDPM, DDIM) on our models.
* :mod:`.labels`: class-label names (``id2label``) and ``class_labels`` arguments.
* :mod:`.progress`: the progress bar's count of model evaluations.
* :mod:`.loader`: the ``pipeline.py`` that ``save_pretrained`` writes for diffusers' loader.
* :mod:`.pipeline`: ``SiTPipeline`` itself.

``sit_vit5.pipeline`` re-exports these names: exported folders import ``SiTPipeline`` from there.
"""

from .adapters import diffusers_scheduler
from .labels import IMAGENET_CLASSES, imagenet_id2label, read_id2label
from .loader import LOADER_FILE, LOADER_SOURCE, STABLE_MODULE
from .pipeline import OUTPUT_TYPES, SiTPipeline
from .progress import evaluations
from .scheduler import SETTINGS, SiTScheduler, scheduler_from

__all__ = [
    "IMAGENET_CLASSES",
    "LOADER_FILE",
    "LOADER_SOURCE",
    "OUTPUT_TYPES",
    "SETTINGS",
    "STABLE_MODULE",
    "SiTPipeline",
    "SiTScheduler",
    "diffusers_scheduler",
    "evaluations",
    "imagenet_id2label",
    "read_id2label",
    "scheduler_from",
]
