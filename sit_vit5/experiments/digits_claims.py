"""The paper's other claims on the digits proxy (PROTOCOL.md, addition of 2026-12-01): the sweep's order.

``plan_claims`` lists the runs of the addition in its pre-registered order (phase 1 on digits8, phase 2 on
digits16); runs already cached cost nothing, so the sweep resumes where it stopped. The statistics and the
verdict table (``CLAIMS.md``) are in ``claims_report``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .digits import ABLATIONS, EXTRA_SPIKE_LR, RESULTS, SIZES, SPIKE_LRS, RunSpec, cached_runs

#: The claims addition's budget (PROTOCOL.md): runs past it are not started.
BUDGET_CORE_HOURS = 60.0
C2_PAIRS = (("ViT-5 (γ0=1e-4) + SwiGLU-official", "ViT-5 (γ0=1e-4)"), ("ViT-5 + SwiGLU-official", "ViT-5 (γ0=1)"))
C3_VARIANTS = ("ViT-5 registers without RoPE", "ViT-5 registers at θ=1e4")
C4_BACKBONES = ("SiT", "ViT-5 (γ0=1)", "ViT-5 − QK-Norm")
MAIN_PAIR = ("SiT", "ViT-5 (γ0=1)")
C7_VARIANT = "ViT-5 (γ0=1) exact GELU"
#: Ablation rows raised to n = 4 after the claims (the two C2 rows are raised first, inside C2).
OTHER_ABLATIONS = tuple(v for v in ABLATIONS if v not in {a for a, _ in C2_PAIRS})


def spike_variant(backbone: str, lr: float) -> str:
    return f"{backbone} lr={lr:g}"


def size_variant(backbone: str, size: str) -> str:
    return f"{backbone} {size}"


def _sit_spiked(results: Sequence[dict[str, Any]]) -> bool | None:
    """Whether any of SiT's C4 runs spiked or diverged (None while one of them is missing)."""
    runs = [r for r in results if r.get("complete") and r["dataset"] == "digits8"
            and r["variant"] in {spike_variant("SiT", lr) for lr in SPIKE_LRS}]
    if len(runs) < 3 * len(SPIKE_LRS):
        return None
    return any(r["loss_spikes"] or "diverged_at_step" in r for r in runs)


def _phase(d: str, first_seed_only: bool = False) -> list[tuple[str, int]]:
    """(variant, seed) in the protocol's order for dataset ``d`` (see PROTOCOL.md)."""
    out: list[tuple[str, int]] = []
    out += [(MAIN_PAIR[1], 3), ("ViT-5 (γ0=1e-4)", 3)]  # C2: n = 4 on both sides
    out += [(v, s) for s in (2, 3) for v, _ in C2_PAIRS]
    out += [(v, s) for s in range(4) for v in C3_VARIANTS]  # C3
    if d == "digits8":
        out += [(spike_variant(b, lr), 0) for lr in SPIKE_LRS for b in C4_BACKBONES]  # C4, seed 0
    out += [("SiT", s) for s in (3, 4, 5)] + [(MAIN_PAIR[1], s) for s in (4, 5)]  # the main pair to n = 6
    if d == "digits8":
        out += [(spike_variant(b, lr), s) for s in (1, 2) for lr in SPIKE_LRS for b in C4_BACKBONES]
        out += [(C7_VARIANT, s) for s in range(4)]
    out += [(size_variant(b, size), s) for s in range(3) for size in SIZES for b in MAIN_PAIR]  # C1
    if d == "digits16":
        out += [("DiT w. ViT (cosine)", s) for s in range(3)]
    out += [(v, s) for s in (2, 3) for v in OTHER_ABLATIONS]
    return out


def plan_claims(datasets: Sequence[str] = ("digits8", "digits16"), results_dir: str | os.PathLike = RESULTS,
                **common: Any) -> list[RunSpec]:
    """Every run of the claims addition in the pre-registered order: phase 1 (digits8), then phase 2
    (digits16); the extra C4 learning rate is appended to phase 1 only when SiT spiked at neither lr."""
    specs = []
    for d in ("digits8", "digits16"):
        if d not in datasets:
            continue
        order = _phase(d)
        if d == "digits8" and _sit_spiked(cached_runs(results_dir)) is False:
            order += [(spike_variant(b, EXTRA_SPIKE_LR), s) for s in range(3) for b in C4_BACKBONES]
        specs += [RunSpec(d, v, s, results_dir=str(results_dir), **common) for v, s in order]
    return specs
