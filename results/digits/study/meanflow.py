"""One step: ViT-5 vs SiT as MeanFlow models on the digits proxy (PROTOCOL.md, addition of 2026-12-06).

``plan_meanflow`` lists the addition's runs in their pre-registered order: the pilot (seeds 900–902) alone until
``meanflow_pilot.json`` fixes n per dataset (``write_pilot``, from the pilot's spread), then the two meanflow arms
seed by seed and the retrained flow references. ``spent`` charges them to the addition's budget. The tests
(families M and N) reuse the sample-quality addition's statistics, verdict words and formatting; only the gap
contrast and its words are new. ``meanflow_report`` is the section and claim row of ``CLAIMS.md``.
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

from .digits import (
    FLOW_REFERENCES,
    MEANFLOW_ARMS,
    MEANFLOW_NFES,
    MEANFLOW_VARIANTS,
    RESULTS,
    RunSpec,
    cached_runs,
    run_cost,
)
from .samples import ALPHA, FID_MARGIN, SampleTest, _effect, _p, _side, sample_verdict
from .stats import holm, n_for_power, power_two_sample, welch_contrast, welch_summary

MEANFLOW_BUDGET_CORE_HOURS = 50.0
PILOT_SEEDS = (900, 901, 902)
N_MIN, N_MAX = 10, 40  # the floor and cap of n per arm (PROTOCOL.md)
N_REFERENCES = 10  # flow references per arm and dataset (seeds 0–9)
PILOT_FILE = "meanflow_pilot.json"
PLANNED_ALPHA = ALPHA / 2  # the first Holm step of family M (m = 2)
TEN_PERCENT = math.log(1.1)
#: the primary FID of each dataset (digits16: the 16×16 network) and its class accuracy
FID_KEY = {"digits8": "digits_fid", "digits16": "digits_fid16"}
ACCURACY_KEY = {"digits8": "accuracy", "digits16": "accuracy16"}
DATASET_ORDER = ("digits16", "digits8")  # the addition's order: digits16 first, seed by seed
#: (ViT-5, SiT): the order of every effect, as the other additions (ViT-5 − SiT)
ARMS = ("ViT-5 (γ0=1) (meanflow)", "SiT (meanflow)")
REFERENCES = ("ViT-5 (γ0=1) (flow reference)", "SiT (flow reference)")
assert set(ARMS) == set(MEANFLOW_ARMS) and set(REFERENCES) == set(FLOW_REFERENCES)
assert all(MEANFLOW_ARMS[a] == FLOW_REFERENCES[r] for a, r in zip(ARMS, REFERENCES))  # pairs of one backbone


# ------------------------------------------------------------------------------------- plan and budget

def read_pilot(results_dir: str | os.PathLike = RESULTS) -> dict[str, Any] | None:
    """The committed pilot reading (``meanflow_pilot.json``: n per dataset and the numbers behind it), or None
    while the pilot has not been read."""
    path = Path(results_dir) / PILOT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def plan_meanflow(datasets: Sequence[str] = ("digits8", "digits16"), results_dir: str | os.PathLike = RESULTS,
                  **common: Any) -> list[RunSpec]:
    """The addition's runs in order: (1) the pilot, seed by seed, digits16 then digits8; once the pilot file
    fixes n: (2) the meanflow arms seed by seed from 0, digits16 then digits8 while the seed is below that
    dataset's n, (3) the flow references, seeds 0 … ``N_REFERENCES`` − 1, digits16 then digits8. Without the
    pilot file only (1) is planned: no test run starts before n is fixed."""
    common = {**common, "results_dir": str(results_dir)}
    order = [d for d in DATASET_ORDER if d in datasets]
    specs = [RunSpec(d, v, s, **common) for s in PILOT_SEEDS for d in order for v in reversed(ARMS)]
    pilot = read_pilot(results_dir)
    if pilot is None:
        return specs
    n = {d: pilot["n"].get(d, 0) for d in order}  # a dataset the pilot did not read: none of its runs
    specs += [RunSpec(d, v, s, **common) for s in range(max(n.values(), default=0))
              for d in order if s < n[d] for v in reversed(ARMS)]
    specs += [RunSpec(d, v, s, **common) for s in range(N_REFERENCES) for d in order for v in reversed(REFERENCES)]
    return specs


def spent(results_dir: str | os.PathLike) -> float:
    """Core-hours this addition's runs recorded (training + evaluation, one thread each; the pilot included)."""
    return sum(run_cost(r) for r in cached_runs(results_dir) if r["variant"] in MEANFLOW_VARIANTS)


