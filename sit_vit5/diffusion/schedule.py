"""Noise schedules and timestep respacing of the discrete Gaussian diffusion (IDDPM / ADM / DiT).

Conventions (Ho et al. 2020; Nichol & Dhariwal 2021): ``T`` steps indexed ``t = 0 .. T-1``; step
``t`` adds noise with variance ``betas[t]``; ``alphas_cumprod[t] = prod_{s<=t} (1 - betas[s])``. t =
T-1 is (almost) pure noise, t = 0 is data plus the smallest noise. """

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

#: the DDPM linear schedule is defined for 1000 steps; other step counts scale both ends by 1000 / T
LINEAR_BETA_START, LINEAR_BETA_END, LINEAR_REFERENCE_STEPS = 1e-4, 0.02, 1000
#: IDDPM cosine schedule: offset s = 0.008 and betas capped at 0.999 (Nichol & Dhariwal 2021, eq.
#: 17)
COSINE_OFFSET, COSINE_MAX_BETA = 0.008, 0.999


def linear_betas(num_steps: int) -> Tensor:
    """DDPM's linear betas from 1e-4 to 0.02, both scaled by ``1000 / num_steps``; float64
    ``(T,)``."""
    scale = LINEAR_REFERENCE_STEPS / num_steps
    return torch.linspace(  # on cpu: a float64 schedule table, moved by its user
        scale * LINEAR_BETA_START, scale * LINEAR_BETA_END, num_steps, dtype=torch.float64
    )


def cosine_betas(num_steps: int) -> Tensor:
    """IDDPM's cosine schedule: ``alpha_bar(u) = cos((u + s) / (1 + s) * pi / 2)^2`` on ``u = t /
    T``, ``beta_t = min(1 - alpha_bar((t+1)/T) / alpha_bar(t/T), 0.999)``; float64 ``(T,)``."""

    def alpha_bar(u: float) -> float:
        return math.cos((u + COSINE_OFFSET) / (1 + COSINE_OFFSET) * math.pi / 2) ** 2

    betas = [
        min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), COSINE_MAX_BETA)
        for i in range(num_steps)
    ]
    return torch.tensor(betas, dtype=torch.float64)  # on cpu: a table, moved by its user


#: DiT/IDDPM names (``squaredcos_cap_v2`` is the cosine schedule's name in DiT's code)
NOISE_SCHEDULES = {
    "linear": linear_betas, "cosine": cosine_betas, "squaredcos_cap_v2": cosine_betas,
}


def named_betas(name: str, num_steps: int) -> Tensor:
    """Betas ``(num_steps,)`` float64 of the schedule ``name`` (see ``NOISE_SCHEDULES``)."""
    if name not in NOISE_SCHEDULES:
        raise ValueError(
            f"unknown noise_schedule {name!r}; valid options: "
            f"{', '.join(map(repr, NOISE_SCHEDULES))}"
        )
    if num_steps < 1:
        raise ValueError(f"diffusion_steps must be >= 1, got {num_steps}")
    betas = NOISE_SCHEDULES[name](num_steps)
    if float(betas.max()) >= 1.0:
        raise ValueError(
            f"noise_schedule {name!r} with diffusion_steps={num_steps} gives betas up to "
            f"{float(betas.max()):.3g} (must be < 1); use more steps"
        )
    return betas


def space_timesteps(num_timesteps: int, section_counts: str | Iterable[int]) -> list[int]:
    """The original steps kept when a ``num_timesteps`` process is respaced (IDDPM section 4),
    sorted.

    ``section_counts`` is either ``"ddimN"`` -- an even integer stride from 0 giving exactly N steps
    (as in DDIM) -- or section counts (``"250"``, ``"10,15,20"``, ``[10, 15, 20]``): the steps are
    cut into that many equal sections (the first ``T % k`` one step longer) and each section keeps
    its count of steps evenly spread over it, both ends included (positions rounded as Python's
    ``round`` does). """
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            wanted = _parse_int(section_counts[len("ddim") :], section_counts)
            for stride in range(1, num_timesteps):
                if len(range(0, num_timesteps, stride)) == wanted:
                    return list(range(0, num_timesteps, stride))
            raise ValueError(
                f"timestep_respacing {section_counts!r}: no integer stride gives exactly {wanted} "
                f"of {num_timesteps} steps"
            )
        section_counts = [_parse_int(part, section_counts) for part in section_counts.split(",")]
    counts = list(section_counts)
    if not counts:
        raise ValueError("timestep_respacing: no section counts given")
    size_per, extra = divmod(num_timesteps, len(counts))
    kept, start = [], 0
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(
                f"timestep_respacing: section {i} has {size} steps, cannot keep {count}"
            )
        stride = 1.0 if count <= 1 else (size - 1) / (count - 1)
        position = 0.0
        for _ in range(count):
            kept.append(start + round(position))
            position += stride  # accumulated, not k * stride: the published step lists depend on it
        start += size
    return sorted(set(kept))


def _parse_int(text: str, whole: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"timestep_respacing {whole!r}: expected 'ddimN' or comma-separated integers"
        ) from None


def respace_betas(betas: Tensor, use_timesteps: Iterable[int]) -> tuple[Tensor, list[int]]:
    """Betas of the process that visits only ``use_timesteps`` of ``betas``' process, and the kept
    steps.

    The new betas are chosen so ``alpha_bar`` is unchanged at every kept step:
    ``beta'_k = 1 - alpha_bar[s_k] / alpha_bar[s_{k-1}]`` (``alpha_bar[s_{-1}] = 1``). Returns
    ``(new_betas (K,) float64, timestep_map)`` where ``timestep_map[k]`` is the original step index.
    """
    keep = sorted(set(int(s) for s in use_timesteps))
    if not keep or keep[0] < 0 or keep[-1] >= len(betas):
        raise ValueError(
            f"timesteps to keep must lie in [0, {len(betas) - 1}], got {keep[:3]}...{keep[-3:]}"
        )
    alphas_cumprod = torch.cumprod(1.0 - betas.to(torch.float64), dim=0)
    kept = alphas_cumprod[keep]
    previous = torch.cat([kept.new_ones(1), kept[:-1]])
    return 1.0 - kept / previous, keep
