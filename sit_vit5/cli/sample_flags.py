"""sample.py's sampler flags: one per :class:`SampleSpec` field, the argparse types that refuse a
bad number at parse time (naming the flag), and the ``--method list`` text; torch-free.

The spec (fields, help, defaults, ranges) lives in :mod:`sit_vit5.sample_spec`; this module only
turns it into a command line.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from sit_vit5.names import (
    DIFFUSION_FORMS,
    DIFFUSION_SOLVERS,
    FLOW_SOLVERS,
    LAST_STEPS,
    ODE_ADAPTIVE_METHODS,
    ODE_ALIASES,
    ODE_FIXED_STEP_METHODS,
    ODE_STEP_NFE,
    SDE_STEP_NFE,
)
from sit_vit5.sample_spec import (
    DEFAULT_SAMPLING_METHOD,
    FEW_STEPS,
    LIST,
    METHOD_TITLES,
    METHODS,
    OBJECTIVE_TITLES,
    SAMPLE_METHODS,
    SampleSpec,
)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (``nan`` / ``inf`` refused at parse time, naming the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _channels(text: str) -> int | None:
    """``all`` -> None (every channel), else a positive channel count."""
    if text == "all":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {text!r}"
                                         ) from None


def describe_methods() -> str:
    """Every sampling method and solver with its NFE (model evaluations per image), from the
    tables the spec checks against: what ``sample.py --method list`` prints."""
    def names(items: Sequence[str], default: str | None) -> str:
        return ", ".join(f"{n} (default)" if n == default else n for n in items)

    ode_default, sde_default = DEFAULT_SAMPLING_METHOD["ode"], DEFAULT_SAMPLING_METHOD["sde"]
    fixed = [f"{n} {ODE_STEP_NFE[n]}" if n in ODE_STEP_NFE else n for n in ODE_FIXED_STEP_METHODS]
    aliases = ", ".join(f"{a} = {n}" for a, n in ODE_ALIASES.items())
    def classes(table: Mapping[str, tuple[str, dict[str, Any]]]) -> list[str]:
        return [f"{n} ({cls}" + "".join(f", {k}={v}" for k, v in kw.items()) + ")"
                for n, (cls, kw) in table.items()]

    flow = classes(FLOW_SOLVERS)
    solvers = {
        "ode": [f"fixed-step, NFE a step: {', '.join(fixed)} (alias {aliases})",
                "adaptive, NFE as counted (--atol / --rtol): "
                + names(ODE_ADAPTIVE_METHODS, ode_default),
                "diffusers' multistep, flow sigmas, 1 NFE a step: " + ", ".join(flow)],
        "sde": ["NFE a step: " + ", ".join(f"{n} {k}" + (" (default)" if n == sde_default else "")
                                           for n, k in SDE_STEP_NFE.items()),
                "last step, +1 NFE: " + names([k for k in LAST_STEPS if k and k != "none"], "Mean")
                + "; None: +0"],
        **{method: [f"--sampling-method, diffusers' multistep on the same {process}, epsilon, 1 "
                    "NFE a step, its own timesteps: "
                    + ", ".join(classes(DIFFUSION_SOLVERS[method]))]
           for method, process in (("ddpm", "SDE"), ("ddim", "ODE"))},
    }
    lines = ["sampling methods (--method, then --sampling-method: a solver); NFE = model "
             "evaluations per image (CFG's doubled batch counts once); --nfe N sets --num-steps"]
    for objective, methods in SAMPLE_METHODS.items():
        lines.append(f"objective {objective} ({OBJECTIVE_TITLES[objective]}; default method "
                     f"{methods[0]}):")
        for method in methods:
            lines.append(f"  {method:5s} {METHOD_TITLES[method]}")
            lines += [textwrap.fill(line, 100, initial_indent=" " * 8, subsequent_indent=" " * 10)
                      for line in solvers.get(method, [])]
    for objective, setting in FEW_STEPS.items():
        few = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in setting.items()
                       if k != "num_steps")
        lines.append(f"few-step setting of objective {objective} (results/nfe, exploratory): {few} "
                     f"--nfe {SampleSpec(**setting).nfe}")
    return "\n".join(lines)


class ListMethods(argparse.Action):
    """``--method`` with argparse: ``list`` (the const of a bare ``--method``) prints
    :func:`describe_methods` and exits 0; any other value is stored."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if values == LIST:
            print(describe_methods())
            parser.exit(0)
        setattr(namespace, self.dest, values)


#: each spec field's argparse keywords besides its help (``aliases``: more flag names); every
#: field needs an entry, so a new field cannot reach sample.py without its flag's type
FLAGS: dict[str, dict[str, Any]] = {
    "method": dict(choices=(*METHODS, LIST), nargs="?", const=LIST, action=ListMethods),
    "sampling_method": {},
    "num_steps": dict(type=positive_int, aliases=("--num-sampling-steps",)),
    "atol": dict(type=finite_float),
    "rtol": dict(type=finite_float),
    "diffusion_form": dict(choices=tuple(DIFFUSION_FORMS)),
    "diffusion_norm": dict(type=finite_float),
    "last_step": dict(choices=(*(k for k in LAST_STEPS if k is not None), "None")),
    "last_step_size": dict(type=finite_float),
    "time_shift": dict(type=positive_float),
    "eta": dict(type=finite_float),
    "cfg_scale": dict(type=finite_float),
    "cfg_channels": dict(type=_channels),
    "cfg_interval": dict(type=finite_float, nargs=2, metavar=("T_LO", "T_HI")),
}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """One flag per spec field (``--num-steps`` = num_steps), default None: unset flags fall
    through to the next layer of :meth:`SampleSpec.resolve`."""
    for f in fields(SampleSpec):
        flag = dict(FLAGS[f.name])
        names = [f"--{f.name.replace('_', '-')}", *flag.pop("aliases", ())]
        default = "none" if f.default is None else f.default
        text = f.metadata["help"].format(default=default)
        group.add_argument(*names, dest=f.name, default=None, help=text, **flag)


__all__ = ["FLAGS", "ListMethods", "add_arguments", "describe_methods", "finite_float",
           "positive_float", "positive_int"]