def pooled_sd(groups: Sequence[Sequence[float]]) -> float:
    """The pooled standard deviation of several groups (their variances weighted by degrees of freedom)."""
    df = sum(len(g) - 1 for g in groups)
    return math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in groups) / df)


def n_per_arm(sd: float) -> int:
    """The protocol's n: 80 % power for a 10 % FID difference at α = 0.025, at least ``N_MIN``, at most
    ``N_MAX``."""
    if power_two_sample(N_MAX, TEN_PERCENT, sd, PLANNED_ALPHA) < 0.8:  # the cap binds: no need to search on
        return N_MAX
    return max(N_MIN, n_for_power(TEN_PERCENT, sd, PLANNED_ALPHA, 0.8, n_max=N_MAX))


def pilot_reading(results: Sequence[dict[str, Any]], datasets: Sequence[str]) -> dict[str, Any] | None:
    """n per dataset from the complete pilot runs (every pilot run of ``datasets`` must be there, else None):
    the pooled sd of log FID (the dataset's primary key, 1 NFE) of the two arms, and the FIDs behind it."""
    pilot = {(r["dataset"], r["variant"], r["seed"]): r for r in results
             if r.get("complete") and r["variant"] in ARMS and r["seed"] in PILOT_SEEDS}
    if any((d, v, s) not in pilot for d in datasets for v in ARMS for s in PILOT_SEEDS):
        return None
    out: dict[str, Any] = {"n": {}, "pooled_sd": {}, "fid": {}, "alpha": PLANNED_ALPHA, "power": 0.8,
                           "difference": "10 %", "n_min": N_MIN, "n_max": N_MAX}
    for d in datasets:
        fids = {v: [final(pilot[d, v, s]).get(FID_KEY[d], math.nan) for s in PILOT_SEEDS] for v in ARMS}
        if any(not math.isfinite(x) for values in fids.values() for x in values):
            sd = math.inf  # a diverged pilot run: no spread to plan with, so the cap
        else:
            sd = pooled_sd([[math.log(x) for x in values] for values in fids.values()])
        out["fid"][d], out["pooled_sd"][d] = fids, sd
        out["n"][d] = N_MAX if not math.isfinite(sd) else n_per_arm(sd)
        out[f"power at n ({d})"] = (power_two_sample(out["n"][d], TEN_PERCENT, sd, PLANNED_ALPHA)
                                    if math.isfinite(sd) else None)
    return out


def write_pilot(results_dir: str | os.PathLike, datasets: Sequence[str]) -> Path | None:
    """Write ``meanflow_pilot.json`` once the pilot is complete (never over an existing one: n is fixed once);
    None while a pilot run is missing or when the file exists."""
    path = Path(results_dir) / PILOT_FILE
    if path.is_file():
        return None
    reading = pilot_reading(cached_runs(results_dir), datasets)
    if reading is None:
        return None
    path.write_text(json.dumps(reading, indent=1) + "\n")
    return path


def final(run: dict[str, Any]) -> dict[str, float]:
    """A run's final-checkpoint metrics ({} for a run that diverged before it)."""
    return run.get("checkpoints", {}).get(str(run["steps"]), {})


# ------------------------------------------------------------------------------------- tests and verdicts

@dataclass(frozen=True)
class MeanFlowTest(SampleTest):
    """A test of families M and N: ``metric`` a checkpoint key at ``nfe`` NFE of the meanflow arms, or
    ``gap`` = the contrast of log FID against the flow references at SDE-250."""

    nfe: int = 1

    @property
    def key(self) -> str:
        """The checkpoint key read (a 1-NFE value is unsuffixed; gap: the dataset's FID key)."""
        key = FID_KEY[self.dataset] if self.metric == "gap" else self.metric
        return key if self.nfe == MEANFLOW_NFES[0] else f"{key}_nfe{self.nfe}"

    @property
    def scale(self) -> str:
        return "log" if self.metric == "gap" else super().scale


