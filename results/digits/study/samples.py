"""Sample quality on the digits proxy (PROTOCOL.md, addition of 2026-12-04).

``plan_samples`` lists the addition's runs in their pre-registered order (the digits16 reruns, the main
pair's new seeds, the 5× longer arm); ``spent`` charges them to the addition's budget. The tests (families
S, L and T), the loss-vs-FID analysis, the checkpoint-by-checkpoint view of the main pair and the report section
are below them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .claims import MAIN_PAIR, evaluate_family
from .digits import (
    FIRST_SAMPLE_SEED,
    LONG,
    LONG_OF,
    LONG_STEPS,
    RERUN,
    RESULTS,
    RunSpec,
    cached_runs,
    copy_sample_grid,
    is_sample_run,
    run_cost,
    sample_grid_table,
)
from .stats import holm, power_two_sample, welch_contrast, welch_summary

#: The addition's budget (PROTOCOL.md): runs past it are not started.
SAMPLES_BUDGET_CORE_HOURS = 40.0
#: n per arm of the primary tests (the power analysis) and of the longer arm (the budget's largest).
N_PLANNED = {"digits16": 36, "digits8": 25}
N_LONG = 20
RERUN_SEEDS = (0, 1, 2)  # digits16 runs that predate the 16×16 network: no FID16


def plan_samples(datasets: Sequence[str] = ("digits8", "digits16"), results_dir: str | os.PathLike = RESULTS,
                 **common: Any) -> list[RunSpec]:
    """Every run of the addition in its order: (1) the digits16 reruns, (2) the new seeds of the main pair,
    seed by seed, digits16 before digits8, (3) the longer arm seed by seed (``LONG_STEPS`` steps)."""
    common = {**common, "results_dir": str(results_dir)}
    order: list[tuple[str, str, int, int | None]] = []
    if "digits16" in datasets:
        order += [("digits16", v, s, None) for s in RERUN_SEEDS for v in RERUN]
    for s in range(FIRST_SAMPLE_SEED, max(N_PLANNED.values())):
        order += [(d, v, s, None) for d in ("digits16", "digits8")
                  if d in datasets and s < N_PLANNED[d] for v in MAIN_PAIR]
    if "digits16" in datasets:
        order += [("digits16", v, s, LONG_STEPS) for s in range(N_LONG) for v in LONG]
    return [RunSpec(d, v, s, **{**common, **({"steps": steps} if steps else {})}) for d, v, s, steps in order]


def spent(results_dir: str | os.PathLike) -> float:
    """Core-hours this addition's complete runs recorded (training + evaluation, one thread each)."""
    return sum(run_cost(r) for r in cached_runs(results_dir) if r.get("complete") and is_sample_run(r))


# ------------------------------------------------------------------------ tests and verdicts

ALPHA = 0.05
FID_MARGIN = 100 * math.log(1.1)  # ±9.53 log-%: "equivalent within ±10 %" (PROTOCOL.md)
LOSS_MARGIN = 0.5  # % of held-out loss, the claims addition's rule
FRACTION_MARGIN = 2.0  # percentage points of precision / recall / accuracy


@dataclass(frozen=True)
class SampleTest:
    """One test of the addition: ViT-5 vs SiT on ``dataset`` in ``metric`` at the runs' final checkpoint.

    family: "S" (primary), "L" (trained longer) or "T" (secondary). metric: a checkpoint key
    (``digits_fid``, ``digits_fid16``, ``heldout_loss``, ``pixel_precision``, ``pixel_recall``,
    ``accuracy``, ``accuracy16``) or "gap change" (L3). long: read the 10k-step runs."""

    family: str
    name: str
    dataset: str
    metric: str
    n: int
    long: bool = False

    @property
    def scale(self) -> str:
        """How the effect is expressed: log-% (FID), % of SiT's mean (loss) or points (fractions)."""
        if "fid" in self.metric or self.metric == "gap change":
            return "log"
        return "relative" if self.metric == "heldout_loss" else "points"

    @property
    def lower_is_better(self) -> bool:
        return self.scale != "points"

    @property
    def margin(self) -> float:
        return {"log": FID_MARGIN, "relative": LOSS_MARGIN, "points": FRACTION_MARGIN}[self.scale]

    @property
    def margin_words(self) -> str:
        """The margin as the protocol names it in the verdict word (FID: ±10 %, not ±9.53 log-%)."""
        return {"log": "±10 %", "relative": "±0.5 %", "points": "±2 points"}[self.scale]


