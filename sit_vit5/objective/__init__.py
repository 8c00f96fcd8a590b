"""The training objective, from the config's ``transport`` section.

* ``sit`` (default): SiT's transport (:mod:`sit_vit5.transport`); t in [0, 1] (0 = noise),
  samplers ``ode | sde``.
* ``ddpm``: DiT's discrete diffusion, a platform layer (:mod:`sit_vit5.diffusion.objective`),
  imported by :func:`objective_class` only when a config or checkpoint names it.
* ``meanflow``: MeanFlow's average velocity on the linear path (:mod:`.meanflow`), 1-step
  sampling; a platform layer too, imported only when named.

Each is an :class:`Objective`: ``loss``, a whole-trajectory ``sampler``, step-wise ``steps`` and
``evaluations`` per ``SampleSpec``, built ``from_config``. The model returns its full output; the
objective reads what it needs. A new objective is one subclass (its own module) and one line in
:func:`objective_class`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..models.registry import name_objective_conflict
from ..names import OBJECTIVES
from ..sample_spec import SAMPLE_METHODS
from ..transport import Transport
from ..utils.errors import ConfigError
from .base import BuiltSampler, Objective, StepsSampler, method_conflict
from .sit import SiTObjective, transport_kwargs

if TYPE_CHECKING:
    from ..diffusion import GaussianDiffusion

__all__ = [
    "OBJECTIVES", "BuiltSampler", "Objective", "SiTObjective", "StepsSampler",
    "as_objective", "check_objective", "create_objective", "method_conflict", "objective_class",
    "objective_keys", "objective_name", "transport_kwargs",
]


def objective_class(name: str) -> type[Objective]:
    """The :class:`Objective` subclass of ``transport.objective`` ``name`` (in ``OBJECTIVES``)."""
    if name == "ddpm":  # DiT's objective is a platform layer: loaded only when a config names it
        from ..diffusion.objective import DDPMObjective

        return DDPMObjective
    if name == "meanflow":  # MeanFlow: a platform layer too, loaded only when named
        from .meanflow import MeanFlowObjective

        return MeanFlowObjective
    return SiTObjective


def objective_keys(name: str) -> tuple[str, ...]:
    """The ``transport`` section keys objective ``name`` reads (besides ``objective``)."""
    return objective_class(name).keys


def objective_name(cfg_transport: Mapping[str, Any] | None) -> str:
    """``transport.objective`` of a config section; missing means ``sit``."""
    name = (cfg_transport or {}).get("objective") or "sit"
    if name not in OBJECTIVES:
        raise ConfigError(f"transport.objective={name!r}; valid: {', '.join(OBJECTIVES)}")
    return name


def check_objective(cfg_transport: Mapping[str, Any], *, learn_sigma: bool,
                    model_name: str | None = None, sample_method: str | None = None,
                    interval_embed: bool | None = None) -> str:
    """Validate the objective against the model and sampler; returns its name. Raises
    ConfigError naming every contradiction at once. ``interval_embed``: the model's
    second-time embedding (None: not checked), which exactly the objectives with ``interval``
    use."""
    name = objective_name(cfg_transport)
    problems: list[str] = []
    wanted = objective_class(name).interval
    if interval_embed is not None and bool(interval_embed) != wanted:
        problems.append(f"model.interval_embed={str(bool(interval_embed)).lower()}: the {name} "
                        f"objective needs model.interval_embed={str(wanted).lower()} "
                        + ("(the interval r - t of its average velocity)" if wanted else
                           "(it has no second time: no extra parameters)"))
    conflict = name_objective_conflict(model_name, name) if model_name else None
    if conflict:
        problems.append(f"model.name={model_name!r}: {conflict}")
    if sample_method is not None and sample_method not in SAMPLE_METHODS[name]:
        problems.append(f"sample.method={sample_method!r}{method_conflict(name)}")
    problems += objective_class(name).config_problems(cfg_transport, learn_sigma)
    if problems:
        raise ConfigError("; ".join(problems))
    return name


def create_objective(cfg_transport: Mapping[str, Any]) -> Objective:
    """The objective of a ``transport`` section: SiT's transport or DiT's full-step diffusion."""
    return objective_class(objective_name(cfg_transport)).from_config(cfg_transport)


def as_objective(objective: Objective | Transport | GaussianDiffusion) -> Objective:
    """An :class:`Objective` from itself or the SiT Transport / DiT GaussianDiffusion it wraps."""
    if isinstance(objective, Objective):
        return objective
    if isinstance(objective, Transport):
        return SiTObjective(objective)
    return objective_class("ddpm")(objective)


def __getattr__(name: str) -> Any:
    """DiT's objective moved to :mod:`sit_vit5.diffusion.objective`; its names resolve here."""
    if name in ("DDPMObjective", "DDPM_KEYS", "DDPM_VARIANCES", "ddpm_settings", "create_ddpm"):
        from ..diffusion import objective as ddpm

        return getattr(ddpm, name)
    if name == "DDPM_DEFAULTS":
        from ..names import DDPM_DEFAULTS

        return DDPM_DEFAULTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
