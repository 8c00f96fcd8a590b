"""The paper's other claims on the digits proxy (PROTOCOL.md, addition of 2026-12-01): the sweep's order.

``plan_claims`` lists the runs of the addition in its pre-registered order (phase 1 on digits8, phase 2 on
digits16); runs already cached cost nothing, so the sweep resumes where it stopped. The statistics and the
verdict table (``CLAIMS.md``) are in ``claims_report``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .digits import (
    ABLATIONS,
    EVAL_SIZES,
    EXTRA_SPIKE_LR,
    RESULTS,
    SIZES,
    SPIKE_LRS,
    RunSpec,
    ablation_base,
    cached_runs,
)
from .stats import holm, welch, welch_contrast

#: The claims addition's budget (PROTOCOL.md): runs past it are not started.
BUDGET_CORE_HOURS = 60.0
C2_PAIRS = (("ViT-5 (γ0=1e-4) + SwiGLU-official", "ViT-5 (γ0=1e-4)"), ("ViT-5 + SwiGLU-official", "ViT-5 (γ0=1)"))
C3_VARIANTS = ("ViT-5 registers without RoPE", "ViT-5 registers at θ=1e4")
C4_BACKBONES = ("SiT", "ViT-5 (γ0=1)", "ViT-5 − QK-Norm")
MAIN_PAIR = ("SiT", "ViT-5 (γ0=1)")
C7_VARIANT = "ViT-5 (γ0=1) exact GELU"
RESOLUTION_PAIR = ("SiT (resolution)", "ViT-5 (γ0=1) (resolution)")
RESOLUTION_SIZES = EVAL_SIZES[RESOLUTION_PAIR[0]]  # the control is the training size, 8
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
        out += [(v, s) for s in range(3) for v in RESOLUTION_PAIR]  # C5
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


# ----------------------------------------------------------------------------- statistics and verdicts

EQUIVALENCE_PCT = 0.5  # |relative effect| CI inside ±0.5 %: "no effect" (PROTOCOL.md)
ALPHA = 0.05


@dataclass(frozen=True)
class Test:
    """One pre-registered comparison of the family: ``a`` − ``b`` on ``dataset`` in ``metric``.

    ``expect``: the paper's direction of a − b (−1: a lower is the claim, +1: a higher), 0 = none (an
    equivalence check). ``planned``: the protocol's n of a and b. metric: "loss" (final held-out loss),
    "instability" (spike steps + divergence), "degradation:N" (log L(N) − log L(8)) or "shrink" (C1b).
    """

    claim: str
    name: str
    dataset: str
    a: str
    b: str
    expect: int
    planned: tuple[int, int]
    metric: str = "loss"


def _ablation_direction(variant: str) -> int:
    """+1 where the paper says the ViT-5 choice helps (so the ablated run is worse), 0 for two changes."""
    if "SwiGLU" in variant and "LayerScale" in variant:
        return 0  # SwiGLU added and LayerScale removed at once: no single paper statement
    return 1  # a removed component, the qkv bias ViT-5 drops, or SwiGLU with LayerScale (C2)


def family() -> list[Test]:
    """The Holm family of PROTOCOL.md (addition of 2026-12-01): m = 44 tests."""
    tests: list[Test] = []
    for d in ("digits8", "digits16"):
        tests.append(Test("C6", "ViT-5 (γ0=1) vs SiT", d, MAIN_PAIR[1], MAIN_PAIR[0], -1, (6, 6)))
    for d in ("digits8", "digits16"):
        for v in (*ABLATIONS, "ViT-5 − LayerScale"):
            base = ablation_base(v)
            claim = "C2" if v in {a for a, _ in C2_PAIRS} else "C6"
            n_a = 3 if v == "ViT-5 − LayerScale" else 4
            tests.append(Test(claim, f"{v} vs {base}", d, v, base, _ablation_direction(v),
                              (n_a, 6 if base == MAIN_PAIR[1] else 4)))
    for d in ("digits8", "digits16"):
        for size in SIZES:
            tests.append(Test("C1", f"ViT-5 vs SiT at {size}", d, size_variant(MAIN_PAIR[1], size),
                              size_variant(MAIN_PAIR[0], size), -1, (3, 3)))
        tests.append(Test("C1", "gap at 8×128 vs 4×64 (shrink > 0)", d, "", "", -1, (3, 3), "shrink"))
    for d in ("digits8", "digits16"):
        for v in C3_VARIANTS:
            tests.append(Test("C3", f"{v} vs θ=100", d, v, MAIN_PAIR[1], 1, (4, 6)))
    for lr in SPIKE_LRS:
        a, b = spike_variant(MAIN_PAIR[1], lr), spike_variant("ViT-5 − QK-Norm", lr)
        tests.append(Test("C4", f"instability at lr {lr:g}: with vs without QK-Norm", "digits8", a, b, -1, (3, 3),
                          "instability"))
        tests.append(Test("C4", f"held-out loss at lr {lr:g}: with vs without QK-Norm", "digits8", a, b, -1,
                          (3, 3)))
    for size in RESOLUTION_SIZES:
        tests.append(Test("C5", f"degradation at {size}×{size}: ViT-5 vs SiT", "digits8", RESOLUTION_PAIR[1],
                          RESOLUTION_PAIR[0], -1, (3, 3), f"degradation:{size}"))
    tests.append(Test("C7", "exact vs tanh GELU", "digits8", C7_VARIANT, MAIN_PAIR[1], 0, (4, 6)))
    return tests


def _runs(results: Sequence[dict[str, Any]], dataset: str, variant: str) -> list[dict[str, Any]]:
    return sorted((r for r in results if r["dataset"] == dataset and r["variant"] == variant and r.get("complete")),
                  key=lambda r: r["seed"])


def final_loss(run: dict[str, Any]) -> float | None:
    """Final held-out loss, None for a run that diverged before its last checkpoint."""
    final = run["checkpoints"].get(str(run["steps"]))
    return None if final is None else final["heldout_loss"]


def _values(runs: Sequence[dict[str, Any]], metric: str) -> list[float]:
    if metric == "instability":
        return [r["loss_spikes"] + ("diverged_at_step" in r) for r in runs]
    losses = [(r, final_loss(r)) for r in runs]
    if metric == "loss":
        return [v for _, v in losses if v is not None]
    size = metric.split(":")[1]  # degradation at another size
    return [math.log(r["resolution"][size]["heldout_loss"]) - math.log(v)
            for r, v in losses if v is not None and size in r.get("resolution", {})]


def evaluate_test(test: Test, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """n, means, stds, effect (relative % for losses, log-% for degradation, counts for instability), its
    95 % CI, Welch p and whether planned runs are missing."""
    if test.metric == "shrink":
        small, large = MAIN_PAIR, tuple(size_variant(b, "8×128") for b in MAIN_PAIR)
        names = [large[1], large[0], small[1], small[0]]
        groups = [[math.log(v) for v in _values(_runs(results, test.dataset, n), "loss")] for n in names]
        planned = [3, 3, 6, 6]
        out: dict[str, Any] = {"n": [len(g) for g in groups], "planned": planned,
                               "pending": any(len(g) < p for g, p in zip(groups, planned))}
        if min(len(g) for g in groups) >= 2:
            c = welch_contrast(groups, [1, -1, -1, 1])
            upper = welch_contrast(groups, [1, -1, -1, 1], level=0.90).ci[1]  # one-sided 95 % bound
            small_gap = statistics.fmean(groups[2]) - statistics.fmean(groups[3])
            out.update(effect=100 * c.estimate, ci=(100 * c.ci[0], 100 * c.ci[1]), p=c.p,
                       upper=100 * upper, small_gap=100 * small_gap)
        return out
    runs_a, runs_b = _runs(results, test.dataset, test.a), _runs(results, test.dataset, test.b)
    a, b = _values(runs_a, test.metric), _values(runs_b, test.metric)
    out = {"n": [len(runs_a), len(runs_b)], "planned": list(test.planned),
           "pending": len(runs_a) < test.planned[0] or len(runs_b) < test.planned[1],
           "diverged": [sum("diverged_at_step" in r for r in runs) for runs in (runs_a, runs_b)],
           "values": [a, b]}
    if len(a) >= 2 and len(b) >= 2:
        c = welch(a, b)
        scale = 100 / statistics.fmean(b) if test.metric == "loss" else (100 if test.metric != "instability" else 1)
        out.update(effect=scale * c.estimate, ci=(scale * c.ci[0], scale * c.ci[1]), p=c.p,
                   sd=(statistics.stdev(a) * abs(scale), statistics.stdev(b) * abs(scale)),
                   mean=(statistics.fmean(a), statistics.fmean(b)))
    return out


def verdict(test: Test, out: dict[str, Any], adjusted: float) -> str:
    """The protocol's verdict for one test from its Holm-adjusted p."""
    if out["pending"]:
        return f"pending ({sum(out['n'])} of {sum(out['planned'])} runs)"
    if "p" not in out:
        return "inconclusive (fewer than 2 usable runs per side)"
    if test.metric == "instability" and not any(v for vs in out["values"] for v in vs):
        return "inconclusive: nothing to remove (no spike or divergence)"
    significant = adjusted < ALPHA
    if test.metric == "shrink":
        if significant and out["effect"] > 0:
            return "not reproduced (the gap shrinks)"
        if out["upper"] < abs(out["small_gap"]) / 2:
            return "reproduced (the gap keeps at least half its size)"
        return "inconclusive"
    equivalent = test.metric != "instability" and max(abs(x) for x in out["ci"]) < EQUIVALENCE_PCT
    if test.expect == 0:
        return "differs" if significant else "equivalent" if equivalent else "inconclusive"
    if significant:
        return "reproduced" if out["effect"] * test.expect > 0 else "not reproduced (opposite)"
    return "not reproduced (no effect)" if equivalent else "inconclusive"


def evaluate_family(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every test of the family with its statistics, Holm-adjusted p (pending tests count as p = 1) and
    verdict."""
    tests = family()
    outs = [evaluate_test(t, results) for t in tests]
    adjusted = holm([1.0 if o["pending"] else o.get("p", 1.0) for o in outs])
    return [{"test": t, **o, "p_holm": adj, "verdict": verdict(t, o, adj)} for t, o, adj in zip(tests, outs, adjusted)]


def claim_verdict(verdicts: Sequence[str]) -> str:
    """Conjunction: all reproduced -> reproduced; any not reproduced -> not reproduced; pending; else
    inconclusive."""
    if any(v.startswith("not reproduced") for v in verdicts):
        return "not reproduced"
    if verdicts and all(v.startswith("reproduced") for v in verdicts):
        return "reproduced"
    if any(v.startswith("pending") for v in verdicts):
        return "pending"
    return "inconclusive"