def sample_family() -> list[SampleTest]:
    """Families S (m = 2), L (m = 3) and T (m = 6) of PROTOCOL.md's addition of 2026-12-04."""
    n16, n8 = N_PLANNED["digits16"], N_PLANNED["digits8"]
    tests = [SampleTest("S", "S8: digits-FID (8×8 net)", "digits8", "digits_fid", n8),
             SampleTest("S", "S16: FID16 (16×16 net)", "digits16", "digits_fid16", n16),
             SampleTest("L", "L1: FID16 at 10k steps", "digits16", "digits_fid16", N_LONG, long=True),
             SampleTest("L", "L2: held-out loss at 10k steps", "digits16", "heldout_loss", N_LONG, long=True),
             SampleTest("L", "L3: log-FID16 gap, 10k minus 2k steps", "digits16", "gap change", N_LONG,
                        long=True)]
    for d, n in (("digits8", n8), ("digits16", n16)):
        tests += [SampleTest("T", f"pixel precision ({d})", d, "pixel_precision", n),
                  SampleTest("T", f"pixel recall ({d})", d, "pixel_recall", n),
                  SampleTest("T", f"class accuracy ({d})", d, "accuracy" if d == "digits8" else "accuracy16", n)]
    return tests


def run_metrics(results: Sequence[dict[str, Any]], dataset: str, backbone: str, n: int,
                long: bool = False) -> dict[int, dict[int, dict[str, float]]]:
    """Seed → step → the checkpoint metrics of ``backbone``'s complete runs, seeds 0 … n − 1 (``long``: its
    10k-step runs). A 2k-step run's rerun fills in the keys the committed run lacks (FID16, accuracy16, pixel
    numbers); the committed run's own numbers, its held-out loss among them, are kept."""
    name = LONG_OF[backbone] if long else backbone
    rerun = next(v for v, b in RERUN.items() if b == backbone)
    own: dict[int, dict[int, dict[str, float]]] = {}
    filled: dict[int, dict[int, dict[str, float]]] = {}
    for r in results:
        if not r.get("complete") or r["dataset"] != dataset or r["seed"] >= n:
            continue
        steps = {int(step): m for step, m in r["checkpoints"].items() if int(step) <= r["steps"]}
        if r["variant"] == name:
            own[r["seed"]] = steps
        elif r["variant"] == rerun and not long:
            filled[r["seed"]] = steps
    return {seed: {step: {**filled.get(seed, {}).get(step, {}), **m} for step, m in sorted(steps.items())}
            for seed, steps in sorted(own.items())}


def final_metrics(results: Sequence[dict[str, Any]], dataset: str, backbone: str, n: int,
                  long: bool = False) -> dict[int, dict[str, float]]:
    """Seed → the final checkpoint's metrics of ``backbone``'s runs (:func:`run_metrics`)."""
    return {seed: steps[max(steps)] for seed, steps in run_metrics(results, dataset, backbone, n, long).items()
            if steps}


def _group(test: SampleTest, results: Sequence[dict[str, Any]], backbone: str, long: bool | None = None,
           ) -> tuple[list[float], int]:
    """(the values of ``backbone`` in the test's units: log for FID; the number of complete runs)."""
    runs = final_metrics(results, test.dataset, backbone, test.n, test.long if long is None else long)
    key = "digits_fid16" if test.metric == "gap change" else test.metric
    values = [m[key] for _, m in sorted(runs.items()) if key in m]
    return ([math.log(v) for v in values] if "fid" in key else values), len(runs)


