"""The MeanFlow demo's FID records: collect them from scored sample folders, and print the tables.

    python results/meanflow-demo/collect.py EVAL_DIR --commit SHA [--runs-root DIR]   # append to records.jsonl
    python results/meanflow-demo/collect.py --nfe-row FILE ROW RUN --runs-root DIR       # a results/nfe row
    python results/meanflow-demo/collect.py --tables                                 # the README's tables

A scored folder is ``EVAL_DIR/<run>[@<step>]-<kind>-s<sample seed>`` holding ``sample.py bulk``'s npz and the
``<name>.metrics.json`` that ``python -m fid SAMPLES digits`` writes beside it. ``kind`` names the weights and
the labels: ``nfe<k>`` (MeanFlow, EMA, random labels), ``nfe<k>eq`` (equal labels), ``nfe<k>raw`` (the raw
weights), ``sde250`` / ``sde250eq`` (the flow demo's SDE, Euler, 250 steps). The run's settings are read from
``<runs-root>/<run>/config.yaml`` (the resolved config ``train.py`` writes), the sampler, NFE, label sampling
and checkpoint hash from the metrics file, so a record never depends on the folder name for a number.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml
from scipy import stats

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records.jsonl"
NAME = re.compile(r"^(?P<run>[\w.-]+?)(?:@(?P<step>\d+))?-(?P<kind>nfe\d+(?:eq|raw)?|sde250(?:eq)?)-s(?P<seed>\d+)$")
SETTINGS = {  # record key -> dotted config key: what distinguishes the demo runs
    "objective": "transport.objective", "train_seed": "train.seed", "lr": "optim.lr",
    "ema_decay": "optim.ema_decay", "meanflow_ratio": "transport.meanflow_ratio",
    "meanflow_norm_p": "transport.meanflow_norm_p", "meanflow_norm_c": "transport.meanflow_norm_c",
    "meanflow_time_mean": "transport.meanflow_time_mean", "meanflow_time_std": "transport.meanflow_time_std",
    "meanflow_r_mean": "transport.meanflow_r_mean", "meanflow_r_std": "transport.meanflow_r_std",
    "meanflow_tangent": "transport.meanflow_tangent"}


def _settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The record's settings from a resolved run config."""
    out = {}
    for name, dotted in SETTINGS.items():
        section, key = dotted.split(".")
        out[name] = cfg.get(section, {}).get(key)
    if out["objective"] == "meanflow" and out["meanflow_tangent"] is None:
        out["meanflow_tangent"] = "conditional"  # a run from before the key: MeanFlow's own tangent
    return out


def collect(eval_dir: Path, runs_root: Path, commit: str) -> list[dict[str, Any]]:
    """One record per scored folder under ``eval_dir`` (sorted by name); raises naming the folder whose
    name, metrics file or run config is missing or does not parse."""
    records = []
    for folder in sorted(p for p in eval_dir.iterdir() if p.is_dir()):
        match = NAME.match(folder.name)
        if match is None:
            raise ValueError(f"{folder}: not <run>[@<step>]-<kind>-s<seed>")
        metrics_files = sorted(folder.glob("*.metrics.json"))
        if len(metrics_files) != 1:
            raise ValueError(f"{folder}: expected one *.metrics.json, found {len(metrics_files)}")
        m = json.loads(metrics_files[0].read_text())
        config_path = runs_root / match["run"] / "config.yaml"
        cfg = yaml.safe_load(config_path.read_text())
        checkpoint = Path(m["sample_metadata"]["checkpoint"]).name  # 0002000.pt or 0004000-milestone.pt
        step = int(checkpoint.split(".")[0].split("-")[0])
        if match["step"] is not None and int(match["step"]) != step:
            raise ValueError(f"{folder}: named step {match['step']}, sampled {checkpoint}")
        records.append({
            "run": match["run"], **_settings(cfg), "step": step,
            "method": m["sampler"]["method"], "nfe": m["nfe_per_image"],
            "weights": "model" if match["kind"].endswith("raw") else "ema", "labels": m["label_sampling"],
            "sample_seed": m["sample_metadata"]["global_seed"], "num_samples": m["num_samples"],
            "digits_fid": m["metrics"]["digits_fid"], "digits_accuracy": m["metrics"]["digits_accuracy"],
            "checkpoint_sha256": m["checkpoint_sha256"], "commit": commit})
    return records


