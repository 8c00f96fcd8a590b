"""Transport: interpolation paths, training losses and samplers (SiT-compatible API).

``create_transport(...)`` -> :class:`Transport` (``training_losses``, ``path_sampler``);
``Sampler(transport)`` -> ``sample_ode`` / ``sample_sde`` / ``sample_ode_likelihood``.
Time convention as SiT: t = 0 is noise, t = 1 is data.
"""

from sit_vit5.guidance import ClassifierFreeGuidance

from .likelihood import bits_per_dim
from .paths import DIFFUSION_FORMS, PATHS, GVPPath, LinearPath, Path, VPPath
from .sampler import LAST_STEPS, Sampler
from .transport import (
    LOSS_WEIGHTS,
    PREDICTIONS,
    TRANSPORT_KEYS,
    Transport,
    create_transport,
    default_eps,
)

__all__ = [
    "DIFFUSION_FORMS", "LAST_STEPS", "LOSS_WEIGHTS", "PATHS", "PREDICTIONS", "TRANSPORT_KEYS",
    "ClassifierFreeGuidance", "GVPPath", "LinearPath", "Path", "Sampler", "Transport", "VPPath",
    "bits_per_dim", "create_transport", "default_eps",
]
