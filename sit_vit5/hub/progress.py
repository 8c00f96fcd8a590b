"""Progress in model evaluations: how many a whole-trajectory sampler makes per batch (the bar's
total) and a model wrapper that ticks the bar once per call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..sample_spec import SampleSpec
from ..transport.integrators import FIXED_STEP_NFE, SDE_STEP_NFE, ode_method


class Ticking:
    """A model function that advances a progress bar (``bar.update()``) once per evaluation."""

    def __init__(self, fn: Callable[..., Tensor], bar: Any) -> None:
        self.fn, self.bar = fn, bar

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        out = self.fn(*args, **kwargs)
        self.bar.update()
        return out


def evaluations(spec: SampleSpec) -> int | None:
    """Model evaluations per batch of the whole-trajectory sampler (None: adaptive solvers)."""
    if spec.method in ("ddpm", "ddim"):
        return spec.num_steps
    steps = spec.num_steps - 1  # num_steps counts grid points, both ends included
    if spec.method == "ode":
        per_step = FIXED_STEP_NFE.get(ode_method(spec.sampling_method))
        return None if per_step is None else steps * per_step
    per_step = SDE_STEP_NFE.get(spec.sampling_method)
    # the SDE's last step (Mean / Tweedie / Euler) evaluates the model once more
    return None if per_step is None else steps * per_step + (spec.last_step is not None)