def from_nfe_study(path: Path, row: str, run: str, runs_root: Path) -> list[dict[str, Any]]:
    """Records of one row of a ``results/nfe`` sample-seed file (``python -m sit_vit5.experiments nfe``: the
    flow demo's SDE 250 with equal labels), one per sample seed, with the commit each seed ran from."""
    data = json.loads(path.read_text())[row]
    cfg = yaml.safe_load((runs_root / run / "config.yaml").read_text())
    labels = "random" if "random-labels" in row else "equal"
    step = int(path.stem.rsplit("-", 1)[1])  # the files are named <checkpoint>-<step>.json
    return [{"run": run, **_settings(cfg), "step": step,
             "method": "sde", "nfe": data["nfe"], "weights": "ema", "labels": labels, "sample_seed": int(seed),
             "num_samples": 1000,  # the nfe command's --num-samples default: its rows do not store it
             "digits_fid": s["fid"], "digits_accuracy": s["accuracy"],
             "checkpoint_sha256": None, "commit": s["commit"], "source": f"{path.name}: {row}"}
            for seed, s in sorted(data["seeds"].items(), key=lambda kv: int(kv[0]))]


def load(path: Path = RECORDS) -> list[dict[str, Any]]:
    """The committed records (one JSON object a line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_fid(records: list[dict[str, Any]], seeds: tuple[int, ...] = (0, 1, 2), **where: Any) -> float | None:
    """The mean digits-FID over sample ``seeds`` of the records matching ``where`` (None unless every seed is
    there exactly once)."""
    fids = fids_of(records, seeds, **where)
    return None if fids is None else statistics.fmean(fids)


def fids_of(records: list[dict[str, Any]], seeds: tuple[int, ...] = (0, 1, 2), **where: Any) -> list[float] | None:
    """The digits-FIDs of sample ``seeds`` (in that order) of the records matching ``where``; None unless each
    seed is there exactly once. Two runs of the same settings and training seed are the same training up to
    their common step (CPU training is deterministic: ``cifar`` and ``cifar-long@2000`` score alike), so where
    several match, the first by name is read."""
    hits = [r for r in records if all(r[k] == v for k, v in where.items()) and r["sample_seed"] in seeds]
    if hits:
        first = min(r["run"] for r in hits)
        hits = [r for r in hits if r["run"] == first]
    by_seed = {r["sample_seed"]: r["digits_fid"] for r in hits}
    if len(hits) != len(seeds) or set(by_seed) != set(seeds):
        return None
    return [by_seed[s] for s in seeds]


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None else f"{a / b:.2f}×"


def sweep_table(records: list[dict[str, Any]]) -> list[str]:
    """The 2,000-step runs: 1 and 2 NFE (EMA, random labels) and 1 NFE of the raw
    weights, each the mean of sample seeds 0-2, next to the flow demo of the same training seed."""
    rows = ["| run | lr | EMA | p | c | r ≠ t | t: μ, σ | r: μ, σ | tangent | seed | 1 NFE | 2 NFE "
            "| 1 NFE, raw weights | flow SDE 250 | 1 NFE / flow | 2 NFE / flow |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = sorted({r["run"] for r in records if r["objective"] == "meanflow" and r["step"] == 2000},
                  key=lambda run: next((r["lr"], r["train_seed"], run) for r in records if r["run"] == run))
    for run in runs:
        first = next(r for r in records if r["run"] == run)
        one = mean_fid(records, run=run, step=2000, nfe=1, weights="ema", labels="random")
        two = mean_fid(records, run=run, step=2000, nfe=2, weights="ema", labels="random")
        raw = mean_fid(records, run=run, step=2000, nfe=1, weights="model", labels="random")
        flow = mean_fid(records, objective="sit", train_seed=first["train_seed"], lr=1.0e-3, step=2000,
                        labels="random")
        r_times = ("as t" if first["meanflow_r_mean"] is None
                   else f"{first['meanflow_r_mean']:g}, {first['meanflow_r_std']:g}")
        rows.append(f"| {run} | {first['lr']:g} | {first['ema_decay']:g} | {first['meanflow_norm_p']:g} | "
                    f"{first['meanflow_norm_c']:g} | {first['meanflow_ratio']:g} | "
                    f"{first['meanflow_time_mean']:g}, {first['meanflow_time_std']:g} | {r_times} | "
                    f"{first['meanflow_tangent']} | {first['train_seed']} | "
                    f"{_cell(one)} | {_cell(two)} | {_cell(raw)} | {_cell(flow)} | {_ratio(one, flow)} | "
                    f"{_ratio(two, flow)} |")
    return rows


def flow_table(records: list[dict[str, Any]], step: int = 2000) -> list[str]:
    """The flow demo's runs at ``step``: SDE 250 with random and equal labels (means of sample seeds 0-2)."""
    rows = ["| flow run | lr | seed | SDE 250 | SDE 250, equal labels |", "|---|---|---|---|---|"]
    runs = sorted({(r["lr"], r["train_seed"], r["run"]) for r in records if r["objective"] == "sit"
                   and r["step"] == step})
    for lr, seed, run in runs:
        cells = [_cell(mean_fid(records, run=run, step=step, labels=labels)) for labels in ("random", "equal")]
        rows.append(f"| {run} | {lr:g} | {seed} | {cells[0]} | {cells[1]} |")
    return rows


