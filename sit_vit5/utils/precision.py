"""Numeric precisions of forward passes: ``fp32`` (no autocast), ``bf16`` / ``fp16`` (autocast;
parameters, optimizer, EMA and integrator state stay fp32). fp16 training also scales the loss
(its range is too small for small gradients); bf16 needs no scaler.
"""

from __future__ import annotations

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}
#: a model's parameter dtype as a precision name (a pipeline loaded with ``torch_dtype=``)
PRECISION_OF_DTYPE = {dtype or torch.float32: name for name, dtype in PRECISIONS.items()}


def check_precision(precision: str, what: str = "precision") -> str:
    """``precision`` if known, else a ValueError naming ``what`` and the valid names."""
    if precision not in PRECISIONS:
        raise ValueError(f"{what}={precision!r}; valid: {', '.join(PRECISIONS)}")
    return precision


def autocast(device: torch.device | str, precision: str) -> torch.autocast:
    """The autocast context of ``precision`` on ``device`` (cpu, cuda); fp32 turns it off."""
    dtype = PRECISIONS[check_precision(precision)]
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)


def grad_scaler(device: torch.device | str, precision: str) -> torch.amp.GradScaler | None:
    """The loss scaler fp16 training needs on ``device`` (None for fp32 / bf16)."""
    if check_precision(precision) != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)
