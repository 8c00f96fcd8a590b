"""DiT's objective: discrete Gaussian diffusion (DDPM / IDDPM / ADM), DiT-compatible API.

``create_diffusion("250")`` -> :class:`GaussianDiffusion` with ``training_losses``,
``p_sample_loop``, ``ddim_sample_loop`` and ``num_timesteps``. Time convention (DiT, the opposite of
the transport's): integer steps, t = 0 is data, t = T-1 is noise; the network receives original step
numbers 0 .. 999. """

from .ddpm_sampler import (
    DiffusionSampler,
    DiffusionSteps,
    SchedulerSteps,
    diffusers_scheduler,
    respaced,
)
from .gaussian_diffusion import (
    LOSS_TYPES,
    MEAN_TYPES,
    METHODS,
    VAR_TYPES,
    GaussianDiffusion,
    create_diffusion,
)
from .losses import approx_standard_normal_cdf, discretized_gaussian_log_likelihood, normal_kl
from .schedule import NOISE_SCHEDULES, named_betas, respace_betas, space_timesteps

__all__ = [
    "LOSS_TYPES", "MEAN_TYPES", "METHODS", "NOISE_SCHEDULES", "SchedulerSteps", "VAR_TYPES",
    "DiffusionSampler", "DiffusionSteps", "GaussianDiffusion", "approx_standard_normal_cdf",
    "create_diffusion", "diffusers_scheduler", "discretized_gaussian_log_likelihood", "named_betas",
    "normal_kl", "respace_betas", "respaced", "space_timesteps",
]