def meanflow_family(n: dict[str, int | None]) -> list[MeanFlowTest]:
    """Families M (m = 2) and N (m = 6) of PROTOCOL.md's addition of 2026-12-06; ``n``: n per arm of each
    dataset (None before the pilot fixed it)."""
    tests = [MeanFlowTest("M", "M8: digits-FID at 1 NFE", "digits8", "digits_fid", n["digits8"]),
             MeanFlowTest("M", "M16: FID16 at 1 NFE", "digits16", "digits_fid16", n["digits16"])]
    for d, tag in (("digits8", "8"), ("digits16", "16")):
        tests += [MeanFlowTest("N", f"N{tag}-2: {FID_KEY[d].replace('digits_fid', 'FID')} at 2 NFE", d,
                               FID_KEY[d], n[d], nfe=2),
                  MeanFlowTest("N", f"N{tag}-gap: log FID, 1 NFE minus the flow model's SDE-250", d, "gap", n[d]),
                  MeanFlowTest("N", f"N{tag}-acc: class accuracy at 1 NFE", d, ACCURACY_KEY[d], n[d])]
    return tests


def arm_values(results: Sequence[dict[str, Any]], dataset: str, variant: str, key: str, n: int | None,
               final_sample: str | None = None) -> tuple[list[float], int]:
    """(the values of ``key`` at the final checkpoint of ``variant``'s complete runs of seeds 0 … n − 1, the
    number of those runs: a diverged run counts, without a value). ``final_sample``: read the run's
    final-checkpoint extra samples of that label (the references' ``sde250``) instead."""
    runs = [r for r in results if r.get("complete") and r["dataset"] == dataset and r["variant"] == variant
            and 0 <= r["seed"] < (n or 0)]
    metrics = [r.get("final_samples", {}).get(final_sample, {}) if final_sample else final(r) for r in runs]
    return [m[key] for m in metrics if key in m and math.isfinite(m[key])], len(runs)


