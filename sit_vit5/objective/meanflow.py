"""MeanFlow (Geng et al. 2025, arXiv 2505.13447) as an :class:`Objective`: one-step generation.

The network predicts the average velocity ``u(z_t, t, r) = 1/(r - t) ∫_t^r v(z_τ, τ) dτ`` over
[t, r] on SiT's linear path (``z_t = t·x + (1 - t)·ε``, ``v = x - ε``, t = 0 noise: DESIGN.md §4),
through a backbone built with ``interval_embed`` (the interval ``h = r - t`` is its second time).
Training target (the MeanFlow identity, eq. 6): ``u_tgt = v - (t - r)·du/dt`` with ``du/dt =
v·∂_z u + ∂_t u``, one forward-mode product (``torch.func.jvp``) with tangents (v, 1, 0) on
(z, t, r), detached (``tangent: predicted`` moves z along the model's own velocity instead, as
improved MeanFlow does). The identity reads the same in both time conventions (t -> 1 - t flips the
signs of v, u, du/dt's factor and t - r together), so the one conversion is the time draw
(:meth:`MeanFlowObjective.sample_times`). Sampling: ``num_steps`` equal jumps ``z_r = z_t +
(r - t)·u(z_t, t, r)`` from t = 0 to 1 (one step: ``x = ε + u(ε, 0, 1)``).

The core imports this module only when a config or checkpoint names ``transport.objective:
meanflow`` (a platform layer, as DiT's objective). Settings:
:data:`~sit_vit5.names.MEANFLOW_DEFAULTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..names import MEANFLOW_DEFAULTS, MEANFLOW_METHODS, MEANFLOW_TANGENTS
from ..sample_spec import SampleSpec
from ..stepwise import Steps
from ..transport.rng import GeneratorLike
from ..utils.errors import SettingError
from .base import BuiltSampler, Objective, StepsSampler

#: transport-section keys the meanflow objective reads
MEANFLOW_KEYS: tuple[str, ...] = tuple(MEANFLOW_DEFAULTS)
METHODS = MEANFLOW_METHODS


@dataclass(frozen=True)
class MeanFlowSettings:
    """MeanFlow's training settings (defaults: :data:`~sit_vit5.names.MEANFLOW_DEFAULTS`, the
    official ImageNet setting).

    ``time_mean`` / ``time_std``: logit-normal of each time, drawn in MeanFlow's convention (t = 1
    noise); ``r_mean`` / ``r_std``: the second draw's own (None: the same as the first);
    ``ratio``: fraction of pairs with r != t; ``norm_p`` / ``norm_c``: adaptive weight
    ``1 / (error + c)^p`` of the per-sample squared error (summed over C·H·W); ``omega`` /
    ``kappa``: guidance folded into the target, ``v_g = ω·v + κ·u(z, t, t | y) + (1 - ω - κ)·u(z,
    t, t | ∅)`` (ω = 1, κ = 0: none); ``class_dropout``: labels the objective drops (their target
    is the unguided v); ``tangent``: what the JVP moves z along, ``conditional`` (the sample's v_g,
    MeanFlow) or ``predicted`` (the model's own velocity mixed the same way, no gradient: iMF)."""

    time_mean: float = MEANFLOW_DEFAULTS["meanflow_time_mean"]
    time_std: float = MEANFLOW_DEFAULTS["meanflow_time_std"]
    r_mean: float | None = MEANFLOW_DEFAULTS["meanflow_r_mean"]
    r_std: float | None = MEANFLOW_DEFAULTS["meanflow_r_std"]
    ratio: float = MEANFLOW_DEFAULTS["meanflow_ratio"]
    norm_p: float = MEANFLOW_DEFAULTS["meanflow_norm_p"]
    norm_c: float = MEANFLOW_DEFAULTS["meanflow_norm_c"]
    omega: float = MEANFLOW_DEFAULTS["meanflow_omega"]
    kappa: float = MEANFLOW_DEFAULTS["meanflow_kappa"]
    class_dropout: float = MEANFLOW_DEFAULTS["meanflow_class_dropout"]
    tangent: str = MEANFLOW_DEFAULTS["meanflow_tangent"]

    def __post_init__(self) -> None:
        if self.tangent not in MEANFLOW_TANGENTS:  # configs are checked on load; this is direct use
            valid = ", ".join(MEANFLOW_TANGENTS)
            raise SettingError("meanflow_tangent", self.tangent, f"; valid: {valid}")

    @classmethod
    def from_section(cls, cfg_transport: Mapping[str, Any]) -> MeanFlowSettings:
        """The settings of a transport section (missing or None keys: the defaults)."""
        given = {k.removeprefix("meanflow_"): cfg_transport[k] for k in MEANFLOW_KEYS
                 if cfg_transport.get(k) is not None}
        return cls(**given)

    @property
    def guided(self) -> bool:
        """Whether the target mixes in the model's own conditional / unconditional velocity."""
        return self.omega != 1.0 or self.kappa != 0.0


def _unwrapped(model: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The module behind DDP (``.module``) and torch.compile (``._orig_mod``) wrappers, or
    ``model`` itself. DDP's forward cannot run under ``torch.func.jvp`` ("Cannot access data
    pointer of Tensor that doesn't have storage", measured with 2 gloo processes), so the product
    runs on this module and the gradient through the wrapper."""
    for _ in range(3):
        inner = getattr(model, "module", None)
        inner = getattr(model, "_orig_mod", None) if inner is None else inner
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def _grad_checkpointing(model: Callable[..., Tensor]) -> bool:
    """Whether ``model`` recomputes its blocks in the backward: torch.utils.checkpoint's
    recompute cannot replay a forward-mode pass."""
    return bool(getattr(model, "grad_checkpointing", False) and getattr(model, "training", False))


class MeanFlowSteps:
    """MeanFlow's sampler as :class:`~sit_vit5.stepwise.Steps`: ``num_steps`` equal jumps from
    t = 0 (noise) to 1, ``x += h·u(x, t, h)`` with h = 1 / num_steps; one evaluation a jump."""

    init_noise_sigma = 1.0

    def __init__(self, num_steps: int, device: Any = None) -> None:
        self.num_steps = num_steps
        self.h = 1.0 / num_steps
        self.timesteps = torch.arange(num_steps, dtype=torch.float64, device=device) / num_steps

    def restart(self) -> None:
        """Nothing to reset: the jumps keep no state."""

    def model_input(self, x: Tensor, t: Tensor) -> Tensor:
        return x

    def model_time(self, t: Tensor, x: Tensor) -> Tensor:
        return t.to(device=x.device, dtype=x.dtype).expand(len(x))  # (B,)

    def model_kwargs(self, t: Tensor) -> dict[str, Any]:
        """The interval of the jump at ``t`` (a number: the model broadcasts it, CFG's doubled
        batch included)."""
        return {"interval": self.h}

    def step(self, model_output: Tensor, t: Tensor, x: Tensor, generator: Any = None) -> Tensor:
        u = model_output[:, : x.shape[1]]  # (B, C, H, W) average velocity over [t, t + h]
        return x + self.h * u.to(x.dtype)


class MeanFlowObjective(Objective):
    """MeanFlow on the linear path: the loss above, and 1- or k-step sampling (method
    ``meanflow``, NFE = num_steps)."""

    name = "meanflow"
    keys = MEANFLOW_KEYS
    interval = True

    def __init__(self, settings: MeanFlowSettings | None = None) -> None:
        self.settings = settings or MeanFlowSettings()

    @classmethod
    def from_config(cls, cfg_transport: Mapping[str, Any]) -> MeanFlowObjective:
        return cls(MeanFlowSettings.from_section(cfg_transport))

    @classmethod
    def config_problems(cls, cfg_transport: Mapping[str, Any], learn_sigma: bool) -> list[str]:
        problems = []
        if learn_sigma:
            problems.append("model.learn_sigma=true: the meanflow objective uses C output "
                            "channels (no variance half); set model.learn_sigma=false")
        path = cfg_transport.get("path_type") or "Linear"
        prediction = cfg_transport.get("prediction") or "velocity"
        if path != "Linear" or prediction != "velocity":
            problems.append(f"transport.path_type={path} / prediction={prediction}: the meanflow "
                            "objective runs on the Linear path with velocity output")
        return problems

    def __repr__(self) -> str:
        return f"MeanFlowObjective({self.settings})"

    # ------------------------------------------------------------------------------- training

    def sample_times(self, n: int, device: Any = None,
                     generator: GeneratorLike = None) -> tuple[Tensor, Tensor]:
        """(t, r), each (n,), t <= r, in OUR convention (t = 0 noise): two logit-normal draws (the
        second with r's mean and std where set), ordered, then r = t for a fraction 1 - ratio of
        the pairs (py-meanflow's sampler v0)."""
        s = self.settings
        gen = generator if isinstance(generator, torch.Generator) else None
        r_mean = s.time_mean if s.r_mean is None else s.r_mean
        r_std = s.time_std if s.r_std is None else s.r_std
        # on cpu: drawn there (the global or given CPU generator), moved to `device` at the end
        a = torch.sigmoid(torch.randn(n, generator=gen) * s.time_std + s.time_mean)  # on cpu: above
        b = torch.sigmoid(torch.randn(n, generator=gen) * r_std + r_mean)  # on cpu: above
        t_mf, r_mf = torch.maximum(a, b), torch.minimum(a, b)  # MeanFlow's order: r <= t
        r_mf = torch.where(torch.rand(n, generator=gen) < s.ratio, r_mf, t_mf)  # on cpu: above
        # MeanFlow writes t = 1 for noise (arXiv 2505.13447 §3); ours t = 0 (DESIGN.md §4, §10)
        t, r = 1.0 - t_mf, 1.0 - r_mf
        return t.to(device), r.to(device)

    def loss(self, model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
        n = len(x)
        t, r = self.sample_times(n, x.device)  # times first, then the noise, then the labels
        noise = torch.randn_like(x)
        drop = torch.rand(n, device=x.device) < self.settings.class_dropout
        return self.losses_at(model, x, y, t, r, noise, drop)["loss"]

    def guided_velocity(self, model: Callable[..., Tensor], z: Tensor, t: Tensor, y: Tensor,
                        v: Tensor, drop: Tensor) -> Tensor:
        """The target's velocity (B, C, H, W): ``v`` with the guidance mixed in (the model's own
        instantaneous velocities, no gradient) except where the label is dropped."""
        s = self.settings
        if not s.guided:
            return v
        c = z.shape[1]
        with torch.no_grad():
            kinds = [torch.ones_like(drop, dtype=torch.long)]  # 1: the null label
            if s.kappa != 0.0:
                kinds.append(torch.zeros_like(drop, dtype=torch.long))
            reps = len(kinds)
            out = model(z.repeat(reps, 1, 1, 1), t.repeat(reps), y.repeat(reps),
                        force_drop_ids=torch.cat(kinds))[:, :c].to(v.dtype)
            parts = out.chunk(reps)
            v_g = s.omega * v + (1.0 - s.omega - s.kappa) * parts[0]
            if s.kappa != 0.0:
                v_g = v_g + s.kappa * parts[1]
        return torch.where(drop.view(-1, 1, 1, 1), v, v_g)

    def tangent(self, model: Callable[..., Tensor], z: Tensor, t: Tensor, y: Tensor, v: Tensor,
                v_g: Tensor, drop: Tensor) -> Tensor:
        """dz/dt for the JVP (B, C, H, W): the target's own ``v_g``, or (``predicted``) the model's
        instantaneous velocity u(z, t, t) in the place of ``v``, guided the same way, without
        gradient. For an exact model the second is the mean of the first given z: the target keeps
        its mean and loses the noise of x - ε in the JVP term (improved MeanFlow, arXiv 2512.02012
        §4). One no-grad forward of the batch: the guidance's own velocities are v_g's."""
        if self.settings.tangent == "conditional":
            return v_g
        with torch.no_grad():  # a dropped label: the unconditional velocity (v_g keeps plain v)
            v_hat = model(z, t, y, force_drop_ids=drop.long())[:, : z.shape[1]].to(v_g.dtype)
        if not self.settings.guided:  # v_g is v
            return v_hat
        # v_g is linear in v, with weight ω where the label is kept and 1 where it is dropped
        weight = torch.where(drop, 1.0, self.settings.omega).to(v_g.dtype).view(-1, 1, 1, 1)
        return v_g + weight * (v_hat - v)

    def losses_at(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, t: Tensor, r: Tensor,
                  noise: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        """The loss at given draws: data ``x`` (B, C, H, W), labels ``y`` (B,), times ``t <= r``
        (B,) in our convention, ``noise`` like x, ``drop`` (B,) bool (None: none dropped).
        Returns ``{"loss": (B,), "u": the prediction, "target": u_tgt, "error": (B,) squared error
        summed over C·H·W}``."""
        s = self.settings
        drop = torch.zeros(len(x), dtype=torch.bool, device=x.device) if drop is None else drop
        tx = t.view(-1, 1, 1, 1).to(x.dtype)
        z = tx * x + (1.0 - tx) * noise  # DESIGN.md §4: Linear path
        v = x - noise
        v_g = self.guided_velocity(model, z, t, y, v, drop)
        c = x.shape[1]
        ids = drop.long()

        def u_fn(z_: Tensor, t_: Tensor, r_: Tensor) -> Tensor:
            return model(z_, t_, y, interval=r_ - t_, force_drop_ids=ids)[:, :c]

        def bare_u(z_: Tensor, t_: Tensor, r_: Tensor) -> Tensor:
            return inner(z_, t_, y, interval=r_ - t_, force_drop_ids=ids)[:, :c]

        # du/dt along the trajectory: dz/dt = v_g (or the model's), dt/dt = 1, dr/dt = 0 (eq. 8)
        dzdt = self.tangent(model, z, t, y, v, v_g, drop)
        tangents = (dzdt, torch.ones_like(t), torch.zeros_like(r))
        inner = _unwrapped(model)
        if inner is not model or _grad_checkpointing(inner):  # two passes: the product without a
            with torch.no_grad():  # graph on the bare module, then the prediction by a plain
                dudt = torch.func.jvp(bare_u, (z, t, r), tangents)[1]  # forward of the wrapper
            u = u_fn(z, t, r)
        else:  # one pass (as the official code): the primal keeps its graph for the backward
            u, dudt = torch.func.jvp(u_fn, (z, t, r), tangents)
        h = (r - t).view(-1, 1, 1, 1)
        acc = torch.promote_types(u.dtype, torch.float32)  # bf16 autocast: the loss in fp32
        target = (v_g.to(acc) + h.to(acc) * dudt.to(acc)).detach()  # u = v - (t - r) du/dt (eq. 6)
        error = (u.to(acc) - target).pow(2).flatten(1).sum(1)  # (B,)
        weight = (error.detach() + s.norm_c).pow(s.norm_p)  # adaptive weight (§4.3), p = 0: none
        return {"loss": error / weight, "u": u, "target": target, "error": error.detach()}

    # ------------------------------------------------------------------------------- sampling

    def _sampler(self, spec: SampleSpec, pixel_space: bool) -> BuiltSampler:
        sampler = StepsSampler(MeanFlowSteps(spec.num_steps))
        return BuiltSampler(sampler.build(), sampler)

    def _steps(self, spec: SampleSpec, pixel_space: bool, scheduler: Any, device: Any) -> Steps:
        if scheduler is not None:
            raise SettingError("scheduler", type(scheduler).__name__,
                               ": cannot sample a model trained with the meanflow objective; its "
                               "own jumps (method meanflow) are the sampler")
        return MeanFlowSteps(spec.num_steps, device=device)