def curve_table(records: list[dict[str, Any]], run: str, flow_run: str = "flow") -> list[str]:
    """``run`` against the flow demo (training seed 0) at every step both were scored at (random labels)."""
    rows = ["| steps | 1 NFE | 2 NFE | flow SDE 250 | 1 NFE / flow | 2 NFE / flow |", "|---|---|---|---|---|---|"]
    steps = sorted({r["step"] for r in records if r["run"] == run} & {r["step"] for r in records
                                                                      if r["run"] == flow_run})
    for step in steps:
        one = mean_fid(records, run=run, step=step, nfe=1, weights="ema", labels="random")
        two = mean_fid(records, run=run, step=step, nfe=2, weights="ema", labels="random")
        flow = mean_fid(records, run=flow_run, step=step, labels="random")
        rows.append(f"| {step:,} | {_cell(one)} | {_cell(two)} | {_cell(flow)} | {_ratio(one, flow)} | "
                    f"{_ratio(two, flow)} |")
    return rows


_IMAGENET = {"objective": "meanflow", "ema_decay": 0.995, "meanflow_norm_p": 1.0, "meanflow_norm_c": 0.01,
             "meanflow_ratio": 0.25, "meanflow_time_mean": -0.4, "meanflow_time_std": 1.0,
             "meanflow_r_mean": None, "meanflow_r_std": None}  # MeanFlow's ImageNet times and weights
_CIFAR = {**_IMAGENET, "meanflow_norm_p": 0.75, "meanflow_norm_c": 0.001, "meanflow_ratio": 0.75,
          "meanflow_time_mean": -0.6, "meanflow_time_std": 1.6, "meanflow_r_mean": -4.0,
          "meanflow_r_std": 1.6}  # py-meanflow's CIFAR-10 script (scripts/cifar10_v1.sh)
MEANFLOW_RECIPES = {  # the recipes read over training seeds (name -> settings)
    "lr 1e-3, conditional tangent (the demo before 2026-12-06)": {**_IMAGENET, "lr": 1.0e-3,
                                                                   "meanflow_tangent": "conditional"},
    "lr 2e-3, conditional tangent": {**_IMAGENET, "lr": 2.0e-3, "meanflow_tangent": "conditional"},
    "lr 2e-3, predicted tangent": {**_IMAGENET, "lr": 2.0e-3, "meanflow_tangent": "predicted"},
    "lr 2e-3, predicted tangent, CIFAR-10 times and weights": {**_CIFAR, "lr": 2.0e-3,
                                                               "meanflow_tangent": "predicted"}}