def evaluate_meanflow_test(test: MeanFlowTest, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """n per arm, means and sds (log for FID), the effect ViT-5 − SiT with its 95 % CI and Welch p (gap: the
    four-group contrast), and whether planned runs are missing."""
    n = test.n
    arms = [arm_values(results, test.dataset, v, test.key, n) for v in ARMS]
    if test.scale == "log":
        arms = [([math.log(x) for x in values], runs) for values, runs in arms]
    (vit, n_vit), (sit, n_sit) = arms
    out: dict[str, Any] = {"n": [len(vit), len(sit)], "runs": [n_vit, n_sit], "planned": n,
                           "pending": n is None or min(n_vit, n_sit) < n}
    if test.metric == "gap":
        refs = [arm_values(results, test.dataset, v, FID_KEY[test.dataset], N_REFERENCES, "sde250")
                for v in REFERENCES]
        (ref_vit, r_vit), (ref_sit, r_sit) = [([math.log(x) for x in values], runs) for values, runs in refs]
        out.update(n=[len(vit), len(ref_vit), len(sit), len(ref_sit)], runs=[n_vit, n_sit, r_vit, r_sit])
        out["pending"] = out["pending"] or min(r_vit, r_sit) < N_REFERENCES
        groups = [vit, ref_vit, sit, ref_sit]
        out["ratio"] = [math.exp(statistics.fmean(a) - statistics.fmean(b)) if a and b else None
                        for a, b in ((vit, ref_vit), (sit, ref_sit))]  # FID(1 NFE) / FID(SDE-250), geometric
        if min(map(len, groups)) >= 2:
            c = welch_contrast(groups, [1, -1, -1, 1])
            out.update(effect=100 * c.estimate, ci=(100 * c.ci[0], 100 * c.ci[1]), p=c.p)
        return out
    if len(vit) >= 2 and len(sit) >= 2:
        out.update(welch_summary(vit, sit, 100.0))
    return out


def meanflow_verdict(test: MeanFlowTest, out: dict[str, Any], adjusted: float) -> str:
    """The addition's words: the sample-quality addition's for M and N-2 / N-acc; the gap's own."""
    if out["pending"]:
        planned = "?" if test.n is None else (2 * test.n + (2 * N_REFERENCES if test.metric == "gap" else 0))
        return f"pending ({sum(out['runs'])} of {planned} runs)"
    if test.metric != "gap":
        return sample_verdict(test, out, adjusted)
    if "p" not in out:
        return "inconclusive (fewer than 2 values per group)"
    if adjusted < ALPHA:
        return "ViT-5 loses less" if out["effect"] < 0 else "SiT loses less"
    return "inconclusive"


def evaluate_meanflow(results: Sequence[dict[str, Any]], n: dict[str, int | None]) -> list[dict[str, Any]]:
    """Every test with its statistics, Holm-adjusted p within its family (pending = p 1) and verdict."""
    tests = meanflow_family(n)
    outs = [evaluate_meanflow_test(t, results) for t in tests]
    rows = []
    for fam in ("M", "N"):
        idx = [i for i, t in enumerate(tests) if t.family == fam]
        adjusted = holm([1.0 if outs[i]["pending"] else outs[i].get("p", 1.0) for i in idx])
        rows += [{"test": tests[i], **outs[i], "p_holm": a, "verdict": meanflow_verdict(tests[i], outs[i], a)}
                 for i, a in zip(idx, adjusted)]
    return rows


def planned_n(pilot: dict[str, Any] | None) -> dict[str, int | None]:
    """Each dataset's n per arm as the committed pilot fixed it (None before the pilot is read)."""
    return {d: (pilot or {}).get("n", {}).get(d) for d in DATASET_ORDER}


def answer(rows: Sequence[dict[str, Any]]) -> str:
    """The README's one line: which backbone wins at 1 NFE (M8 and M16 as written; "neither" when both are
    equivalent or inconclusive)."""
    m = {r["test"].dataset: r["verdict"] for r in rows if r["test"].family == "M"}
    if any(v.startswith("pending") for v in m.values()):
        return "not answered yet: " + "; ".join(f"{d} {v}" for d, v in m.items())
    winners = {v for v in m.values() if v in ("ViT-5 better", "SiT better")}
    if not winners:
        return "neither (" + "; ".join(f"{d}: {v}" for d, v in m.items()) + ")"
    return "; ".join(f"{d}: {v}" for d, v in m.items())


# ------------------------------------------------------------------------------------- the report section

def _power(row: dict[str, Any], sd_planned: float | None) -> str:
    """Power for a 10 % difference at the n in hand (pooled sd in hand, else the pilot's), α / m."""
    test = row["test"]
    if test.scale != "log" or test.metric == "gap" or min(row["n"]) < 2:
        return "–"
    sd = math.sqrt(sum(s * s for s in row["sd"]) / 2) if "sd" in row else sd_planned
    if not sd or not math.isfinite(sd):
        return "–"
    m = 2 if test.family == "M" else 6
    return f"{power_two_sample(min(row['n']), TEN_PERCENT, sd, ALPHA / m):.2f} (n={min(row['n'])}, sd {sd:.3f})"


def _line(row: dict[str, Any]) -> str:
    return f"{row['test'].name}: {_effect(row)}, p={_p(row.get('p'))}, Holm {_p(row['p_holm'])} → {row['verdict']}"


def nfe_rows(results: Sequence[dict[str, Any]], n: dict[str, int | None]) -> list[dict[str, Any]]:
    """Described: per dataset and arm, the geometric-mean FID at 1, 2 and 4 NFE and the mean held-out loss at
    r = t (final checkpoints, seeds 0 … n − 1), beside the flow references' SDE-250 FID and held-out loss."""
    rows = []
    for d in DATASET_ORDER:
        key = FID_KEY[d]
        for arm, ref in zip(ARMS, REFERENCES):
            row: dict[str, Any] = {"dataset": d, "backbone": MEANFLOW_ARMS[arm]}
            for k in MEANFLOW_NFES:
                values, _ = arm_values(results, d, arm, key if k == MEANFLOW_NFES[0] else f"{key}_nfe{k}", n[d])
                row[f"FID @ {k} NFE"] = _geo(values)
            sde, _ = arm_values(results, d, ref, key, N_REFERENCES, "sde250")
            row["flow SDE-250"] = _geo(sde)
            loss, _ = arm_values(results, d, arm, "heldout_loss", n[d])
            ref_loss, _ = arm_values(results, d, ref, "heldout_loss", N_REFERENCES)
            row["held-out loss (r = t) / flow"] = (f"{statistics.fmean(loss):.4f} / {statistics.fmean(ref_loss):.4f}"
                                                  if loss and ref_loss else "–")
            rows.append(row)
    return rows


def _geo(values: Sequence[float]) -> str:
    return f"{math.exp(statistics.fmean(map(math.log, values))):.3g} (n={len(values)})" if values else "–"


def reference_check_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each flow reference against the committed flow run of its seed: final held-out loss and 8×8-net FID."""
    flow = set(FLOW_REFERENCES.values())
    committed = {(r["dataset"], r["variant"], r["seed"]): r for r in results if r["variant"] in flow}
    rows = []
    for r in sorted((r for r in results if r["variant"] in FLOW_REFERENCES and r.get("complete")),
                    key=lambda r: (r["dataset"], r["variant"], r["seed"])):
        base = committed.get((r["dataset"], FLOW_REFERENCES[r["variant"]], r["seed"]))
        if base is None or not final(r):
            continue
        old, new = final(base), final(r)
        rows.append({"run": f"{r['dataset']} {FLOW_REFERENCES[r['variant']]} seed {r['seed']}",
                     "held-out loss: committed / reference": f"{old['heldout_loss']:.5f} / {new['heldout_loss']:.5f}",
                     "Δ": f"{100 * (new['heldout_loss'] / old['heldout_loss'] - 1):+.3f} %",
                     "FID (8×8 net): committed / reference": f"{old['digits_fid']:.2f} / {new['digits_fid']:.2f}"})
    return rows


def grid_table(results: Sequence[dict[str, Any]], out: Path) -> str:
    """Seed 0's grids (1, 2, 4 NFE of each meanflow arm; UniPC-8 and SDE-250 of its flow reference), copied
    into ``out`` when the run folders still have them; a markdown table of those present ("" when none)."""
    import shutil

    from sit_vit5.experiments import report

    from .digits import slug

    rows, found = [], False
    for d in DATASET_ORDER:
        for arm, ref in zip(ARMS, REFERENCES):
            row = {"dataset": d, "backbone": MEANFLOW_ARMS[arm]}
            for variant in (arm, ref):
                run = next((r for r in results if r["dataset"] == d and r["variant"] == variant and r["seed"] == 0
                            and r.get("grids")), None)
                for label, path in (run or {}).get("grids", {}).items():
                    name = f"meanflow-{d}-{slug(variant)}-{slug(label)}.png"
                    if Path(path).is_file():
                        shutil.copy(path, out / name)
                    present = (out / name).is_file()
                    found |= present
                    row[label] = f"![{label}]({name})" if present else "–"
            rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return report.markdown_table(rows, columns) if found else ""


def meanflow_report(results: Sequence[dict[str, Any]], out_dir: str | os.PathLike = RESULTS
                    ) -> tuple[list[dict[str, Any]], list[str]]:
    """(the claim row C10 for CLAIMS.md's table, the section's markdown lines)."""
    from sit_vit5.experiments import report

    out = Path(out_dir)
    pilot = read_pilot(out)
    n = planned_n(pilot)
    rows = evaluate_meanflow(results, n)
    primary = [r for r in rows if r["test"].family == "M"]
    done = sum(sum(r["runs"]) for r in primary)
    planned = "?" if None in n.values() else sum(2 * v for v in n.values())
    claim_row = {
        "claim": "C10 ViT-5's standing at 1 NFE, as MeanFlow models (added 2026-12-06)",
        "paper": "ViT-5 as a drop-in backbone for any generation stack (not tested there with one-step models)",
        "our setting": "both backbones as MeanFlow models (4×64, 2,000 steps, no guidance), 1-NFE FID of the final "
                       f"checkpoint (digits8: 8×8 net; digits16: FID16), n = {n['digits8']} / {n['digits16']} per "
                       "arm from the pilot; Welch on log FID; own Holm family (m = 2)",
        "runs done / planned": f"{done} / {planned}",
        "effect [95 % CI], p, Holm p → test verdict": "; ".join(map(_line, primary)),
        "verdict": answer(rows),
    }
    sd = (pilot or {}).get("pooled_sd", {})
    nfe = nfe_rows(results, n)
    table = [{"family": r["test"].family, "dataset": r["test"].dataset, "test (ViT-5 vs SiT)": r["test"].name,
              "ViT-5": _side(r, 0) if r["test"].metric != "gap" else f"n={r['n']}",
              "SiT": _side(r, 1) if r["test"].metric != "gap" else "ratio 1 NFE / SDE-250: " + " / ".join(
                  "–" if x is None else f"{x:.2f}" for x in r.get("ratio", [None, None])) + " (ViT-5 / SiT)",
              "effect [95 % CI]": _effect(r), "Welch p": _p(r.get("p")), "Holm p (own family)": _p(r["p_holm"]),
              "power for 10 % at this n": _power(r, sd.get(r["test"].dataset)), "verdict": r["verdict"]}
             for r in rows]
    pilot_line = ("The pilot has not been read yet (seeds 900–902 of both arms on both datasets): n is not fixed "
                  "and every test reads pending.\n" if pilot is None else
                  "Pilot (seeds 900–902, excluded from the tests): pooled sd of log FID "
                  + "; ".join(f"{d} {pilot['pooled_sd'][d]:.3f} → n = {pilot['n'][d]} per arm"
                              for d in DATASET_ORDER if d in pilot["n"]) + f" (committed in `{PILOT_FILE}`).\n")
    lines = [
        "## C10: one step, ViT-5 vs SiT as MeanFlow models (addition of 2026-12-06)\n",
        f"Pre-registered in PROTOCOL.md (addition of 2026-12-06) before any of its runs; {spent(out):.1f} of "
        f"{MEANFLOW_BUDGET_CORE_HOURS:g} core-hours spent. Two Holm families: M (primary, m = 2) and N "
        "(secondary, m = 6); pending tests count as p = 1. FID effects: 100 × (mean log FID of ViT-5 − of SiT) ≈ "
        "%, sides as geometric means; gap: the contrast (ViT-5 1 NFE − ViT-5 flow SDE-250) − (SiT 1 NFE − SiT "
        f"flow SDE-250) of log FID × 100, the flow references at n = {N_REFERENCES}; accuracy: percentage "
        f"points. Equivalence: ±{FID_MARGIN:.2f} log-% (FID), ±2 points (accuracy).\n",
        pilot_line,
        f"**Which backbone wins at 1 NFE:** {answer(rows)}.\n",
        report.markdown_table(table, list(table[0])),
        "### FID at 1, 2 and 4 NFE and the held-out loss at r = t (described)\n",
        "Final checkpoints; FID as the geometric mean over seeds (digits16: FID16); the flow references' "
        "SDE-250 beside them.\n",
        report.markdown_table(nfe, list(nfe[0])),
    ]
    checks = reference_check_rows(results)
    if checks:
        lines += ["Flow references against the committed flow run of the same seed (retrained with its "
                  "overrides):\n", report.markdown_table(checks, list(checks[0]))]
    grids = grid_table(results, out)
    if grids:
        lines += ["Seed 0 of each arm: the first 40 of the scored samples (rows the classes 0–9, the same noise "
                  "in every cell of a row) at 1, 2 and 4 NFE, and its flow reference at UniPC-8 and SDE-250.\n",
                  grids]
    return [claim_row], lines
