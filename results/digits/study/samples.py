"""Sample quality on the digits proxy (PROTOCOL.md, addition of 2026-12-04).

``plan_samples`` lists the addition's runs in their pre-registered order (the digits16 reruns, the main
pair's new seeds, the 5× longer arm); ``spent`` charges them to the addition's budget. The tests (families
S, L and T), the loss-vs-FID analysis and the report section are below them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .digits import LONG, LONG_STEPS, RERUN, RESULTS, SAMPLE_VARIANTS, RunSpec, cached_runs, run_cost

#: The addition's budget (PROTOCOL.md): runs past it are not started.
SAMPLES_BUDGET_CORE_HOURS = 40.0
MAIN_PAIR = ("SiT", "ViT-5 (γ0=1)")
#: n per arm of the primary tests (the power analysis) and of the longer arm (the budget's largest).
N_PLANNED = {"digits16": 36, "digits8": 25}
N_LONG = 20
FIRST_NEW_SEED = 6  # seeds 0–5 of the main pair belong to the earlier additions
RERUN_SEEDS = (0, 1, 2)  # digits16 runs that predate the 16×16 network: no FID16


def plan_samples(datasets: Sequence[str] = ("digits8", "digits16"), results_dir: str | os.PathLike = RESULTS,
                 **common: Any) -> list[RunSpec]:
    """Every run of the addition in its order: (1) the digits16 reruns, (2) the new seeds of the main pair,
    seed by seed, digits16 before digits8, (3) the longer arm seed by seed (``LONG_STEPS`` steps)."""
    common = {**common, "results_dir": str(results_dir)}
    order: list[tuple[str, str, int, int | None]] = []
    if "digits16" in datasets:
        order += [("digits16", v, s, None) for s in RERUN_SEEDS for v in RERUN]
    for s in range(FIRST_NEW_SEED, max(N_PLANNED.values())):
        order += [(d, v, s, None) for d in ("digits16", "digits8")
                  if d in datasets and s < N_PLANNED[d] for v in MAIN_PAIR]
    if "digits16" in datasets:
        order += [("digits16", v, s, LONG_STEPS) for s in range(N_LONG) for v in LONG]
    return [RunSpec(d, v, s, **{**common, **({"steps": steps} if steps else {})}) for d, v, s, steps in order]


def is_sample_run(run: dict[str, Any]) -> bool:
    """Whether a cached run belongs to this addition (and so to its budget)."""
    return run["variant"] in SAMPLE_VARIANTS or (run["variant"] in MAIN_PAIR and run["seed"] >= FIRST_NEW_SEED)


def spent(results_dir: str | os.PathLike) -> float:
    """Core-hours this addition's complete runs recorded (training + evaluation, one thread each)."""
    return sum(run_cost(r) for r in cached_runs(results_dir) if r.get("complete") and is_sample_run(r))
