"""The MeanFlow demo's FID records (results/meanflow-demo): the collector, and every quoted table rebuilt from
the committed records."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml
from scipy.stats import t as scipy_t

from sit_vit5.config import load_config

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "results" / "meanflow-demo"
_spec = importlib.util.spec_from_file_location("meanflow_demo_collect", HERE / "collect.py")
collect = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(collect)

KEYS = {"run", "objective", "train_seed", "lr", "ema_decay", "meanflow_ratio", "meanflow_norm_p",
        "meanflow_norm_c", "meanflow_r_mean", "meanflow_r_std", "meanflow_time_mean", "meanflow_time_std",
        "step", "method", "nfe", "weights", "labels", "sample_seed", "num_samples", "digits_fid",
        "digits_accuracy", "checkpoint_sha256", "commit"}


@pytest.fixture(scope="module")
def records() -> list[dict]:
    rows = collect.load()
    assert len(rows) >= 100, f"{collect.RECORDS}: {len(rows)} records"
    return rows


def test_every_record_is_complete_and_one_of_a_kind(records):
    seen = set()
    for r in records:
        assert KEYS <= set(r), sorted(KEYS - set(r))
        assert math.isfinite(r["digits_fid"]) and r["digits_fid"] > 0 and 0 <= r["digits_accuracy"] <= 1
        assert r["num_samples"] == 1000 and r["commit"]
        assert (r["method"] == "meanflow") == (r["objective"] == "meanflow"), r
        assert r["nfe"] == (250 if r["method"] == "sde" else r["nfe"])
        key = (r["run"], r["step"], r["nfe"], r["weights"], r["labels"], r["sample_seed"])
        assert key not in seen, key
        seen.add(key)


@pytest.mark.parametrize("page", ["results/meanflow-demo/README.md", "docs/objectives.md"])
def test_the_quoted_tables_are_the_records_tables(records, page):
    text = (REPO / page).read_text()
    tables = {"sweep": collect.sweep_table(records), "flow": collect.flow_table(records),
              **{f"curve {run}": collect.curve_table(records, run) for run in collect.CURVES},
              "long": collect.seed_table(records, list(collect.MEANFLOW_RECIPES.values())[-1],
                                         step=collect.LONG_STEP),
              **{name: collect.seed_table(records, recipe) for name, recipe in collect.MEANFLOW_RECIPES.items()}}
    quoted = [name for name, rows in tables.items() if len(rows) > 2 and rows[2] in text]
    assert quoted, f"{page} quotes none of the tables"
    for name in quoted:
        for row in tables[name]:
            assert row in text, f"{page}, table {name}: missing or changed row {row!r}"
    recipes = list(collect.MEANFLOW_RECIPES.values())
    for a, b in [(recipes[i], recipes[j]) for i, j in collect.COMPARED]:
        for nfe in (1, 2):
            for labels in ("random", "equal"):
                line = collect.comparison_line(records, a, b, nfe, labels)
                head = line.split(":")[0]
                if head in text:  # a quoted comparison is the records' own
                    assert line in text, f"{page}: {head} changed: {line!r}"


def _scored(root: Path, name: str, *, method: str, nfe: int, labels: str, seed: int, fid: float,
            checkpoint: str = "0002000.pt") -> None:
    folder = root / "eval" / name
    folder.mkdir(parents=True)
    meta = {"checkpoint": f"/x/{checkpoint}", "global_seed": seed}
    (folder / "samples_1000x8x8x3.metrics.json").write_text(json.dumps({
        "sampler": {"method": method}, "nfe_per_image": nfe, "label_sampling": labels, "num_samples": 1000,
        "sample_metadata": meta, "metrics": {"digits_fid": fid, "digits_accuracy": 0.9},
        "checkpoint_sha256": "ab" * 32}))


def test_collect_reads_settings_from_the_run_config_and_numbers_from_the_metrics(tmp_path):
    run = tmp_path / "lrx"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "transport": {"objective": "meanflow", "meanflow_ratio": 0.25, "meanflow_norm_p": 0.5,
                      "meanflow_time_std": 1.0}, "optim": {"lr": 2e-3, "ema_decay": 0.995},
        "train": {"seed": 3}}))
    _scored(tmp_path, "lrx@4000-nfe2eq-s1", method="meanflow", nfe=2, labels="equal", seed=1, fid=7.5,
            checkpoint="0004000-milestone.pt")
    _scored(tmp_path, "lrx-nfe1raw-s0", method="meanflow", nfe=1, labels="random", seed=0, fid=20.0)
    got = collect.collect(tmp_path / "eval", tmp_path, "c0ffee")
    assert [(r["step"], r["nfe"], r["weights"], r["labels"], r["sample_seed"], r["digits_fid"]) for r in got] == [
        (0 + 2000, 1, "model", "random", 0, 20.0), (4000, 2, "ema", "equal", 1, 7.5)]
    assert got[0]["lr"] == 2e-3 and got[0]["meanflow_norm_p"] == 0.5 and got[0]["train_seed"] == 3
    _scored(tmp_path, "lrx@6000-nfe1-s0", method="meanflow", nfe=1, labels="random", seed=0, fid=9.0)
    with pytest.raises(ValueError, match="named step 6000, sampled 0002000.pt"):
        collect.collect(tmp_path / "eval", tmp_path, "c0ffee")


def test_mean_fid_needs_every_seed_once_and_the_ratio_interval_is_the_delta_method():
    rows = [{"run": "a", "sample_seed": s, "digits_fid": f} for s, f in [(0, 10.0), (1, 12.0), (2, 14.0)]]
    assert collect.mean_fid(rows, run="a") == 12.0
    assert collect.mean_fid(rows[:2], run="a") is None and collect.mean_fid(rows + rows[:1], run="a") is None
    twin = [{**r, "run": "b", "digits_fid": 99.0} for r in rows]  # the same training under a later name
    assert collect.mean_fid(twin + rows, sample_seed=0) is None and collect.mean_fid(twin + rows) == 12.0
    a, b = [10.0, 12.0, 14.0], [5.0, 6.0, 7.0]
    ratio, low, high = collect.log_ratio_interval(a, b)
    # var(a) = 4, var(b) = 1: both log means have variance 1/108, so Welch's df is 2 + 2 = 4
    se = math.sqrt(4.0 / (3 * 144.0) + 1.0 / (3 * 36.0))
    assert ratio == 2.0 and low == pytest.approx(2.0 * math.exp(-2.776445 * se), rel=1e-6)  # t(0.975, 4)
    assert high == pytest.approx(2.0 * math.exp(2.776445 * se), rel=1e-6)


def test_the_paired_comparison_is_a_t_test_on_the_seeds_log_ratios():
    def rows(run, lr, fids):  # one training seed per entry, three sample seeds around each mean
        return [{"run": run, "lr": lr, "train_seed": seed, "step": 2000, "nfe": 1, "weights": "ema",
                 "labels": "random", "sample_seed": s, "digits_fid": f + d}
                for seed, f in enumerate(fids) for s, d in enumerate((-0.5, 0.0, 0.5))]

    records = rows("a", 2.0, [10.0, 12.0, 9.0]) + rows("b", 1.0, [12.0, 13.0, 12.0])
    got = collect.paired_comparison(records, {"lr": 2.0}, {"lr": 1.0})
    logs = [math.log(10 / 12), math.log(12 / 13), math.log(9 / 12)]
    mean, sd = sum(logs) / 3, (sum((x - sum(logs) / 3) ** 2 for x in logs) / 2) ** 0.5
    t = mean / (sd / 3**0.5)
    assert got["n"] == 3 and got["ratio"] == pytest.approx(math.exp(mean)) and got["sd_log"] == pytest.approx(sd)
    assert got["high"] == pytest.approx(math.exp(mean + 4.302653 * sd / 3**0.5), rel=1e-6)  # t(0.975, 2)
    assert got["p"] == pytest.approx(2 * scipy_t.sf(abs(t), 2))
    assert collect.paired_comparison(records[:12], {"lr": 2.0}, {"lr": 1.0}) is None  # one seed has both


def test_the_shipped_config_is_the_last_recipe_and_the_readme_quotes_its_ratios(records):
    """configs/demo-meanflow.yaml trains the last recipe read over training seeds, and the project README's
    one-line summary quotes that recipe's 1-NFE and 2-NFE ratios to the flow demo."""
    shipped = collect._settings(load_config("demo-meanflow", ["train.out_dir=/tmp/unused"]))
    recipe = list(collect.MEANFLOW_RECIPES.values())[-1]
    assert {k: shipped[k] for k in recipe} == recipe
    mean_row = collect.seed_table(records, recipe)[-1].split(" | ")
    one, two = mean_row[3].split(" ")[0], mean_row[8].split(" ")[0]  # "1.33×", "0.94×"
    summary = (REPO / "README.md").read_text()
    assert f"1 NFE scores {one}" in summary and f"2 NFE {two}" in summary, (one, two)
