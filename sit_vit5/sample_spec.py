"""``SampleSpec``: every sampler option (integration and guidance), its default, help and range.

The config's ``sample`` keys (:func:`config_defaults`) and sample.py's flags
(:mod:`sit_vit5.cli.sample_flags`) derive from its fields. A bad value raises SettingError naming
the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .names import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DIFFUSION_FORMS,
    DIFFUSION_METHODS,
    DIFFUSION_SOLVERS,
    FLOW_SOLVERS,
    LAST_STEPS,
    MEANFLOW_METHODS,
    ODE_ADAPTIVE_METHODS,
    ODE_EQUAL_STEP_METHODS,
    ODE_FIXED_STEP_METHODS,
    ODE_STEP_NFE,
    SDE_STEP_NFE,
    TRANSPORT_METHODS,
    ode_solver_name,
)
from .utils.errors import SettingError

#: sample.method values of each objective: SiT's transport, DiT's diffusion
SAMPLE_METHODS: dict[str, tuple[str, ...]] = {"sit": TRANSPORT_METHODS, "ddpm": DIFFUSION_METHODS,
                                              "meanflow": MEANFLOW_METHODS}
OBJECTIVE_TITLES = {"sit": "SiT's transport, t = 0 noise .. 1 data", "ddpm": "DiT's diffusion",
                    "meanflow": "MeanFlow's average velocity on SiT's linear path"}
METHODS = (*TRANSPORT_METHODS, *DIFFUSION_METHODS, *MEANFLOW_METHODS)
#: what each method is (the ``--method list`` text)
METHOD_TITLES = {
    "ode": "probability-flow ODE on num_steps grid points (num_steps - 1 steps)",
    "sde": "reverse SDE on num_steps grid points (num_steps - 1 steps), then a last step",
    "ddpm": "DiT's ancestral sampler on num_steps respaced steps, 1 NFE a step",
    "ddim": "DDIM (--eta 0: deterministic) on num_steps respaced steps, 1 NFE a step",
    "meanflow": "num_steps equal jumps z_r = z_t + (r - t) u(z_t, t, r) from noise (1 = one "
                "step), 1 NFE a step",
}
DEFAULT_SAMPLING_METHOD = {"ode": "dopri5", "sde": "Euler"}  # SiT's sample.py defaults per method
#: grid points / respaced steps / jumps needed
MIN_STEPS = {"ode": 2, "sde": 2, "ddpm": 1, "ddim": 1, "meanflow": 1}
#: ``--method list`` (or a bare ``--method``): sample.py lists every method and solver and exits
LIST = "list"
#: results/nfe's few-step setting (exploratory; two training seeds per arm): diffusers' UniPC with
#: flow sigmas at 8 NFE (9 grid points) reached the ODE solvers' plateau on every digits
#: checkpoint measured, and 16 NFE did not improve on it (the recommended setting at <= 10 NFE, not
#: shown better than its neighbours: results/nfe's 12-06 rows over five sample seeds)
FEW_STEP: dict[str, Any] = {"method": "ode", "sampling_method": "unipc", "num_steps": 9}
#: the few-step setting of each objective; ddpm (results/nfe, exploratory, the DiT-objective demo
#: only): diffusers' DPM-Solver++ 2M SDE at 12 NFE came to 0.94 x the FID of DDPM at 250 steps,
#: where DDIM's best at <= 20 NFE was 1.76 x and the ODE solvers levelled off at ~1.15 x
FEW_STEPS: dict[str, dict[str, Any]] = {
    "sit": FEW_STEP,
    "ddpm": {"method": "ddpm", "sampling_method": "dpm++2m-sde", "num_steps": 12},
}


def sampling_methods(method: str) -> tuple[str, ...]:
    """The ``sampling_method`` values of ``method`` (ode: torchdiffeq's fixed-step and adaptive
    methods, then diffusers' flow solvers; sde: its integrators; ddpm / ddim: diffusers' solvers of
    the same SDE / ODE, besides their own step, which takes no name)."""
    if method == "ode":
        return (*ODE_FIXED_STEP_METHODS, *ODE_ADAPTIVE_METHODS, *FLOW_SOLVERS)
    return tuple(SDE_STEP_NFE) if method == "sde" else tuple(DIFFUSION_SOLVERS.get(method, ()))


def step_evaluations(method: str, sampling_method: str | None) -> int | None:
    """Model evaluations per step of ``method`` / ``sampling_method`` (None: not fixed, e.g. an
    adaptive ODE solver or the Adams family)."""
    if method == "ode":
        name = ode_solver_name(sampling_method or DEFAULT_SAMPLING_METHOD["ode"])
        return 1 if name in FLOW_SOLVERS else ODE_STEP_NFE.get(name)
    if method == "sde":
        return SDE_STEP_NFE.get(sampling_method or DEFAULT_SAMPLING_METHOD["sde"])
    return 1


#: annotation -> accepted types
NUMBER_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float),
                                                    "int | None": int, "float | None": (int, float)}


def option(default: Any, help: str, *, solvers: tuple[str, ...] = (),
           methods: tuple[str, ...] = METHODS) -> Any:
    """A spec field: its ``help`` (``{default}`` filled in by sample.py's flag), ``solvers`` (the
    methods whose sampler builder takes it) and ``methods`` (where it applies at all; elsewhere it
    is refused)."""
    return field(default=default, metadata={"help": help, "solvers": solvers, "methods": methods})


@dataclass(frozen=True)
class SampleSpec:
    """Sampler settings (defaults: SiT's sample.py). ``method`` ode | sde samples the transport,
    ddpm | ddim DiT's diffusion on ``num_steps`` respaced steps, meanflow ``num_steps`` jumps of
    MeanFlow's average velocity. ``cfg_scale`` 1 = no guidance."""

    method: str = option(
        "ode", "; ".join(f"objective {o}: {' | '.join(m)} (default {m[0]})"
                         for o, m in SAMPLE_METHODS.items())
        + f"; '{LIST}' (or a bare --method) lists every method and solver with its NFE and exits")
    sampling_method: str | None = option(
        None, f"ode: torchdiffeq's {', '.join(ODE_FIXED_STEP_METHODS + ODE_ADAPTIVE_METHODS)} "
        f"(default {DEFAULT_SAMPLING_METHOD['ode']}) or diffusers' {', '.join(FLOW_SOLVERS)}; "
        f"sde: {' | '.join(SDE_STEP_NFE)} (default {DEFAULT_SAMPLING_METHOD['sde']}); "
        + "; ".join(f"{m}: diffusers' {', '.join(DIFFUSION_SOLVERS[m])} (default: {m}'s own step)"
                    for m in DIFFUSION_METHODS)
        + f"; see --method {LIST}", solvers=TRANSPORT_METHODS)
    num_steps: int = option(250, "time-grid points (default {default}; fixed-step ODE takes "
                            "num_steps-1 steps; adaptive ODE: output grid only); ddpm / ddim: "
                            "respaced diffusion steps; meanflow: jumps (= NFE)", solvers=METHODS)
    atol: float = option(DEFAULT_ATOL, "adaptive ODE absolute tolerance (default {default})",
                         solvers=("ode",))
    rtol: float = option(DEFAULT_RTOL, "adaptive ODE relative tolerance (default {default})",
                         solvers=("ode",))
    # sigma (not the Sampler API's SBDM): SiT's sample.py default, behind FID 2.06 (DESIGN.md §4)
    diffusion_form: str = option("sigma", "SDE diffusion coefficient D(t) (default {default})",
                                 solvers=("sde",))
    diffusion_norm: float = option(1.0, "SDE diffusion scale (default {default})",
                                   solvers=("sde",))
    last_step: str | None = option("Mean", "SDE final step (default {default})", solvers=("sde",))
    last_step_size: float = option(0.04, "SDE final step size (default {default})",
                                   solvers=("sde",))
    time_shift: float | None = option(
        None, "ode / sde: SD3 time shift s of the noise level sigma = 1 - t, sigma' = s sigma / "
        "(1 + (s - 1) sigma); s > 1 spends more steps at high noise (default none = uniform)",
        solvers=TRANSPORT_METHODS, methods=TRANSPORT_METHODS)
    eta: float = option(0.0,
                        "DDIM noise: 0 = deterministic (DiT, default {default}), 1 = DDPM-like",
                        solvers=("ddim",))
    cfg_scale: float = option(1.0, "classifier-free guidance scale (default {default:g} = off; < 0 "
                              "needs --allow-negative-cfg)")
    cfg_channels: int | None = option(None, "guided channels: all (default) or 3 for the SiT/DiT "
                                      "legacy mode behind the published numbers")
    cfg_interval: tuple[float, float] | None = option(
        None, "guide only for t in [T_LO, T_HI] (t = 0 noise, 1 data; ode / sde)",
        methods=TRANSPORT_METHODS)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SettingError("method", self.method, f"; valid: {', '.join(METHODS)}")
        for f in fields(self):  # the number types come from the annotations
            kinds = NUMBER_TYPES.get(f.type)
            value = getattr(self, f.name)
            if kinds is None or (value is None and f.type.endswith("| None")):
                continue
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise SettingError(f.name, value,
                                   ": expected " + ("an int" if kinds is int else "a number"))
            if not math.isfinite(value):  # nan / inf: every image would come out non-finite
                raise SettingError(f.name, value, ": expected a finite number")
        if not isinstance(self.sampling_method, str | None):
            raise SettingError("sampling_method", self.sampling_method,
                               f": expected a solver's name (see --method {LIST})")
        if self.num_steps < MIN_STEPS[self.method]:  # a 1-point time grid integrates nothing
            raise SettingError("num_steps", self.num_steps,
                               f": method={self.method} needs >= {MIN_STEPS[self.method]}")
        for f in fields(self):  # a setting of another method family (the ODE solver for ddpm, ...)
            if getattr(self, f.name) is not None and self.method not in f.metadata["methods"]:
                raise SettingError(f.name, getattr(self, f.name),
                                   f" applies to {' / '.join(f.metadata['methods'])}, "
                                   f"not method={self.method!r}")
        shift = self.time_shift
        if shift is not None and not (math.isfinite(shift) and shift > 0):
            raise SettingError("time_shift", shift, ": must be a number > 0 (1 = uniform)")
        if self.eta < 0:
            raise SettingError("eta", self.eta, ": must be >= 0")
        for name in ("atol", "rtol"):  # 0: the adaptive solver shrinks dt until it underflows
            if getattr(self, name) <= 0:
                raise SettingError(name, getattr(self, name), ": must be > 0")
        # frozen: object.__setattr__
        if self.sampling_method is None and self.method in DEFAULT_SAMPLING_METHOD:
            object.__setattr__(self, "sampling_method", DEFAULT_SAMPLING_METHOD[self.method])
        valid = sampling_methods(self.method)
        solver = self.sampling_method
        if solver is not None and self.method in DIFFUSION_SOLVERS:  # None: DDPM's / DDIM's step
            solver = solver.lower()
            object.__setattr__(self, "sampling_method", solver)
            if self.method == "ddim" and solver in valid and self.eta != 0:
                raise SettingError("eta", self.eta, f": DDIM's noise; the {solver} solver takes "
                                   "none (a stochastic one: method ddpm, e.g. dpm++2m-sde)")
        if solver is not None and (ode_solver_name(solver) if self.method == "ode" else solver) \
                not in valid:
            raise SettingError("sampling_method", solver, f": not a method={self.method!r} solver; "
                               f"valid: {', '.join(map(repr, valid))} (see --method {LIST})")
        if self.method == "ode" and shift not in (None, 1.0) \
                and ode_solver_name(solver) in ODE_EQUAL_STEP_METHODS:
            raise SettingError("time_shift", shift, f": {solver} takes equal steps (Adams "
                               "coefficients); shift a one-step solver (heun2, rk4) or unipc")
        if self.last_step in ("none", "None"):  # "None": SiT's sample.py spelling
            object.__setattr__(self, "last_step", None)
        for name, valid in (("diffusion_form", DIFFUSION_FORMS), ("last_step", LAST_STEPS)):
            if getattr(self, name) not in valid:  # a config's typo, before a run trains on it
                raise SettingError(name, getattr(self, name),
                                   f"; valid: {', '.join(str(v) for v in valid)}")
        if self.cfg_interval is not None:
            pair = self.cfg_interval
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2 or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in pair):
                raise SettingError("cfg_interval", pair, ": expected two numbers [t_lo, t_hi]")
            lo, hi = (float(v) for v in pair)  # a YAML list or a flag's tuple: stored as a tuple
            if not 0.0 <= lo <= hi <= 1.0:
                raise SettingError("cfg_interval", (lo, hi), ": need 0 <= t_lo <= t_hi <= 1")
            object.__setattr__(self, "cfg_interval", (lo, hi))
        if self.cfg_channels is not None and self.cfg_channels < 1:
            raise SettingError("cfg_channels", self.cfg_channels,
                               ": must be >= 1 (or None for all channels)")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The field names: config ``sample`` keys and CLI flag names (``_`` -> ``-``)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, *layers: Mapping[str, Any], explicit: bool = False) -> SampleSpec:
        """The spec from ``layers`` of settings, highest priority first (e.g. CLI flags, then a
        checkpoint's ``sample`` section): each field's first non-None value, else the default;
        non-field keys are ignored. A layer's ``sampling_method`` is used only with its own
        ``method`` (if set), else the winning one; under ddpm / ddim / meanflow a stored one that
        is not that method's solver is dropped (a typed one, the first layer with ``explicit``, is
        refused by the spec).
        """
        known = [{k: v for k, v in layer.items() if k in cls.keys() and v is not None}
                 for layer in layers]
        method = next((layer["method"] for layer in known if "method" in layer), cls.method)
        values: dict[str, Any] = {"method": method}
        for i, layer in enumerate(known):
            stored = None if explicit and i == 0 else layer.get("sampling_method")
            foreign = method not in TRANSPORT_METHODS and isinstance(stored, str) \
                and stored.lower() not in sampling_methods(method)
            if stored is not None and (layer.get("method", method) != method or foreign):
                layer = {k: v for k, v in layer.items() if k != "sampling_method"}
            for key, value in layer.items():
                values.setdefault(key, value)
        return cls(**values)

    def options(self) -> dict[str, Any]:
        """The keywords of this method's sampler builder (``sample_ode`` / ``sample_sde``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if self.method in f.metadata["solvers"]}

    @property
    def nfe(self) -> int | None:
        """Model evaluations per image (CFG's doubled batch counts once): ode ``(num_steps - 1) x``
        the solver's per step; sde the same plus 1 for a last step; ddpm / ddim / meanflow
        ``num_steps``. None: not fixed in advance (adaptive solvers count theirs while sampling)."""
        per_step = step_evaluations(self.method, self.sampling_method)
        if per_step is None:
            return None
        if self.method not in TRANSPORT_METHODS:
            return self.num_steps * per_step
        last = self.method == "sde" and self.last_step is not None
        return (self.num_steps - 1) * per_step + int(last)

    def with_nfe(self, nfe: int) -> SampleSpec:
        """This spec with ``num_steps`` set to make exactly ``nfe`` model evaluations per image
        (the inverse of :attr:`nfe`). SettingError naming ``nfe`` when this solver cannot: an
        adaptive one, a count that is not a whole number of steps (heun2: 2 a step), or fewer than
        one step (and the SDE's last step)."""
        solver = f"method={self.method}" + (f" / {self.sampling_method}"
                                            if self.sampling_method else "")
        per_step = step_evaluations(self.method, self.sampling_method)
        if per_step is None:
            raise SettingError("nfe", nfe, f": {solver} has no fixed number of evaluations a step "
                               f"(see --method {LIST}); set --num-steps, or pick a fixed-step "
                               "solver")
        last = int(self.method == "sde" and self.last_step is not None)
        steps, rest = divmod(nfe - last, per_step)
        if steps < 1 or rest:
            plus = " plus 1 for the last step" if last else ""
            rule = (f"a multiple of {per_step}" + (" plus 1" if last else "")
                    + f" (>= {per_step + last})" if per_step > 1 else f">= {1 + last}")
            raise SettingError("nfe", nfe, f": {solver} makes {per_step} evaluation"
                               f"{'s' if per_step > 1 else ''} a step{plus}, so NFE must be {rule}")
        grid = steps + 1 if self.method in TRANSPORT_METHODS else steps
        return dataclasses.replace(self, num_steps=grid)

    @property
    def batch_coupled(self) -> bool:
        """True when images depend on the batch composition (adaptive ODE step-size control)."""
        from .transport.integrators import is_adaptive  # torch: not needed to parse or check

        return self.method == "ode" and ode_solver_name(self.sampling_method) not in FLOW_SOLVERS \
            and is_adaptive(self.sampling_method)


def config_defaults() -> dict[str, None]:
    """The config's sampler keys: every spec field, None = the spec's default."""
    return dict.fromkeys(SampleSpec.keys())


def check_cfg_scale(cfg_scale: float, allow_negative: bool = False) -> None:
    """A negative guidance scale steers samples away from their class: refused unless asked for."""
    if cfg_scale < 0 and not allow_negative:
        raise SettingError("cfg_scale", cfg_scale, ": a negative scale steers samples away from "
                           "their class (1 = no guidance, > 1 = stronger); allow it explicitly "
                           "(sample.py --allow-negative-cfg) if that is meant")

__all__ = ["DEFAULT_SAMPLING_METHOD", "FEW_STEP", "FEW_STEPS", "LIST", "METHODS",
           "SAMPLE_METHODS", "SampleSpec", "check_cfg_scale", "config_defaults", "option",
           "sampling_methods", "step_evaluations"]
