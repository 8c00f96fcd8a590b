"""The import path exported folders name: their ``pipeline.py`` runs ``from sit_vit5.pipeline
import SiTPipeline`` and their ``model_index.json`` has ``"scheduler": ["sit_vit5.pipeline",
"SiTScheduler"]`` (see :mod:`sit_vit5.hub.loader`), so this module stays. The code lives in
:mod:`sit_vit5.hub`, one idea a module; every name importable here before the split still is
(``sit_vit5.hub.__all__``)."""

# diffusers loads a ["sit_vit5.pipeline", "SiTScheduler"] entry by testing the class against
# getattr(sit_vit5.pipeline, "SchedulerMixin"): the base class must be found here
from diffusers import SchedulerMixin

from .hub import *  # noqa: F403  (a re-export: the one list of names is the hub's __all__)
from .hub import __all__ as _hub_names

__all__ = [*_hub_names, "SchedulerMixin"]
