"""The MeanFlow addition of the digits study (PROTOCOL.md, 2026-12-06): the arms' written-out keys, the plan
(pilot alone until it fixes n), the n rule, budget and cost, families M and N (Holm, verdicts, the gap contrast
against hand-computed numbers), the report section, and real tiny runs end to end."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import yaml
from digits_study import cli, digits, meanflow
from scipy import stats as sps

from sit_vit5.names import MEANFLOW_DEFAULTS
from sit_vit5.utils.atomic_files import atomic_write_text

TINY = ["model.depth=1", "model.hidden_size=32", "model.num_heads=2"]


def _run(dataset, variant, seed, steps=2000, complete=True, seconds=0.0, sde250=None, **final):
    run = {"dataset": dataset, "variant": variant, "seed": seed, "steps": steps, "complete": complete,
           "train_seconds": seconds, "eval_seconds": 0.0, "checkpoints": {str(steps): final} if final else {}}
    if sde250 is not None:
        run["final_samples"] = {"sde250": sde250}
    return run


def _store(tmp_path, runs):
    for r in runs:
        path = digits.RunSpec(r["dataset"], r["variant"], r["seed"], results_dir=str(tmp_path)).result_path
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(r))


def _pilot_file(tmp_path, n8, n16):
    (tmp_path / meanflow.PILOT_FILE).write_text(json.dumps({"n": {"digits8": n8, "digits16": n16},
                                                            "pooled_sd": {"digits8": 0.1, "digits16": 0.1}}))


# ------------------------------------------------------------------------------------- settings and plan

# keys the objective gained after the addition of 2026-12-06 was registered, with the default that keeps the
# registered objective (MeanFlow's own tangent, r drawn like t): the arms do not write them, so their run
# identities stand
ADDED_LATER = {"meanflow_tangent": "conditional", "meanflow_r_mean": None, "meanflow_r_std": None}


def test_the_arms_write_out_the_registered_meanflow_keys_and_the_references_retrain_the_flow_pair():
    written = {k.removeprefix("transport."): v for k, v in digits.MEANFLOW_SETTINGS.items()
               if k.startswith("transport.meanflow_")}
    assert set(written) | set(ADDED_LATER) == set(MEANFLOW_DEFAULTS) and not set(written) & set(ADDED_LATER)
    for key, default in MEANFLOW_DEFAULTS.items():  # registered: the ImageNet defaults with guidance off
        expected = ADDED_LATER.get(key, 0.0 if key == "meanflow_kappa" else default)
        assert written.get(key, default) == expected, key
    assert written["meanflow_kappa"] == 0.0 != MEANFLOW_DEFAULTS["meanflow_kappa"]  # guidance off, as registered
    base = yaml.safe_load(digits.BASE_CONFIG.read_text())
    assert digits.MEANFLOW_SETTINGS["optim.grad_clip"] is base["optim"]["grad_clip"] is None  # no clipping
    for arm, flow in digits.MEANFLOW_ARMS.items():
        overrides = digits.RunSpec("digits8", arm, 0).overrides()
        for key, value in digits.MEANFLOW_SETTINGS.items():
            assert f"{key}={'null' if value is None else value}" in overrides, (arm, key)
        assert f"model.name={digits.VARIANTS[flow]['model.name']}" in overrides
    strip = lambda o: [x for x in o if not x.startswith("train.out_dir=")]  # noqa: E731
    for ref, flow in digits.FLOW_REFERENCES.items():
        spec, committed = digits.RunSpec("digits16", ref, 3), digits.RunSpec("digits16", flow, 3)
        assert strip(spec.overrides()) == strip(committed.overrides()) and spec.run_dir != committed.run_dir
    assert digits.FINAL_SAMPLES[ref]["sde250"]["num_steps"] == 250


def test_the_pilot_runs_alone_until_its_file_fixes_n_then_the_arms_and_the_references(tmp_path):
    pilot = meanflow.plan_meanflow(results_dir=tmp_path)
    assert [(s.dataset, s.variant, s.seed) for s in pilot[:4]] == [
        ("digits16", "SiT (meanflow)", 900), ("digits16", "ViT-5 (γ0=1) (meanflow)", 900),
        ("digits8", "SiT (meanflow)", 900), ("digits8", "ViT-5 (γ0=1) (meanflow)", 900)]
    assert len(pilot) == 12 and {s.seed for s in pilot} == set(meanflow.PILOT_SEEDS)
    _pilot_file(tmp_path, 3, 5)
    specs = meanflow.plan_meanflow(results_dir=tmp_path, steps=2000)
    assert specs[:12] == pilot
    arms = specs[12:12 + 2 * (3 + 5)]
    assert all(s.variant in digits.MEANFLOW_ARMS for s in arms)
    assert sorted({s.seed for s in arms if s.dataset == "digits16"}) == [0, 1, 2, 3, 4]
    assert sorted({s.seed for s in arms if s.dataset == "digits8"}) == [0, 1, 2]
    assert [(s.dataset, s.seed) for s in arms[:4]] == [("digits16", 0)] * 2 + [("digits8", 0)] * 2
    refs = specs[12 + 16:]
    assert len(refs) == 2 * 2 * meanflow.N_REFERENCES and all(s.variant in digits.FLOW_REFERENCES for s in refs)
    assert len({s.result_path for s in specs}) == len(specs)
    assert {s.dataset for s in meanflow.plan_meanflow(("digits8",), tmp_path)} == {"digits8"}


def test_n_is_the_registered_table_with_its_floor_and_cap():
    # the protocol's orientation numbers (the flow pair's committed spreads): 25 and 36; 49 and 85 are over the cap
    assert meanflow.n_per_arm(0.106) == 25 and meanflow.n_per_arm(0.128) == 36
    assert meanflow.n_per_arm(0.15) == meanflow.n_per_arm(0.2) == meanflow.N_MAX == 40
    assert meanflow.n_per_arm(0.01) == meanflow.N_MIN == 10
    # pooled sd by hand: variances 1 and 4, two degrees of freedom each → (2·1 + 2·4) / 4 = 2.5
    assert meanflow.pooled_sd([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]) == pytest.approx(math.sqrt(2.5))


def test_the_pilot_reading_pools_both_arms_log_fid_and_waits_for_every_pilot_run(tmp_path):
    logs = {"ViT-5 (γ0=1) (meanflow)": [2.0, 2.1, 2.2], "SiT (meanflow)": [2.5, 2.7, 2.9]}  # var 0.01, 0.04
    runs = [_run("digits8", v, s, digits_fid=math.exp(x)) for v, xs in logs.items()
            for s, x in zip(meanflow.PILOT_SEEDS, xs)]
    runs.append(_run("digits8", "SiT (meanflow)", 0, digits_fid=1e6))  # a test seed: not in the pilot
    assert meanflow.pilot_reading(runs[1:], ["digits8"]) is None  # one pilot run missing
    reading = meanflow.pilot_reading(runs, ["digits8"])
    assert reading["pooled_sd"]["digits8"] == pytest.approx(math.sqrt(0.025))
    assert reading["n"]["digits8"] == meanflow.n_per_arm(math.sqrt(0.025)) == 40  # sd 0.158: the cap
    _store(tmp_path, runs)
    path = meanflow.write_pilot(tmp_path, ["digits8"])
    assert json.loads(path.read_text())["n"] == {"digits8": 40}
    assert meanflow.write_pilot(tmp_path, ["digits8"]) is None  # written once: n is not revised


def test_only_the_additions_runs_are_charged_to_its_budget_and_its_cost_class_is_twice_a_flow_run(tmp_path):
    runs = [_run("digits8", "SiT (meanflow)", 900, seconds=1800), _run("digits8", "SiT (flow reference)", 0,
                                                                        seconds=900),
            _run("digits8", "SiT", 3, seconds=360), _run("digits8", "ViT-5 (γ0=1) (meanflow)", 0, complete=False,
                                                          seconds=360)]
    _store(tmp_path, runs)
    assert meanflow.spent(tmp_path) == pytest.approx(0.5 + 0.25 + 0.1)  # an unfinished run's time counts too
    assert digits.claims_spent(tmp_path) == pytest.approx(0.1)
    flow_only = digits.cost_model([_run("digits8", "SiT", s, seconds=360) for s in range(3)])
    assert flow_only("digits8", digits.MEANFLOW_SIZE) == pytest.approx(2 * 0.1)  # the bench's ratio
    measured = digits.cost_model([_run("digits8", "SiT", 0, seconds=360), runs[0]])
    assert measured("digits8", digits.MEANFLOW_SIZE) == pytest.approx(0.5)  # then its own runs
    assert digits.size_of("SiT (flow reference)") == digits.BASE_SIZE


# ------------------------------------------------------------------------------------- tests and verdicts

def _arms(dataset, key, vit, sit, seeds=None):
    seeds = seeds or range(max(len(vit), len(sit)))
    return ([_run(dataset, "ViT-5 (γ0=1) (meanflow)", s, **{key: v}) for s, v in zip(seeds, vit)]
            + [_run(dataset, "SiT (meanflow)", s, **{key: v}) for s, v in zip(seeds, sit)])


def test_the_gap_is_the_four_group_contrast_computed_by_hand(monkeypatch):
    monkeypatch.setattr(meanflow, "N_REFERENCES", 2)
    vit, ref_vit, sit, ref_sit = [1.0, 1.2, 1.4], [0.5, 0.7], [1.5, 1.9, 2.3], [0.9, 1.1]  # log FID
    results = _arms("digits8", "digits_fid", [math.exp(x) for x in vit], [math.exp(x) for x in sit])
    results += [_run("digits8", ref, s, digits_fid=99.0, sde250={"digits_fid": math.exp(x)})
                for ref, xs in (("ViT-5 (γ0=1) (flow reference)", ref_vit), ("SiT (flow reference)", ref_sit))
                for s, x in enumerate(xs)]
    test = next(t for t in meanflow.meanflow_family({"digits8": 3, "digits16": 3}) if t.name.startswith("N8-gap"))
    out = meanflow.evaluate_meanflow_test(test, results)
    # by hand: (1.2 − 0.6) − (1.9 − 1.0) = −0.3; variance 0.04/3 + 0.02/2 + 0.16/3 + 0.02/2 = 0.0866…;
    # Welch–Satterthwaite df = var² / (0.01333²/2 + 0.01²/1 + 0.05333²/2 + 0.01²/1) = 4.3896
    var = 0.04 / 3 + 0.02 / 2 + 0.16 / 3 + 0.02 / 2
    df = var**2 / ((0.04 / 3) ** 2 / 2 + 0.01**2 + (0.16 / 3) ** 2 / 2 + 0.01**2)
    assert df == pytest.approx(4.3896, abs=1e-4)
    assert out["effect"] == pytest.approx(-30.0)
    assert out["p"] == pytest.approx(2 * sps.t.sf(0.3 / math.sqrt(var), df))
    half = sps.t.ppf(0.975, df) * math.sqrt(var) * 100
    assert out["ci"] == pytest.approx((-30.0 - half, -30.0 + half))
    assert out["ratio"] == pytest.approx([math.exp(0.6), math.exp(0.9)])  # FID(1 NFE) / FID(SDE-250)
    assert out["n"] == [3, 2, 3, 2] and not out["pending"]
    assert meanflow.meanflow_verdict(test, out, 0.01) == "ViT-5 loses less"
    assert meanflow.meanflow_verdict(test, {**out, "effect": 30.0}, 0.01) == "SiT loses less"
    assert meanflow.meanflow_verdict(test, out, 0.3) == "inconclusive"
    short = meanflow.evaluate_meanflow_test(test, results[:-1])  # one reference missing
    assert short["pending"] and meanflow.meanflow_verdict(test, short, 0.01) == "pending (9 of 10 runs)"


def test_families_m_and_n_are_holm_corrected_separately_with_the_registered_words():
    vit8, sit8 = [8.0, 8.3, 7.9, 8.1], [11.0, 11.6, 10.7, 11.9]
    same16 = ([10.0, 10.1, 9.9, 10.05], [10.02, 9.95, 10.08, 10.0])
    results = _arms("digits8", "digits_fid", vit8, sit8) + _arms("digits16", "digits_fid16", *same16)
    rows = meanflow.evaluate_meanflow(results, {"digits8": 4, "digits16": 4})
    assert [sum(r["test"].family == f for r in rows) for f in "MN"] == [2, 6]
    m8, m16 = rows[0], rows[1]
    logs = lambda xs: [math.log(x) for x in xs]  # noqa: E731
    p8 = sps.ttest_ind(logs(vit8), logs(sit8), equal_var=False).pvalue
    p16 = sps.ttest_ind(*map(logs, same16), equal_var=False).pvalue
    assert m8["p"] == pytest.approx(p8) and m16["p"] == pytest.approx(p16)
    assert p8 < p16  # Holm by hand: the smaller p × 2, the larger max(that, p × 1)
    assert m8["p_holm"] == pytest.approx(min(1, 2 * p8)) and m16["p_holm"] == pytest.approx(max(2 * p8, p16))
    assert m8["verdict"] == "ViT-5 better" and m16["verdict"] == "equivalent within ±10 %"
    assert meanflow.answer(rows) == "digits8: ViT-5 better; digits16: equivalent within ±10 %"
    # N: the gap waits for its references (pending); the runs are done but carry no 2-NFE or accuracy value
    # (as a diverged run): no test there. Both count p = 1, and M's adjusted p are not touched by N
    assert all(r["p_holm"] == 1 for r in rows[2:])
    assert [r["verdict"].split(" (")[0] for r in rows[2:]] == ["inconclusive", "pending", "inconclusive"] * 2
    swapped = meanflow.evaluate_meanflow(_arms("digits8", "digits_fid", sit8, vit8)
                                         + _arms("digits16", "digits_fid16", *same16), {"digits8": 4, "digits16": 4})
    assert swapped[0]["verdict"] == "SiT better"
    neither = meanflow.evaluate_meanflow(_arms("digits8", "digits_fid", *same16)
                                         + _arms("digits16", "digits_fid16", *same16), {"digits8": 4, "digits16": 4})
    assert meanflow.answer(neither).startswith("neither")


def test_a_diverged_run_counts_as_done_without_a_value_and_2_nfe_reads_the_suffixed_key():
    vit, sit = [8.0, 8.3, 7.9], [11.0, 11.6, 10.7]
    results = _arms("digits8", "digits_fid_nfe2", vit, sit)
    results += [_run("digits8", v, 3) for v in ("ViT-5 (γ0=1) (meanflow)", "SiT (meanflow)")]  # diverged: no final
    test = next(t for t in meanflow.meanflow_family({"digits8": 4, "digits16": 4}) if t.name.startswith("N8-2"))
    assert test.key == "digits_fid_nfe2"
    out = meanflow.evaluate_meanflow_test(test, results)
    assert out["runs"] == [4, 4] and out["n"] == [3, 3] and not out["pending"]
    assert out["effect"] == pytest.approx(100 * (sum(map(math.log, vit)) - sum(map(math.log, sit))) / 3)
    before_pilot = meanflow.evaluate_meanflow(results, {"digits8": None, "digits16": None})
    assert all(r["verdict"].startswith("pending") for r in before_pilot)


def test_the_report_section_and_claim_row_from_made_up_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(meanflow, "N_REFERENCES", 2)
    _pilot_file(tmp_path, 3, 3)
    results = (_arms("digits8", "digits_fid", [8.0, 8.3, 7.9], [11.0, 11.6, 10.7])
               + [_run("digits8", ref, s, heldout_loss=0.4, digits_fid=9.0, sde250={"digits_fid": 7.0 + s})
                  for ref in digits.FLOW_REFERENCES for s in range(2)])
    for r in results:
        r["checkpoints"]["2000"].setdefault("heldout_loss", 0.41)
    (row,), lines = meanflow.meanflow_report(results, tmp_path)
    assert set(row) == {"claim", "paper", "our setting", "runs done / planned",
                        "effect [95 % CI], p, Holm p → test verdict", "verdict"}  # the claims table's columns
    assert row["claim"].startswith("C10") and row["runs done / planned"] == "6 / 12"
    assert row["verdict"].startswith("not answered yet") and "digits16 pending (0 of 6 runs)" in row["verdict"]
    text = "\n".join(lines)
    assert "## C10: one step" in text and "**Which backbone wins at 1 NFE:**" in text
    assert "| M | digits8 | M8: digits-FID at 1 NFE |" in text and "n = 3 per arm" in text
    assert "| digits8 | ViT-5 (γ0=1) | 8.06 (n=3) | – | – | 7.48 (n=2) | 0.4100 / 0.4000 |" in text


# ------------------------------------------------------------------------------------- real tiny runs

def test_a_meanflow_run_scores_every_nfe_records_its_start_and_resumes_from_its_cache(tmp_path, monkeypatch):
    spec = digits.RunSpec("digits8", "SiT (meanflow)", 0, steps=4, num_samples=20, runs_dir=str(tmp_path / "runs"),
                          results_dir=str(tmp_path / "out"), extra_overrides=TINY)
    r = digits.run_one(spec, 1)
    assert r["complete"] and r["started_utc"].endswith("Z") and r["commit"]
    assert r["config"]["transport"]["objective"] == "meanflow" and r["config"]["model"]["interval_embed"] is True
    assert sorted(int(s) for s in r["checkpoints"]) == [1, 2, 3, 4]
    for m in r["checkpoints"].values():
        assert math.isfinite(m["heldout_loss"]) and m["heldout_loss"] > 0  # at r = t: the flow-matching loss
        for suffix in ("", "_nfe2", "_nfe4"):
            assert m[f"digits_fid{suffix}"] > 0 and 0 <= m[f"accuracy{suffix}"] <= 1
        assert m["digits_fid"] != m["digits_fid_nfe2"]  # two samplers, not one number copied
    assert sorted(r["grids"]) == ["1 NFE", "2 NFE", "4 NFE"]
    assert all(Path(path).is_file() for path in r["grids"].values())
    retrain = lambda *a, **k: pytest.fail("a cached run must not retrain")  # noqa: E731
    assert digits.run_one(spec, 1, train=retrain) == r


@pytest.mark.slow
def test_meanflow_study_end_to_end_pilot_then_the_tests(tmp_path, monkeypatch):
    """The CLI at a tiny size on digits8: the pilot alone, its file, then arms and references and the report
    (2 pilot seeds, n = 2, 2 references: the registered sizes are monkeypatched down, the code paths are not)."""
    monkeypatch.setattr(meanflow, "PILOT_SEEDS", (900, 901))
    monkeypatch.setattr(meanflow, "N_MIN", 2)
    monkeypatch.setattr(meanflow, "N_MAX", 2)
    monkeypatch.setattr(meanflow, "N_REFERENCES", 2)
    out = tmp_path / "out"
    argv = ["--meanflow", "--steps", "4", "--num-samples", "20", "--datasets", "digits8", "--jobs", "1",
            "--runs-dir", str(tmp_path / "runs"), "--out", str(out), *TINY]
    assert cli.main(argv) == 0
    pilot = json.loads((out / meanflow.PILOT_FILE).read_text())
    assert pilot["n"] == {"digits8": 2} and len(pilot["fid"]["digits8"]["SiT (meanflow)"]) == 2
    records = digits.cached_runs(out)
    assert len(records) == 4 and {r["seed"] for r in records} == {900, 901}  # nothing but the pilot ran
    assert cli.main(argv) == 0
    records = digits.cached_runs(out)
    assert len(records) == 4 + 4 + 4 and all(r["complete"] and r["started_utc"] and r["commit"] for r in records)
    refs = [r for r in records if r["variant"] in digits.FLOW_REFERENCES]
    assert all(r["final_samples"]["sde250"]["digits_fid"] > 0 for r in refs)
    assert sorted(next(r for r in refs if r["seed"] == 0)["grids"]) == ["SDE-250", "UniPC-8"]
    claims_md = (out / "CLAIMS.md").read_text()
    assert "## C10: one step" in claims_md and "| C10 ViT-5's standing at 1 NFE" in claims_md
    m8 = next(line for line in claims_md.splitlines() if line.startswith("| M | digits8 |"))
    assert m8.rstrip(" |").endswith(("ViT-5 better", "SiT better", "equivalent within ±10 %", "inconclusive"))
    grid = "meanflow-digits8-sit-meanflow-1-nfe.png"
    assert grid in claims_md and (out / grid).is_file()
    retrain = lambda *a, **k: pytest.fail("cached runs must not retrain")  # noqa: E731
    monkeypatch.setattr(digits, "run_one", functools.partial(digits.run_one, train=retrain))
    assert cli.main(argv) == 0
