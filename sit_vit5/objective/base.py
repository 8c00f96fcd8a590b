"""The objective interface: what training and sampling ask of an objective (loss, samplers per
``SampleSpec``, model evaluations), and the whole-trajectory wrappers the samplers return."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ..sample_spec import SAMPLE_METHODS, SampleSpec
from ..stepwise import Steps, denoise
from ..transport.rng import GeneratorLike, resolve_generator
from ..utils.errors import SettingError

if TYPE_CHECKING:
    from ..diffusion import DiffusionSampler
    from ..transport import Sampler



def method_conflict(objective: str) -> str:
    """The one wording of "this method cannot sample this objective" (a SettingError reason)."""
    return (f" cannot sample a model trained with the {objective} objective; valid: "
            f"{', '.join(SAMPLE_METHODS[objective])}")


@dataclass(frozen=True)
class BuiltSampler:
    """A whole-trajectory sampler: ``sample(z, model_fn, *, generator=None, **model_kwargs)``
    returns the trajectory ``[x]`` (final sample last, ``(B, C, H, W)``); ``sampler.last_nfe`` is
    the latest call's model evaluations."""

    sample: Callable[..., list[Tensor]]
    sampler: Sampler | DiffusionSampler | StepsSampler


class StepsSampler:
    """Whole trajectories of step-wise ``steps`` (:func:`denoise`), shaped like
    :class:`~sit_vit5.diffusion.DiffusionSampler`: :meth:`build` returns ``fn(z, model_fn, *,
    generator=None, **model_kwargs) -> [x]``; ``last_nfe`` counts the latest call's evaluations."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.last_nfe: int | None = None

    def build(self) -> Callable[..., list[Tensor]]:
        def _sample(z: Tensor, model_fn: Callable[..., Tensor], *,
                    generator: GeneratorLike = None, **model_kwargs: Any) -> list[Tensor]:
            gen = resolve_generator(generator, len(z))  # once: each stream advances along the way
            with torch.no_grad():
                x = denoise(self.steps, z, model_fn, gen, **model_kwargs)
            self.last_nfe = len(self.steps.timesteps)
            return [x]

        return _sample


class Objective(ABC):
    """A training objective: the loss, samplers per ``SampleSpec`` (whole or step-wise) and the
    model evaluations a spec costs."""

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]]  # the ``transport`` keys it reads (besides ``objective``)
    #: whether its model takes a second time (``model.interval_embed``: MeanFlow's r - t)
    interval: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, cfg_transport: Mapping[str, Any]) -> Objective:
        """The objective of a (validated) ``transport`` config section."""

    @classmethod
    def config_problems(cls, cfg_transport: Mapping[str, Any], learn_sigma: bool) -> list[str]:
        """What is wrong with its ``transport`` keys for a model with or without ``learn_sigma``
        (one string per problem, naming the key; [] = nothing)."""
        return []

    @property
    def methods(self) -> tuple[str, ...]:
        """The ``sample.method`` values that sample this objective (the first is the default)."""
        return SAMPLE_METHODS[self.name]

    @abstractmethod
    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        """Per-sample loss ``(B,)`` for data ``x`` ``(B, C, H, W)`` and labels ``y`` ``(B,)``;
        t and the noise come from the global RNG, drawn in the order SiT / DiT draw them."""

    def evaluations(self, spec: SampleSpec) -> int | None:
        """Model evaluations per batch of the whole-trajectory sampler (None: adaptive):
        ``spec.nfe``, the one count of the sampler tables."""
        return spec.nfe

    @abstractmethod
    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler: ...

    @abstractmethod
    def _steps(self, spec: SampleSpec, pixel_space: bool, scheduler: Any, device: Any) -> Steps: ...

    def check_method(self, spec: SampleSpec) -> None:
        """Raise SettingError naming ``method`` when ``spec`` cannot sample this objective."""
        if spec.method not in self.methods:
            raise SettingError("method", spec.method, method_conflict(self.name))

    def sampler(self, spec: SampleSpec, *, pixel_space: bool = False) -> BuiltSampler:
        """``spec``'s whole-trajectory sampler; ``pixel_space``: the model outputs images."""
        self.check_method(spec)
        return self._sampler(spec, pixel_space)

    def steps(self, spec: SampleSpec, *, pixel_space: bool = False, scheduler: Any = None,
              device: torch.device | str | None = None) -> Steps:
        """``spec``'s sampler one step at a time: ours, or a diffusers ``scheduler``'s (set up for
        ``spec.num_steps``). SettingError when this objective cannot be sampled so."""
        self.check_method(spec)
        if scheduler is not None and not (callable(getattr(scheduler, "set_timesteps", None))
                                          and callable(getattr(scheduler, "step", None))):
            raise SettingError("scheduler", type(scheduler).__name__,
                               ": not a diffusers scheduler (needs set_timesteps / step)")
        return self._steps(spec, pixel_space, scheduler, device)