COMPARED = ((1, 0), (2, 1), (3, 2))  # (changed, before) pairs of MEANFLOW_RECIPES, by position
CURVES = ("base", "imf-long", "cifar-long")  # runs trained past 2,000 steps, read at their milestones
LONG_STEP = 6000  # the shipped recipe is also read over training seeds at this step
FLOW_DEMO = {"objective": "sit", "lr": 1.0e-3, "ema_decay": 0.995}  # configs/demo.yaml


def seed_table(records: list[dict[str, Any]], recipe: dict[str, Any], step: int = 2000) -> list[str]:
    """A MeanFlow ``recipe`` against the flow demo per training seed at ``step`` (means of sample seeds
    0-2, random and equal labels), and the ratio of the training seeds' means with its 95 % interval."""
    rows = ["| training seed | 1 NFE | flow SDE 250 | 1 NFE / flow | 1 NFE, equal labels | flow, equal labels "
            "| 1 NFE / flow, equal labels | 2 NFE | 2 NFE / flow |", "|---|---|---|---|---|---|---|---|---|"]
    columns: dict[str, list[float]] = {name: [] for name in ("one", "flow", "one_eq", "flow_eq", "two")}
    for seed in sorted({r["train_seed"] for r in records if r["step"] == step
                        and all(r[k] == v for k, v in recipe.items())}):
        mf = {**recipe, "train_seed": seed, "step": step, "weights": "ema"}
        flow = {**FLOW_DEMO, "train_seed": seed, "step": step}
        cells = {"one": mean_fid(records, **mf, nfe=1, labels="random"),
                 "flow": mean_fid(records, **flow, labels="random"),
                 "one_eq": mean_fid(records, **mf, nfe=1, labels="equal"),
                 "flow_eq": mean_fid(records, **flow, labels="equal"),
                 "two": mean_fid(records, **mf, nfe=2, labels="random")}
        for name, value in cells.items():
            if value is not None:
                columns[name].append(value)
        rows.append(f"| {seed} | {_cell(cells['one'])} | {_cell(cells['flow'])} | "
                    f"{_ratio(cells['one'], cells['flow'])} | {_cell(cells['one_eq'])} | "
                    f"{_cell(cells['flow_eq'])} | {_ratio(cells['one_eq'], cells['flow_eq'])} | "
                    f"{_cell(cells['two'])} | {_ratio(cells['two'], cells['flow'])} |")

    def pooled(a: str, b: str) -> str:
        if len(columns[a]) < 2 or len(columns[a]) != len(columns[b]):
            return "–"
        ratio, low, high = log_ratio_interval(columns[a], columns[b])
        return f"{ratio:.2f}× [{low:.2f}, {high:.2f}]"

    means = {name: statistics.fmean(v) if v else None for name, v in columns.items()}
    rows.append(f"| mean (95 % interval) | {_cell(means['one'])} | {_cell(means['flow'])} | "
                f"{pooled('one', 'flow')} | {_cell(means['one_eq'])} | {_cell(means['flow_eq'])} | "
                f"{pooled('one_eq', 'flow_eq')} | {_cell(means['two'])} | {pooled('two', 'flow')} |")
    return rows