def evaluate_sample_test(test: SampleTest, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """n per arm, means and sds (in the test's units), the effect ViT-5 − SiT with its 95 % CI, Welch p, and
    whether planned runs are missing."""
    vit, n_vit = _group(test, results, MAIN_PAIR[1])
    sit, n_sit = _group(test, results, MAIN_PAIR[0])
    # a primary test needs its value from every planned run (reruns included); a secondary one counts
    # runs, since the runs older than this addition cannot have its pixel numbers
    have = min(n_vit, n_sit) if test.family == "T" else min(len(vit), len(sit))
    out: dict[str, Any] = {"n": [len(vit), len(sit)], "runs": [n_vit, n_sit], "planned": test.n,
                           "pending": have < test.n}
    if test.metric == "gap change":
        vit2, _ = _group(test, results, MAIN_PAIR[1], long=False)
        sit2, _ = _group(test, results, MAIN_PAIR[0], long=False)
        groups = [vit, sit, vit2, sit2]
        out["n"] = [len(g) for g in groups]
        if min(map(len, groups)) >= 2:
            c = welch_contrast(groups, [1, -1, -1, 1])
            out.update(effect=100 * c.estimate, ci=(100 * c.ci[0], 100 * c.ci[1]), p=c.p)
        return out
    if len(vit) >= 2 and len(sit) >= 2:
        out.update(welch_summary(vit, sit, 100 / statistics.fmean(sit) if test.scale == "relative" else 100.0))
    return out


def sample_verdict(test: SampleTest, out: dict[str, Any], adjusted: float) -> str:
    """The addition's verdict words (PROTOCOL.md, 2026-12-04) from the Holm-adjusted p."""
    if out["pending"]:
        return f"pending ({sum(out['runs'])} of {2 * test.n} runs)"
    if "p" not in out:
        return "inconclusive (fewer than 2 values per arm)"
    if adjusted < ALPHA:
        if test.metric == "gap change":
            return "the gap moves toward ViT-5" if out["effect"] < 0 else "the gap moves toward SiT"
        vit_better = (out["effect"] < 0) == test.lower_is_better
        return "ViT-5 better" if vit_better else "SiT better"
    if test.metric != "gap change" and max(abs(x) for x in out["ci"]) < test.margin:
        return f"equivalent within {test.margin_words}"
    return "inconclusive"


def claims_word(verdict: str) -> str:
    """The same verdict in the claims table's words (paper direction: ViT-5 better)."""
    if verdict.startswith(("pending", "inconclusive")):
        return verdict
    return {"ViT-5 better": "reproduced", "SiT better": "not reproduced (opposite)"}.get(
        verdict, "not reproduced (no effect)")


def evaluate_samples(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every test with its statistics, Holm-adjusted p within its family (pending = p 1) and verdict."""
    tests = sample_family()
    outs = [evaluate_sample_test(t, results) for t in tests]
    rows = []
    for fam in ("S", "L", "T"):
        idx = [i for i, t in enumerate(tests) if t.family == fam]
        adjusted = holm([1.0 if outs[i]["pending"] else outs[i].get("p", 1.0) for i in idx])
        rows += [{"test": tests[i], **outs[i], "p_holm": a, "verdict": sample_verdict(tests[i], outs[i], a)}
                 for i, a in zip(idx, adjusted)]
    return rows


# ----------------------------------------------------------------------------- the report section

#: The spread the power analysis used (pooled sd of log FID, PROTOCOL.md) where a test has < 2 values.
PLANNED_SD = {"digits16": 0.128, "digits8": 0.106}


def power_at(row: dict[str, Any]) -> str:
    """The power for a 10 % FID difference at the n in hand, from the pooled sd of the values in hand
    (the protocol's sd where a side has no spread yet), at α/m of the test's family ("–" below n = 2)."""
    test = row["test"]
    if test.scale != "log" or test.metric == "gap change":
        return "–"
    n = min(row["n"])
    if n < 2:
        return "–"
    sd = PLANNED_SD[test.dataset]
    if "sd" in row and n >= 2:
        sd = math.sqrt(sum(s * s for s in row["sd"]) / 2)
    m = sum(t.family == test.family for t in sample_family())
    return f"{power_two_sample(n, math.log(1.1), sd, ALPHA / m):.2f} (n={n}, sd {sd:.3f})"


def _effect(row: dict[str, Any]) -> str:
    if "effect" not in row:
        return "–"
    unit = {"log": " log-%", "relative": " %", "points": " pts"}[row["test"].scale]
    lo, hi = row["ci"]
    return f"{row['effect']:+.2f}{unit} [{lo:+.1f}, {hi:+.1f}]"


def _side(row: dict[str, Any], i: int) -> str:
    if "mean" not in row:
        return f"n={row['n'][i]}"
    mean, sd = row["mean"][i], row["sd"][i]
    if row["test"].scale == "log":  # the geometric mean and the sd of log FID
        return f"{math.exp(mean):.4g} (log sd {sd:.3f}, n={row['n'][i]})"
    return f"{mean:.4g} ± {sd:.2g} (n={row['n'][i]})"


def _p(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.2g}"


def _line(row: dict[str, Any]) -> str:
    return (f"{row['test'].name}: {_effect(row)}, p={_p(row.get('p'))}, Holm {_p(row['p_holm'])} → "
            f"{claims_word(row['verdict'])}")


def rerun_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The determinism check of the reruns: committed vs rerun held-out loss and 8×8-net FID at the end."""
    rows = []
    for rerun, base in RERUN.items():
        committed = {r["seed"]: r for r in results if r["dataset"] == "digits16" and r["variant"] == base}
        for r in sorted((r for r in results if r["dataset"] == "digits16" and r["variant"] == rerun),
                        key=lambda r: r["seed"]):
            old, new = committed[r["seed"]]["checkpoints"]["2000"], r["checkpoints"]["2000"]
            rows.append({"run": f"{base} seed {r['seed']}",
                         "held-out loss: committed / rerun": f"{old['heldout_loss']:.5f} / {new['heldout_loss']:.5f}",
                         "Δ": f"{100 * (new['heldout_loss'] / old['heldout_loss'] - 1):+.3f} %",
                         "FID (8×8 net): committed / rerun": f"{old['digits_fid']:.2f} / {new['digits_fid']:.2f}",
                         "FID16 (rerun)": f"{new['digits_fid16']:.2f}"})
    return rows


# (row label, dataset, FID key, 10k-step runs?, seeds read): the panels of the loss-against-FID scatter
LOSS_FID_PANELS = (("digits8", "digits8", "digits_fid", False, N_PLANNED["digits8"]),
                   ("digits16", "digits16", "digits_fid16", False, N_PLANNED["digits16"]),
                   ("digits16, 10k steps", "digits16", "digits_fid16", True, N_LONG))  # added 2026-12-05


def loss_fid_rows(results: Sequence[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """Spearman's ρ of final held-out loss against the primary FID inside each arm (and pooled), for each
    panel of :data:`LOSS_FID_PANELS`, and the per-run scatter ``samples_loss_vs_fid.png``."""
    from scipy import stats

    from sit_vit5.experiments import report

    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(LOSS_FID_PANELS), figsize=(5.5 * len(LOSS_FID_PANELS), 4))
    rows = []
    for ax, (label, d, key, long, n) in zip(axes, LOSS_FID_PANELS):
        pooled: list[tuple[float, float]] = []
        for i, backbone in enumerate(MAIN_PAIR):
            runs = final_metrics(results, d, backbone, n, long)
            pts = [(m["heldout_loss"], m[key]) for m in runs.values() if key in m]
            pooled += pts
            if pts:
                ax.scatter(*zip(*pts), color=f"C{i}", label=f"{backbone} (n={len(pts)})", s=18)
            rows.append(_spearman(label, backbone, pts, stats))
        rows.append(_spearman(label, "both arms pooled", pooled, stats))
        ax.set_title(label)
        ax.set_xlabel("final held-out loss")
        ax.set_ylabel("FID16 (16×16 net)" if key == "digits_fid16" else "digits-FID (8×8 net)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    report.save_figure(fig, out / "samples_loss_vs_fid.png")
    return rows


def same_start(results: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(pairs whose logged training losses are identical up to the 2k-step run's end, pairs): each complete
    10k-step run of the main pair against the complete 2k-step run of its seed and backbone."""
    short = {(r["variant"], r["seed"]): r for r in results if r.get("complete") and r["dataset"] == "digits16"}
    same = pairs = 0
    for r in results:
        base = LONG.get(r["variant"])
        if base is None or not r.get("complete") or (base, r["seed"]) not in short:
            continue
        prefix, longer = (dict(map(tuple, run["loss_curve"])) for run in (short[base, r["seed"]], r))
        pairs += 1
        same += all(longer.get(step) == loss for step, loss in prefix.items())
    return same, pairs


#: (runs, n per arm, line style) of the two run lengths in the checkpoint-by-checkpoint view
RUN_LENGTHS = ((False, N_PLANNED["digits16"], "--"), (True, N_LONG, "-"))
#: (metric key, its column and axis words, read in log?)
CURVE_METRICS = (("digits_fid16", "FID16", True), ("heldout_loss", "loss", False))


def checkpoint_curves(results: Sequence[dict[str, Any]]
                      ) -> dict[tuple[bool, str, str], list[tuple[int, float, float, int]]]:
    """(long, backbone, metric key) → [(step, mean, sd, n)] over the seeds of the main pair's digits16 runs,
    mean and sd in log for FID16."""
    curves = {}
    for long, n, _ in RUN_LENGTHS:
        for backbone in MAIN_PAIR:
            runs = run_metrics(results, "digits16", backbone, n, long)
            steps = sorted({step for seed_steps in runs.values() for step in seed_steps})
            for key, _, log in CURVE_METRICS:
                points = []
                for step in steps:
                    xs = [(math.log if log else float)(m[step][key]) for m in runs.values()
                          if key in m.get(step, {})]
                    if xs:
                        points.append((step, statistics.fmean(xs),
                                       statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs)))
                curves[long, backbone, key] = points
    return curves


def training_length_rows(results: Sequence[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """The main pair on digits16 checkpoint by checkpoint (:func:`checkpoint_curves`) as table rows: FID16
    as the geometric mean over seeds, held-out loss as the mean, each with its n, and ViT-5 / SiT of each; and
    the figure ``samples_training_length.png`` (± 1 seed sd; the ratios in a third panel). Descriptive: the L
    tests read the final checkpoints."""
    from sit_vit5.experiments import report

    curves = checkpoint_curves(results)
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    rows: dict[tuple[bool, int], dict[str, Any]] = {}
    for long, _, style in RUN_LENGTHS:
        runs = "10,000 steps" if long else "2,000 steps"
        for (key, word, log), ax in zip(CURVE_METRICS, axes):
            means = {}
            for i, backbone in enumerate(MAIN_PAIR):
                points = curves[long, backbone, key]
                for step, mean, _, n in points:
                    shown = f"{math.exp(mean):.2f}" if log else f"{mean:.4f}"
                    rows.setdefault((long, step), {"runs": runs, "step": step})[f"{backbone} {word}"] = (
                        f"{shown} (n={n})")
                    means.setdefault(step, {})[backbone] = mean
                if not points:
                    continue
                x, mean, sd, _ = zip(*points)
                back = math.exp if log else float
                ax.plot(x, [back(m) for m in mean], style, color=f"C{i}", marker="o", ms=3,
                        label=f"{backbone}, {runs}")
                ax.fill_between(x, [back(m - s) for m, s in zip(mean, sd)],
                                [back(m + s) for m, s in zip(mean, sd)], color=f"C{i}", alpha=0.12)
            ratios = [(step, math.exp(m[MAIN_PAIR[1]] - m[MAIN_PAIR[0]]) if log else m[MAIN_PAIR[1]] / m[MAIN_PAIR[0]])
                      for step, m in sorted(means.items()) if len(m) == 2]
            for step, ratio in ratios:
                rows[long, step][f"ViT-5 / SiT {word}"] = f"{ratio:.3f}"
            if ratios:
                axes[2].plot(*zip(*ratios), style, color="C2" if log else "C3", marker="o", ms=3,
                             label=f"{word}, {runs}")
    axes[2].axhline(1.0, color="grey", lw=0.8)
    labels = ("FID16 (16×16 net; geometric mean ± 1 sd)", "held-out loss (mean ± 1 sd)", "ViT-5 / SiT")
    axes[2].set_title("ratio of the arms (FID16: geometric means; loss: means)", fontsize=9)
    for ax, label in zip(axes, labels):
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle("digits16, main pair: sample quality and loss as training goes on (descriptive)")
    report.save_figure(fig, out / "samples_training_length.png")
    columns = ["runs", "step", *(f"{b} {word}" for _, word, _ in CURVE_METRICS for b in (*MAIN_PAIR, "ViT-5 / SiT"))]
    return [{c: row.get(c, "–") for c in columns} for _, row in sorted(rows.items(), key=lambda kv: kv[0][1])]


def _spearman(dataset: str, group: str, pts: Sequence[tuple[float, float]], stats: Any) -> dict[str, Any]:
    """ρ from 3 points on, its p from 5 (below that the permutation distribution has too few values)."""
    if len(pts) < 3:
        return {"dataset": dataset, "runs": group, "n": len(pts), "Spearman ρ (loss, FID)": "–", "p": "–"}
    rho, p = stats.spearmanr(*zip(*pts))
    return {"dataset": dataset, "runs": group, "n": len(pts), "Spearman ρ (loss, FID)": f"{rho:+.2f}",
            "p": _p(float(p)) if len(pts) >= 5 else "–"}


def featnet_lines(out: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The feature network's own variance (featnet check: FID16 by another network, at the last
    checkpoint) beside S16's effect."""
    paths = sorted(out.glob("featnet_check-digits16-*.json"))
    changes = []
    for path in paths:
        last = json.loads(path.read_text())["rows"][-2]  # the last checkpoint (the last row: real images)
        changes.append((path.name, 100 * math.log(last["FID16 two-thread"] / last["FID16 shipped"])))
    s16 = next(r for r in rows if r["test"].name.startswith("S16"))
    if not changes:
        return []
    effect = f"{s16['effect']:+.1f} log-%" if "effect" in s16 else "not yet estimable"
    return ["The feature network's own variance against the arm difference: another 16×16 network (the "
            "featnet check, two-thread retrain) moves FID16 at the last checkpoint by "
            + ", ".join(f"{c:+.2f} log-% ({name})" for name, c in changes)
            + f"; S16's effect (ViT-5 − SiT) is {effect}, its seed sd (log) "
            + (" / ".join(f"{100 * s:.1f}" for s in s16["sd"]) if "sd" in s16 else "–") + " log-%.\n"]


def samples_report(results: Sequence[dict[str, Any]], out_dir: str | os.PathLike = RESULTS
                   ) -> tuple[list[dict[str, Any]], list[str]]:
    """(the claim rows C9 and C9L for CLAIMS.md's table, the section's markdown lines)."""
    from sit_vit5.experiments import report

    out = Path(out_dir)
    rows = evaluate_samples(results)
    by = {fam: [r for r in rows if r["test"].family == fam] for fam in "SLT"}
    spent_h = spent(out)
    claim_rows = [
        {"claim": "C9 ViT-5 samples better (added 2026-12-04)",
         "paper": "FID-50K: ViT-5-XL 1.84 vs SiT-XL 2.06 (with CFG); 14.6 vs 17.2 at 400K steps without",
         "our setting": f"main pair 4×64, 2,000 steps; FID of the final checkpoint (digits8: 8×8 net, n = "
                        f"{N_PLANNED['digits8']}; digits16: 16×16 net, n = {N_PLANNED['digits16']} per arm, by a "
                        "power analysis: 80 % for 10 %); Welch on log FID; own Holm family (m = 2)",
         "runs done / planned": " / ".join(map(str, _done(by["S"]))),
         "effect [95 % CI], p, Holm p → test verdict": "; ".join(map(_line, by["S"])),
         "verdict": "; ".join(f"{r['test'].dataset}: {claims_word(r['verdict'])}" for r in by["S"])},
        {"claim": "C9L … and after 5× the training (added 2026-12-04)",
         "paper": "the gap “remains stable as training extends” (Fig. 6, 200K–400K steps)",
         "our setting": f"the main pair on digits16 for 10,000 steps, n = {N_LONG} per arm (the budget's largest; "
                        "45 % power for 10 %); own Holm family (m = 3)",
         "runs done / planned": " / ".join(map(str, _done(by["L"][:1]))),
         "effect [95 % CI], p, Holm p → test verdict": "; ".join(map(_line, by["L"])),
         "verdict": "; ".join(f"{r['test'].name.split(':')[0]}: {r['verdict']}" for r in by["L"])},
    ]
    table = [{"family": r["test"].family, "dataset": r["test"].dataset, "test (ViT-5 vs SiT)": r["test"].name,
              "ViT-5": _side(r, 0) if r["test"].metric != "gap change" else f"n={r['n']}",
              "SiT": _side(r, 1) if r["test"].metric != "gap change" else "–",
              "effect [95 % CI]": _effect(r), "Welch p": _p(r.get("p")), "Holm p (own family)": _p(r["p_holm"]),
              "power for 10 % at this n": power_at(r), "verdict": r["verdict"]} for r in rows]
    lines = [
        "## C9: sample quality (addition of 2026-12-04)\n",
        f"Pre-registered in PROTOCOL.md (addition of 2026-12-04) before any of its runs; {spent_h:.1f} of "
        f"{SAMPLES_BUDGET_CORE_HOURS:g} core-hours spent. Three Holm families: S (primary, m = 2), L (trained "
        "longer, m = 3), T (secondary, m = 6); pending tests count as p = 1 and are shown, not judged. FID "
        "effects: 100 × (mean log FID of ViT-5 − of SiT) ≈ %, sides as geometric means; loss: % of SiT's mean; "
        "precision / recall / accuracy: percentage points. *ViT-5 better* / *SiT better*: Holm p < 0.05; "
        "*equivalent within ±m*: the 95 % CI inside ±m (FID ±9.53 log-% = ±10 %, loss ±0.5 %, fractions ±2 "
        "points). Power: for a 10 % FID difference at the n in hand, α / m.\n",
        report.markdown_table(table, list(table[0])),
    ]
    reruns = rerun_rows(results)
    if reruns:
        lines += ["Reruns of the digits16 seeds that predate the 16×16 network (same settings and seed; their "
                  "FID16 enters S16, the committed loss stays the reported one):\n",
                  report.markdown_table(reruns, list(reruns[0]))]
    corr = loss_fid_rows(results, out)
    lines += ["### Held-out loss against FID, run by run (descriptive)\n",
              "Final checkpoints; the digits16 rows are the 2,000-step runs. The 10k-step rows (the L arm's "
              "runs at 10,000 steps) were added on 2026-12-05, after those runs were read: exploratory.\n",
              report.markdown_table(corr, list(corr[0])), "![held-out loss vs FID](samples_loss_vs_fid.png)\n",
              *featnet_lines(out, rows)]
    length = training_length_rows(results, out)
    if length:
        lines += ["### Checkpoint by checkpoint, 2k- and 10k-step runs (descriptive)\n",
                  "The main pair on digits16 at every checkpoint of its runs: FID16 as the geometric mean over "
                  "seeds, held-out loss as the mean; n seeds beside each. A 10k-step run trains as the 2k-step "
                  "run of its seed up to step 2,000 (constant lr): their logged training losses there are "
                  "identical in {} of {} pairs.\n".format(*same_start(results)),
                  report.markdown_table(length, list(length[0])),
                  "![FID16 and loss against training step](samples_training_length.png)\n"]
    for variant in (*MAIN_PAIR, *LONG):
        copy_sample_grid(results, "digits16", variant, out)
    grids = sample_grid_table(out, {b: {"2,000 steps": ("digits16", b),
                                        f"{LONG_STEPS:,} steps": ("digits16", LONG_OF[b])} for b in MAIN_PAIR})
    if grids:
        lines += ["Seed 0 of each arm on digits16, after 2,000 and after 10,000 steps: the training grid of 40 "
                  "samples (ODE Euler, 50 steps, no guidance) from the same fixed noise and classes, so a cell "
                  "is the same noise in all four.\n", grids]
    return claim_rows, lines


def _done(rows: Sequence[dict[str, Any]]) -> tuple[int, int]:
    return sum(sum(r["runs"]) for r in rows), sum(2 * r["test"].n for r in rows)


# ----------------------------------------------------------------------------- the bottom line

BOTTOM_LINE_MARKERS = ("<!-- digits bottom line: generated by python results/digits/study --report-only -->",
                       "<!-- end of the digits bottom line -->")
#: the manual page that quotes the bottom line between the markers (relative to the repository root)
COMPARISON_PAGE = "docs/comparison.md"
XL_COMMANDS = """\
```bash
accelerate launch --num_processes 8 -m sit_vit5.cache_latents --data-dir /data/imagenet/train \\
    --out /data/in256_latents --vae stabilityai/sd-vae-ft-ema --image-size 256
for b in sit vit5; do  # the SiT recipe, 400K steps, fp32 (TF32), one config each, differing only in the backbone
  torchrun --nproc_per_node 8 train.py --config configs/imagenet/$b-xl-2.yaml \\
      data.kind=latents data.root=/data/in256_latents
done
# FID-50K every 50K steps: SDE Euler, sigma diffusion, 250 steps, no CFG, against ADM's reference batch
torchrun --nproc_per_node 8 -m sit_vit5.experiments imagenet runs/imagenet/sit-xl-2 runs/imagenet/vit5-xl-2 \\
    --protocol configs/eval/scaling.yaml --reference VIRTUAL_imagenet256_labeled.npz
```"""


def _say(row: dict[str, Any]) -> str:
    """One test in words: effect, CI, n per arm, raw and Holm p, and its verdict (or how far it is)."""
    if "effect" not in row:
        return f"not estimable yet ({row['verdict']})"
    verdict = row["verdict"] if not row["verdict"].startswith("pending") else (
        f"interim, {row['verdict']}: not judged")
    scale = row["test"].scale  # loss effects are ~1 %: two decimals
    unit, decimals = {"log": (" log-%", 1), "relative": (" %", 2), "points": (" points", 1)}[scale]
    return (f"{row['effect']:+.{decimals}f}{unit} [{row['ci'][0]:+.1f}, {row['ci'][1]:+.1f}] "
            f"(ViT-5 − SiT; n = {row['n'][0]} / {row['n'][1]}, p {_p(row.get('p'))}, Holm {_p(row['p_holm'])}; "
            f"{verdict})")


def bottom_line(results: Sequence[dict[str, Any]]) -> str:
    """The paragraph users read first (results/digits/README.md and docs/comparison.md): what the proxy shows
    in loss and in samples, with n and corrected p, and what only a GPU run can settle."""
    loss = {r["test"].dataset: r for r in evaluate_family(results) if r["test"].name == "ViT-5 (γ0=1) vs SiT"}
    evaluated = evaluate_samples(results)
    s = {r["test"].dataset: r for r in evaluated if r["test"].family == "S"}
    long = {r["test"].name[:2]: r for r in evaluated if r["test"].family == "L"}
    secondary = [r for r in evaluated if r["test"].family == "T"]
    words = {"ViT-5 better": "ViT-5 samples better", "SiT better": "**SiT samples better**"}
    metric = {"digits8": "FID", "digits16": "FID16"}
    judged = [f"{d} {metric[d]}: {words.get(s[d]['verdict'], s[d]['verdict'])}" for d in ("digits8", "digits16")
              if not s[d]["verdict"].startswith("pending")]
    verdicts = ("Verdicts: " + "; ".join(judged) + ". ") if judged else ""
    # issue 55: FID is one measure; the same checkpoints' secondary family (T) goes beside it
    family_t = ("The same checkpoints' secondary tests (family T, its own Holm, m = "
                f"{len(secondary)}): " + "; ".join(f"{r['test'].name} {_say(r)}" for r in secondary)
                + ". ") if secondary else ""
    for d in ("digits8", "digits16"):
        sides = {side: [r["test"].name.split(" (")[0] for r in secondary
                        if r["test"].dataset == d and r["verdict"] == side]
                 for side in ("ViT-5 better", "SiT better")}
        if s[d]["verdict"].startswith("equivalent") and any(sides.values()):
            family_t += (f"So on {d} only {metric[d]} is equivalent: "
                         + " and ".join(f"{side.split()[0]} is better in {', '.join(names)}"
                                        for side, names in sides.items() if names) + ". ")
    return "\n".join([
        BOTTOM_LINE_MARKERS[0],
        "**Bottom line of the digits proxy** (4-block, 64-wide models, 2,000 steps, CPU; generated from the "
        "committed runs). *In loss*, ViT-5 (γ0 = 1) beats SiT: held-out flow-matching loss "
        + " and ".join(f"{loss[d]['effect']:+.2f} % on {d} (n = {loss[d]['n'][0]} per arm, Holm p "
                       f"{_p(loss[d]['p_holm'])})" if "effect" in loss[d] else f"not estimable yet on {d}"
                       for d in ("digits8", "digits16"))
        + ". *In samples*, the pre-registered test (FID of the same final checkpoints, Welch on log FID, its "
        "own Holm family; n = 25 / 36 per arm for 80 % power at a 10 % difference) reads: digits8 FID by the "
        f"8×8 network {_say(s['digits8'])}; digits16 FID16 by the 16×16 network {_say(s['digits16'])}. "
        + verdicts + family_t + f"After 5× the training (digits16, n = {N_LONG} per arm): FID16 {_say(long['L1'])}; "
        f"held-out loss {_say(long['L2'])}. "
        "A proxy this small cannot say whether ViT-5-XL/2 samples better than SiT-XL/2 on ImageNet 256 "
        "(FID-50K without guidance at 400K steps: 17.2 for SiT, ≈ 14.6 for ViT-5 read off the paper's figure; "
        "1.84 vs 2.06 at 7M steps with guidance); only a GPU run settles that, one recipe and one evaluator:",
        "",
        XL_COMMANDS,
        BOTTOM_LINE_MARKERS[1],
    ])


def update_marked_block(path: str | os.PathLike, block: str) -> bool:
    """Replace the text between ``BOTTOM_LINE_MARKERS`` in ``path`` by ``block`` (which carries the markers);
    False (and nothing written) when the file has no such block."""
    path = Path(path)
    text = path.read_text()
    start, end = (text.find(m) for m in BOTTOM_LINE_MARKERS)
    if start < 0 or end < start:
        return False
    path.write_text(text[:start] + block + text[end + len(BOTTOM_LINE_MARKERS[1]):])
    return True
