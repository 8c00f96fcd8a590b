"""The REPA addition of the digits proxy (PROTOCOL.md, addition of 2026-12-02).

``plan_repa`` lists its runs (the REPA variants, with the cached references without REPA first when
one is missing); ``family`` is its own Holm family of 12 tests, ``evaluate_repa`` their statistics
and verdicts, and ``repa_report`` the rows C8a / C8b and the section it adds to ``CLAIMS.md``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .claims import EQUIVALENCE_PCT, _num, _p, _runs, final_loss
from .digits import REPA_SETTINGS, REPA_VARIANTS, RESULTS, RunSpec, core_hours_spent
from .stats import holm, welch, welch_contrast

REPA_BUDGET_CORE_HOURS = 4.0
SEEDS = (0, 1, 2)
ALPHA = 0.05
#: backbone (the reference run's variant) -> its REPA variant
PAIRS = {"SiT": "SiT + REPA", "ViT-5 (γ0=1)": "ViT-5 (γ0=1) + REPA"}
DATASETS = ("digits8", "digits16")
assert set(PAIRS.values()) == set(REPA_VARIANTS)


def plan_repa(
    datasets: Sequence[str] = DATASETS, results_dir: str | os.PathLike = RESULTS, **common: Any
) -> list[RunSpec]:
    """digits8 then digits16; per dataset the references (cached: free) then the REPA runs seed by
    seed, SiT before ViT-5."""
    specs = []
    for d in (d for d in DATASETS if d in datasets):
        order = [(ref, s) for s in SEEDS for ref in PAIRS]
        order += [(PAIRS[ref], s) for s in SEEDS for ref in PAIRS]
        specs += [RunSpec(d, v, s, results_dir=str(results_dir), **common) for v, s in order]
    return specs


def spent(results_dir: str | os.PathLike) -> float:
    """Core-hours of the REPA runs (the addition's budget counts only them)."""
    return core_hours_spent(results_dir, variants=tuple(REPA_VARIANTS))


@dataclass(frozen=True)
class RepaTest:
    """``kind``: R (REPA vs reference, paired convergence score; ``metric`` loss | fid), G
    (ViT-5 + REPA
    vs SiT + REPA, final log loss) or I (interaction contrast of final log loss)."""

    kind: str
    dataset: str
    backbone: str = ""
    metric: str = "loss"

    @property
    def name(self) -> str:
        if self.kind == "R":
            what = "held-out loss" if self.metric == "loss" else "digits-FID"
            return f"{PAIRS[self.backbone]} vs {self.backbone}: convergence score ({what})"
        if self.kind == "G":
            return "ViT-5 (γ0=1) + REPA vs SiT + REPA: final held-out loss"
        return "gap under REPA minus gap without (final log held-out loss)"


def family() -> list[RepaTest]:
    """The addition's 12 tests: R (2 backbones × 2 metrics × 2 datasets), G and I per dataset."""
    tests = [RepaTest("R", d, b, m) for m in ("loss", "fid") for d in DATASETS for b in PAIRS]
    return tests + [RepaTest(k, d) for k in ("G", "I") for d in DATASETS]


def convergence_score(run: dict[str, Any], metric: str) -> float | None:
    """Mean over the run's checkpoints of log(held-out loss) or log(digits-FID); None if one is
    missing (a diverged run)."""
    key = "heldout_loss" if metric == "loss" else "digits_fid"
    steps = [round(f * run["steps"]) for f in (0.25, 0.5, 0.75, 1.0)]
    values = [run["checkpoints"].get(str(s), {}).get(key) for s in steps]
    if any(v is None or not v > 0 for v in values):
        return None
    return statistics.fmean(math.log(v) for v in values)


def _paired(
    results, dataset: str, backbone: str, metric: str
) -> tuple[list[float], list[float], int]:
    """Convergence scores of the REPA runs and of their references, over the seeds both have (same
    order); the count of runs found (of 6 planned)."""
    ref = {r["seed"]: r for r in _runs(results, dataset, backbone) if r["seed"] in SEEDS}
    rep = {r["seed"]: r for r in _runs(results, dataset, PAIRS[backbone]) if r["seed"] in SEEDS}
    a, b = [], []
    for s in sorted(ref.keys() & rep.keys()):
        x, y = convergence_score(rep[s], metric), convergence_score(ref[s], metric)
        if x is not None and y is not None:
            a.append(x)
            b.append(y)
    return a, b, len(ref) + len(rep)


def _final_logs(results, dataset: str, variant: str) -> tuple[list[float], int]:
    runs = [r for r in _runs(results, dataset, variant) if r["seed"] in SEEDS]
    return [math.log(v) for v in map(final_loss, runs) if v is not None], len(runs)


def evaluate_test(test: RepaTest, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """n (runs found / planned), effect ×100 in log units (≈ %), its 95 % CI and the two-sided p."""
    from scipy import stats

    if test.kind == "R":
        a, b, found = _paired(results, test.dataset, test.backbone, test.metric)
        out: dict[str, Any] = {"n": found, "planned": 2 * len(SEEDS), "pairs": len(a)}
        if len(a) >= 2:
            diffs = [x - y for x, y in zip(a, b)]
            mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
            if sd == 0:
                p, half = (math.nan if mean == 0 else 0.0), 0.0
            else:
                p = float(stats.ttest_rel(a, b).pvalue)
                half = float(stats.t.ppf(0.975, len(diffs) - 1)) * sd / math.sqrt(len(diffs))
            out.update(effect=100 * mean, ci=(100 * (mean - half), 100 * (mean + half)), p=p)
        return out
    names = [PAIRS["ViT-5 (γ0=1)"], PAIRS["SiT"]] + (
        ["ViT-5 (γ0=1)", "SiT"] if test.kind == "I" else []
    )
    groups, found = zip(*(_final_logs(results, test.dataset, v) for v in names))
    out = {"n": sum(found), "planned": len(names) * len(SEEDS), "groups": [len(g) for g in groups]}
    if min(len(g) for g in groups) >= 2:
        c = welch(*groups) if test.kind == "G" else welch_contrast(groups, [1, -1, -1, 1])
        out.update(effect=100 * c.estimate, ci=(100 * c.ci[0], 100 * c.ci[1]), p=c.p)
        out["means"] = [statistics.fmean(math.exp(x) for x in g) for g in groups]
    return out


def verdict_of(test: RepaTest, out: dict[str, Any], adjusted: float) -> str:
    """R: yes / slower / no effect / inconclusive; G and I: the sign read (combined in
    ``gap_verdict``)."""
    if out["n"] < out["planned"]:
        return f"pending ({out['n']} of {out['planned']} runs)"
    if "p" not in out:
        return "inconclusive (fewer than 2 usable runs per side)"
    significant = adjusted < ALPHA
    if test.kind == "R":
        if significant:
            return "yes (REPA faster)" if out["effect"] < 0 else "slower with REPA"
        inside = max(abs(x) for x in out["ci"]) < EQUIVALENCE_PCT
        return "no effect" if inside else "inconclusive"
    if test.kind == "G":
        if significant:
            return "ViT-5 lower" if out["effect"] < 0 else "SiT lower"
        return (
            "equivalent" if max(abs(x) for x in out["ci"]) < EQUIVALENCE_PCT else "not significant"
        )
    if significant:
        return "gap grows" if out["effect"] < 0 else "gap shrinks"
    return "no change detected"


def gap_verdict(g: str, i: str) -> str:
    """The protocol's reading of ViT-5's advantage under REPA from the G and I test verdicts."""
    if g.startswith("pending") or i.startswith("pending"):
        return "pending"
    if g == "SiT lower":
        return "reverses"
    if g == "ViT-5 lower":
        return {"gap grows": "grows", "gap shrinks": "shrinks"}.get(i, "survives")
    if i == "gap shrinks" or g == "equivalent":
        return "vanishes"
    return "inconclusive"


def evaluate_repa(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every test with its statistics, Holm-adjusted p over the 12 (pending: p = 1) and verdict."""
    tests = family()
    outs = [evaluate_test(t, results) for t in tests]
    pending = [o["n"] < o["planned"] for o in outs]
    adjusted = holm([1.0 if pend else o.get("p", 1.0) for o, pend in zip(outs, pending)])
    return [
        {"test": t, **o, "p_holm": a, "verdict": verdict_of(t, o, a)}
        for t, o, a in zip(tests, outs, adjusted)
    ]


def speedup_verdict(verdicts: Sequence[str]) -> str:
    """The conjunction of the four held-out-loss R verdicts."""
    if any(v.startswith("pending") for v in verdicts):
        return "pending"
    if any(v.startswith("slower") for v in verdicts):
        return "no (slower)"
    if verdicts and all(v.startswith("yes") for v in verdicts):
        return "yes"
    return "inconclusive"


def _effect(row: dict[str, Any]) -> str:
    if "effect" not in row:
        return "–"
    lo, hi = row["ci"]
    return f"{_num(row['effect'])} % [{_num(lo, 1)}, {_num(hi, 1)}]"


def _line(row: dict[str, Any]) -> str:
    t = row["test"]
    return (
        f"{t.dataset} {t.name}: {_effect(row)}, p={_p(row.get('p'))}, Holm {_p(row['p_holm'])} "
        f"→ {row['verdict']}"
    )


def _curve_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out loss and digits-FID at every checkpoint, mean ± sd over seeds 0–2, per variant."""
    rows = []
    for d in DATASETS:
        for variant in (*PAIRS, *PAIRS.values()):
            runs = [r for r in _runs(results, d, variant) if r["seed"] in SEEDS]
            if not runs:
                continue
            row: dict[str, Any] = {"dataset": d, "variant": variant, "n": len(runs)}
            for s in sorted({int(k) for r in runs for k in r["checkpoints"]}):
                at = [r["checkpoints"][str(s)] for r in runs if str(s) in r["checkpoints"]]
                loss = [a["heldout_loss"] for a in at]
                fid = [a["digits_fid"] for a in at]
                row[f"loss@{s}"] = f"{statistics.fmean(loss):.4f}"
                row[f"FID@{s}"] = f"{statistics.fmean(fid):.1f}"
            align = [r["repa_loss_curve"][-1][1] for r in runs if r.get("repa_loss_curve")]
            row["final alignment loss"] = f"{statistics.fmean(align):.3f}" if align else "–"
            rows.append(row)
    return rows


def repa_report(
    results: Sequence[dict[str, Any]], out_dir: str | os.PathLike = RESULTS
) -> tuple[list[dict[str, Any]], list[str]]:
    """(the claim rows C8a and C8b for CLAIMS.md's table, the REPA section's markdown lines)."""
    from sit_vit5.experiments import report

    rows = evaluate_repa(results)
    r_loss = [r for r in rows if r["test"].kind == "R" and r["test"].metric == "loss"]
    r_fid = [r for r in rows if r["test"].kind == "R" and r["test"].metric == "fid"]
    gi = {(r["test"].kind, r["test"].dataset): r for r in rows if r["test"].kind in "GI"}
    done = sum(
        len([x for x in _runs(results, d, v) if x["seed"] in SEEDS])
        for d in DATASETS
        for v in (*PAIRS, *PAIRS.values())
    )
    setting = (
        f"digits feature network as the target (repa.encoder=digits), depth "
        f"{REPA_SETTINGS['repa.depth']}, projector {REPA_SETTINGS['repa.projector_dim']}, coeff "
        f"{REPA_SETTINGS['repa.coeff']}; seeds 0–2, both datasets; own Holm family (m = 12)"
    )
    gaps = {d: gap_verdict(gi[("G", d)]["verdict"], gi[("I", d)]["verdict"]) for d in DATASETS}
    claim_rows = [
        {
            "claim": "C8a REPA speeds up convergence (added 2026-12-02)",
            "paper": "REPA (Yu et al. 2025): SiT-XL/2 reaches SiT's 7M-step FID in ~400K steps "
            "(17.5×)",
            "our setting": setting
            + "; paired by seed; score = mean log held-out loss over the checkpoints",
            "runs done / planned": f"{done} / {4 * len(SEEDS) * len(DATASETS)}",
            "effect [95 % CI], p, Holm p → test verdict": "; ".join(map(_line, r_loss + r_fid)),
            "verdict": speedup_verdict([r["verdict"] for r in r_loss]),
        },
        {
            "claim": "C8b ViT-5's advantage under REPA (added 2026-12-02)",
            "paper": "(no published ViT-5 + REPA number)",
            "our setting": setting
            + "; G: ViT-5 + REPA vs SiT + REPA, I: gap with minus gap without REPA",
            "runs done / planned": f"{done} / {4 * len(SEEDS) * len(DATASETS)}",
            "effect [95 % CI], p, Holm p → test verdict": "; ".join(
                _line(gi[(k, d)]) for d in DATASETS for k in "GI"
            ),
            "verdict": "; ".join(f"{d}: {v}" for d, v in gaps.items()),
        },
    ]
    table = [
        {
            "test": r["test"].kind,
            "dataset": r["test"].dataset,
            "comparison": r["test"].name,
            "runs": f"{r['n']} / {r['planned']}",
            "effect [95 % CI]": _effect(r),
            "p": _p(r.get("p")),
            "Holm p": _p(r["p_holm"]),
            "verdict": r["verdict"],
        }
        for r in rows
    ]
    lines = [
        "## C8: REPA (addition of 2026-12-02)\n",
        f"Pre-registered in PROTOCOL.md (addition of 2026-12-02); its own Holm family of "
        f"{len(rows)} tests (pending = p 1); {spent(out_dir):.2f} of {REPA_BUDGET_CORE_HOURS:g} "
        "core-hours spent. R: REPA − reference, paired by seed, on the mean log metric over the "
        "checkpoints (× 100 ≈ %); G, I: final log held-out loss (Welch). Caveat: digits-FID is "
        "scored by the REPA target network "
        "on digits8; the held-out loss decides.\n",
        report.markdown_table(table, list(table[0])),
    ]
    curves = _curve_rows(results)
    if curves:
        lines += [
            "Means over seeds 0–2 at every checkpoint (the alignment loss: training log, last "
            "20-step mean; −1 = perfectly aligned):\n",
            report.markdown_table(curves, list(dict.fromkeys(k for r in curves for k in r))),
        ]
    return claim_rows, lines