def log_ratio_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The ratio of the means of ``a`` over ``b`` with a delta-method 95 % interval on its log (the two
    samples independent), the quantile Welch-Satterthwaite's t: at 3-5 training seeds a normal
    quantile would understate the width. Returns (ratio, low, high)."""
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    terms = [statistics.variance(x) / (len(x) * m**2) for x, m in ((a, ma), (b, mb))]  # var of each log mean
    df = sum(terms) ** 2 / sum(v**2 / (len(x) - 1) for v, x in zip(terms, (a, b), strict=True))
    half = stats.t.ppf(0.975, df) * math.sqrt(sum(terms))
    ratio = ma / mb
    return ratio, ratio * math.exp(-half), ratio * math.exp(half)


def paired_comparison(records: list[dict[str, Any]], a: dict[str, Any], b: dict[str, Any], nfe: int = 1,
                      labels: str = "random", step: int = 2000) -> dict[str, Any] | None:
    """Recipe ``a`` over recipe ``b`` at ``nfe``, paired by training seed (each seed's mean over sample seeds
    0-2): n, the ratio of geometric means with its 95 % t interval, the sd of the paired log ratios and the
    two-sided paired t-test's p. None below two seeds with both."""
    pairs = []
    for seed in sorted({r["train_seed"] for r in records}):
        fa = mean_fid(records, **a, train_seed=seed, step=step, nfe=nfe, weights="ema", labels=labels)
        fb = mean_fid(records, **b, train_seed=seed, step=step, nfe=nfe, weights="ema", labels=labels)
        if fa is not None and fb is not None:
            pairs.append(math.log(fa / fb))
    if len(pairs) < 2:
        return None
    n, mean, sd = len(pairs), statistics.fmean(pairs), statistics.stdev(pairs)
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    p = float(stats.ttest_1samp(pairs, 0.0).pvalue)
    return {"n": n, "ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half),
            "sd_log": sd, "p": p}


def comparison_line(records: list[dict[str, Any]], a: dict[str, Any], b: dict[str, Any], nfe: int,
                    labels: str) -> str:
    """:func:`paired_comparison` as the README quotes it."""
    name = {id(v): k for k, v in MEANFLOW_RECIPES.items()}
    c = paired_comparison(records, a, b, nfe=nfe, labels=labels)
    head = f"{name[id(a)]} / {name[id(b)]}, {nfe} NFE, {labels} labels"
    if c is None:
        return f"{head}: fewer than two training seeds"
    return (f"{head}: n = {c['n']}, ratio {c['ratio']:.2f} [{c['low']:.2f}, {c['high']:.2f}], "
            f"sd of log ratio {c['sd_log']:.2f}, p = {c['p']:.2g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("eval_dir", nargs="?", type=Path)
    parser.add_argument("--commit", help="the commit the runs and samples came from")
    parser.add_argument("--runs-root", type=Path, help="where <run>/config.yaml lives (default: EVAL_DIR/..)")
    parser.add_argument("--nfe-row", nargs=3, metavar=("FILE", "ROW", "RUN"),
                        help="collect a results/nfe sample-seed row instead (as run RUN)")
    parser.add_argument("--tables", action="store_true", help="print the tables of the committed records")
    args = parser.parse_args(argv)
    if args.tables:
        records = load()
        print("\n".join(sweep_table(records)))
        print("\n" + "\n".join(flow_table(records)))
        for name, recipe in MEANFLOW_RECIPES.items():
            print(f"\n{name}:\n" + "\n".join(seed_table(records, recipe)))
        recipes = list(MEANFLOW_RECIPES.values())
        pairs = [(recipes[a], recipes[b]) for a, b in COMPARED]
        for (a, b), nfe, labels in itertools.product(pairs, (1, 2), ("random", "equal")):
            print(f"\n{comparison_line(records, a, b, nfe, labels)}")
        print(f"\nthe last recipe at {LONG_STEP} steps:\n"
              + "\n".join(seed_table(records, recipes[-1], step=LONG_STEP)))
        for run in CURVES:
            print(f"\n{run}:\n" + "\n".join(curve_table(records, run)))
        return 0
    if args.nfe_row:
        if args.runs_root is None:
            parser.error("--nfe-row needs --runs-root")
        path, row, run = args.nfe_row
        new = from_nfe_study(Path(path), row, run, args.runs_root)
    elif args.eval_dir is None or not args.commit:
        parser.error("EVAL_DIR and --commit are required to collect")
    else:
        new = collect(args.eval_dir, args.runs_root or args.eval_dir.parent, args.commit)
    with RECORDS.open("a") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in new)
    print(f"appended {len(new)} records to {RECORDS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
