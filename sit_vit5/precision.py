"""Numeric precisions of model forward passes: the names the configs and CLIs accept, and their
autocast.

``fp32``: no autocast. ``bf16``: the forward runs under bf16 autocast; parameters, optimizer state,
EMA and the sampler's integrator state stay fp32.
"""

from __future__ import annotations

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def check_precision(precision: str, what: str = "precision") -> str:
    """``precision`` if it is a known name, else a ValueError naming ``what`` and the valid names.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"{what}={precision!r}; valid: {', '.join(PRECISIONS)}")
    return precision


def autocast(device: torch.device | str, precision: str) -> torch.autocast:
    """The autocast context of ``precision`` on ``device`` (its type: cpu, cuda); fp32 turns it off.
    """
    dtype = PRECISIONS[check_precision(precision)]
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)
