"""The claims addition of the digits proxy: plan order, the Holm family, verdict rules, diverged
runs and the resolution evaluation's position tables (fast: synthetic results, no training)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from digits_study import claims, cli, digits

from sit_vit5.models import SIT_SWITCHES, VIT5_SWITCHES, create_model
from sit_vit5.models.layers import sincos_pos_embed_2d
from sit_vit5.utils.atomic_files import atomic_write_text


def test_spelled_out_switches_are_todays_defaults():
    """The claim variants spell every switch; today they equal the code defaults (a default change
    must be a decision, not a silent change of what the spelled variants compare against)."""
    for spelled, defaults in ((digits._SIT_ALL, SIT_SWITCHES), (digits._VIT5_ALL, VIT5_SWITCHES)):
        assert {
            k.removeprefix("model."): v for k, v in spelled.items() if k != "model.name"
        } == defaults


def test_plan_follows_the_protocol_order(tmp_path):
    specs = claims.plan_claims(results_dir=tmp_path)
    names = [(s.dataset, s.variant, s.seed) for s in specs]
    assert len(names) == len(set(names))
    assert all(d == "digits8" for d, _, _ in names[: names.index(("digits16", "ViT-5 (γ0=1)", 3))])
    first = names[:6]  # C2: both sides to n = 4 first
    assert first[:2] == [("digits8", "ViT-5 (γ0=1)", 3), ("digits8", "ViT-5 (γ0=1e-4)", 3)]
    assert {v for _, v, _ in first[2:]} == {a for a, _ in claims.C2_PAIRS}
    assert [v for _, v, _ in names[6:14]] == list(claims.C3_VARIANTS) * 4
    c4 = [i for i, (_, v, _) in enumerate(names) if "lr=" in v]
    c5 = [i for i, (_, v, _) in enumerate(names) if "(resolution)" in v]
    assert (
        len(c4) == 18 and len(c5) == 6 and c4[5] < c5[0] < c4[6]
    )  # C4 seed 0, main, C5, C4 seeds 1-2
    assert not any(
        "lr=0.03" in v for _, v, _ in names
    )  # the extra lr only once SiT failed to spike
    for spec in specs[:40]:  # every claim run builds
        digits.load_config(spec.base_config, spec.overrides())


def _run(dataset, variant, seed, loss=None, spikes=0, diverged=None, **extra):
    r = {
        "dataset": dataset,
        "variant": variant,
        "seed": seed,
        "steps": 4,
        "complete": True,
        "loss_spikes": spikes,
        "checkpoints": {}
        if loss is None
        else {"4": {"heldout_loss": loss, "digits_fid": 1.0, "accuracy": 1.0}},
        **extra,
    }
    if diverged is not None:
        r["diverged_at_step"] = diverged
    return r


def test_extra_learning_rate_is_planned_only_when_sit_never_spiked(tmp_path):
    runs = tmp_path / "runs" / "digits8"
    runs.mkdir(parents=True)
    for lr in digits.SPIKE_LRS:
        for s in range(3):
            spec = digits.RunSpec("digits8", claims.spike_variant("SiT", lr), s)
            (runs / spec.result_path.name).write_text(
                json.dumps(_run("digits8", spec.variant, s, 0.4))
            )
    assert any("lr=0.03" in s.variant for s in claims.plan_claims(results_dir=tmp_path))
    spec = digits.RunSpec("digits8", claims.spike_variant("SiT", 0.01), 0)
    (runs / spec.result_path.name).write_text(
        json.dumps(_run("digits8", spec.variant, 0, 0.4, spikes=3))
    )
    assert not any("lr=0.03" in s.variant for s in claims.plan_claims(results_dir=tmp_path))


def test_family_has_the_protocols_44_tests():
    tests = claims.family()
    assert len(tests) == 44 and len({(t.claim, t.dataset, t.name) for t in tests}) == 44
    assert sum(t.claim == "C2" for t in tests) == 4 and sum(t.claim == "C4" for t in tests) == 4


def test_the_third_learning_rate_joins_the_family_when_it_is_run():
    calm_sit = [_run("digits8", claims.spike_variant("SiT", lr), s, 0.4)
                for lr in digits.SPIKE_LRS for s in range(3)]
    tests = claims.family(calm_sit)
    c4 = [t for t in tests if t.claim == "C4"]
    assert len(tests) == 46 and len(c4) == 6
    assert {t.a for t in c4 if "0.03" in t.name} == {claims.spike_variant("ViT-5 (γ0=1)", 0.03)}
    assert len(claims.evaluate_family(calm_sit)) == 46
    spiked = [{**calm_sit[0], "loss_spikes": 2}, *calm_sit[1:]]
    assert len(claims.family(spiked)) == 44  # SiT spiked: the third lr is not run, nor tested
    assert len(claims.family(calm_sit[:-1])) == 44  # SiT's runs not all in yet


def _values_results(test, a, b):
    return [_run(test.dataset, test.a, i, v) for i, v in enumerate(a)] + [
        _run(test.dataset, test.b, i, v) for i, v in enumerate(b)
    ]


def test_verdicts_follow_the_rules():
    t = claims.Test("C3", "x", "digits8", "A", "B", expect=1, planned=(3, 3))
    worse = claims.evaluate_test(t, _values_results(t, [1.10, 1.11, 1.12], [1.00, 1.01, 1.02]))
    assert worse["effect"] == pytest.approx(100 * 0.1 / 1.01)
    assert claims.verdict(t, worse, 0.01) == "reproduced"
    assert claims.verdict(t, worse, 0.2) == "inconclusive"
    better = claims.evaluate_test(t, _values_results(t, [0.90, 0.91, 0.92], [1.00, 1.01, 1.02]))
    assert claims.verdict(t, better, 0.01) == "not reproduced (opposite)"
    same = claims.evaluate_test(
        t, _values_results(t, [1.0, 1.0001, 1.0002], [1.0001, 1.0002, 1.0003])
    )
    assert claims.verdict(t, same, 0.3) == "not reproduced (no effect)"  # CI inside ±0.5 %
    check = claims.Test("C7", "x", "digits8", "A", "B", expect=0, planned=(3, 3))
    assert claims.verdict(check, same, 0.3) == "equivalent"
    partial = claims.evaluate_test(t, _values_results(t, [1.1, 1.2], [1.0, 1.01, 1.02]))
    assert claims.verdict(t, partial, 0.01) == "pending (5 of 6 runs)"


def test_instability_counts_divergences_and_nothing_to_remove():
    t = claims.Test("C4", "x", "digits8", "A", "B", expect=-1, planned=(3, 3), metric="instability")
    results = [_run("digits8", "A", i, 0.4) for i in range(3)] + [
        _run("digits8", "B", 0, None, spikes=2, diverged=300),
        _run("digits8", "B", 1, 0.5, spikes=4),
        _run("digits8", "B", 2, 0.5, spikes=3),
    ]
    out = claims.evaluate_test(t, results)
    assert out["values"] == [[0, 0, 0], [3, 4, 3]] and out["diverged"] == [0, 1]
    loss = claims.evaluate_test(claims.Test("C4", "y", "digits8", "A", "B", -1, (3, 3)), results)
    assert loss["values"][1] == [0.5, 0.5]  # the diverged run has no final loss
    calm = [_run("digits8", v, i, 0.4) for v in "AB" for i in range(3)]
    assert claims.verdict(t, claims.evaluate_test(t, calm), 1.0).startswith(
        "inconclusive: nothing to remove"
    )


def test_holm_family_counts_pending_tests_as_p_one():
    rows = claims.evaluate_family([])
    assert len(rows) == 44 and all(
        r["p_holm"] == 1.0 and r["verdict"].startswith("pending") for r in rows
    )
    assert claims.claim_verdict(["reproduced", "reproduced"]) == "reproduced"
    assert claims.claim_verdict(["reproduced", "not reproduced (opposite)"]) == "not reproduced"
    assert claims.claim_verdict(["reproduced", "pending (1 of 2 runs)"]) == "pending"
    assert claims.claim_verdict(["reproduced", "inconclusive"]) == "inconclusive"


def test_shrink_contrast_reads_the_gap_change():
    t = next(t for t in claims.family() if t.metric == "shrink" and t.dataset == "digits8")
    sizes = {
        ("SiT", ""): 1.0,
        ("ViT-5 (γ0=1)", ""): 0.95,
        ("SiT", " 8×128"): 0.8,
        ("ViT-5 (γ0=1)", " 8×128"): 0.76,
    }
    results = [
        _run("digits8", b + sfx, s, m * (1 + 0.001 * s))
        for (b, sfx), m in sizes.items()
        for s in range(6)
    ]
    out = claims.evaluate_test(t, results)
    assert out["effect"] == pytest.approx(
        100 * (math.log(0.76 / 0.8) - math.log(0.95)), abs=1e-6
    )  # same gap: 0
    assert claims.verdict(t, out, 1.0).startswith("reproduced")


def test_diverged_run_is_recorded_not_raised(tmp_path):
    from sit_vit5.training import NonFiniteLossError

    spec = digits.RunSpec(
        "digits8",
        "SiT lr=0.01",
        0,
        steps=8,
        runs_dir=str(tmp_path / "runs"),
        results_dir=str(tmp_path / "res"),
        num_samples=4,
    )

    def diverging_train(cfg, resume=None):
        out = tmp_path / "runs" / "digits8" / "sit-lr-0.01" / "seed0"
        out.mkdir(parents=True, exist_ok=True)
        cfg_path = out / "config.yaml"
        from sit_vit5.config import save_config

        save_config(
            {
                **cfg,
                "model": {**cfg["model"], "input_size": 8, "in_channels": 1, "num_classes": 10},
            },
            cfg_path,
        )
        (out / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": 1.0}) + "\n" for i in range(3))
        )
        raise NonFiniteLossError("nan", 4)

    r = digits.run_one(spec, train=diverging_train)
    assert r["complete"] and r["diverged_at_step"] == 4 and r["checkpoints"] == {}
    assert json.loads(spec.result_path.read_text())["diverged_at_step"] == 4
    cached = lambda *a, **k: pytest.fail("a diverged run is cached")  # noqa: E731
    assert digits.run_one(spec, train=cached)["diverged_at_step"] == 4


def test_recomputed_sincos_only_touches_fixed_tables():
    tiny = dict(input_size=8, in_channels=1, depth=1, hidden_size=32, num_heads=2, num_classes=10)
    sit, vit5 = create_model("SiT-S/2", **tiny), create_model("ViT5-S/2", **tiny)
    interpolated = sit.pos_embed_for((6, 6))
    with digits.recomputed_sincos(sit):
        torch.testing.assert_close(
            sit.pos_embed_for((6, 6)), sincos_pos_embed_2d(32, 6, 6).unsqueeze(0)
        )
        torch.testing.assert_close(
            sit.pos_embed_for((4, 4)), sit.pos_embed
        )  # the training grid: same table
    assert torch.equal(sit.pos_embed_for((6, 6)), interpolated)  # restored
    with digits.recomputed_sincos(vit5):
        assert "pos_embed_for" not in vars(vit5)  # learned APE: the code's interpolation


def test_budget_stops_new_runs_but_not_cached_ones(tmp_path, monkeypatch):
    runs = tmp_path / "runs" / "digits8"
    runs.mkdir(parents=True)
    spent = {**_run("digits8", "SiT", 0, 0.4), "train_seconds": 5400.0, "eval_seconds": 1800.0}
    (runs / "spent.json").write_text(json.dumps(spent))
    assert digits.core_hours_spent(tmp_path) == pytest.approx(2.0)
    new = digits.RunSpec("digits8", "SiT lr=0.01", 0, results_dir=str(tmp_path))
    monkeypatch.setattr(digits, "run_one", lambda *a, **k: pytest.fail("over budget"))
    assert digits.sweep([new], 1, budget_core_hours=2.0) == []
    assert digits.sweep([new], 2, budget_core_hours=2.0, executor=ThreadPoolExecutor(2)) == []


def test_parallel_sweep_starts_runs_in_order_until_the_budget_is_spent(tmp_path, monkeypatch):
    """Two at a time, in order: with 1 of 1.5 core-hours spent, runs 0 and 1 both start (a run counts once it
    is complete: they overlap, held at a barrier), each charges one hour, so run 2 never starts; the cached run
    before them is returned whatever the budget."""
    import threading

    runs = tmp_path / "runs" / "digits8"
    runs.mkdir(parents=True)
    (runs / "spent.json").write_text(json.dumps({**_run("digits8", "SiT", 0, 0.4), "train_seconds": 3600.0,
                                                 "eval_seconds": 0.0}))
    cached = digits.RunSpec("digits8", "SiT", 1, results_dir=str(tmp_path))
    cached.result_path.write_text(json.dumps(_run("digits8", "SiT", 1, 0.4)))
    specs = [cached] + [digits.RunSpec("digits8", "SiT lr=0.01", s, results_dir=str(tmp_path)) for s in range(3)]
    started, both_running = [], threading.Barrier(2, timeout=30)

    def fake_run(spec, threads):
        if digits._is_cached(spec):
            return json.loads(spec.result_path.read_text())
        started.append(spec.seed)
        both_running.wait()  # a sequential sweep never gets here twice: BrokenBarrierError
        result = {**_run("digits8", spec.variant, spec.seed, 0.4), "train_seconds": 3600.0, "eval_seconds": 0.0}
        atomic_write_text(spec.result_path, json.dumps(result))  # as run_one: the other thread reads the folder
        return result

    monkeypatch.setattr(digits, "run_one", fake_run)
    out = digits.sweep(specs, 2, budget_core_hours=1.5, executor=ThreadPoolExecutor(2))
    assert sorted(started) == [0, 1] and [(r["variant"], r["seed"]) for r in out] == [
        ("SiT", 1), ("SiT lr=0.01", 0), ("SiT lr=0.01", 1)]
    assert digits.core_hours_spent(tmp_path) == pytest.approx(3.0)  # past the budget by one run


def _timed_run(tmp_path, d, variant, seed, hours):
    """A complete cached run of ``hours`` core-hours (train + eval); returns its spec."""
    spec = digits.RunSpec(d, variant, seed, results_dir=str(tmp_path))
    spec.result_path.parent.mkdir(parents=True, exist_ok=True)
    run = {**_run(d, variant, seed, 0.4), "steps": spec.steps, "train_seconds": 3000 * hours,
           "eval_seconds": 600 * hours}
    atomic_write_text(spec.result_path, json.dumps(run))
    return spec


def test_status_counts_runs_left_and_scales_an_unrun_size_from_another_dataset(tmp_path):
    """digits8 has 4×64 runs (0.1 core-hours each) and 8×128 runs (0.5: 5×); digits16 has only 4×64 runs
    (0.3): its 8×128 runs are estimated at 0.3 × 5 = 1.5 each; 6×96, run nowhere, has no estimate."""
    write = functools.partial(_timed_run, tmp_path)
    big, mid = claims.size_variant("SiT", "8×128"), claims.size_variant("SiT", "6×96")
    specs = [write("digits8", "SiT", s, 0.1) for s in range(3)] + [write("digits8", big, s, 0.5) for s in range(2)]
    specs += [write("digits16", "SiT", 0, 0.3), write("digits16", "ViT-5 (γ0=1)", 0, 0.3)]
    specs += [digits.RunSpec("digits16", v, s, results_dir=str(tmp_path)) for v in (big, mid) for s in range(3)]
    specs += [digits.RunSpec("digits8", big, 2, results_dir=str(tmp_path))]
    rows = {(r["dataset"], r["size"]): r for r in digits.sweep_status(specs)}
    assert rows[("digits8", "4×64")] == {"dataset": "digits8", "size": "4×64", "planned": 3, "complete": 3,
                                         "left": 0, "core_h_per_run": pytest.approx(0.1), "core_h_left": 0.0}
    assert rows[("digits8", "8×128")]["left"] == 1 and rows[("digits8", "8×128")]["core_h_left"] == pytest.approx(0.5)
    assert rows[("digits16", "8×128")]["core_h_per_run"] == pytest.approx(1.5)
    assert rows[("digits16", "8×128")]["core_h_left"] == pytest.approx(4.5)
    assert rows[("digits16", "6×96")]["core_h_per_run"] is None
    text = cli.status_report(specs, 2, budget_core_hours=10.0)
    assert "7 of 14 runs left, ≈ 5.0 core-hours (and runs of sizes no finished run allows estimating)" in text
    assert "≈ 2.5 h of wall time at --jobs 2" in text
    assert f"budget: {0.3 + 1.0 + 0.6:.1f} of 10 core-hours spent" in text


def test_status_scales_the_cost_of_a_longer_run_by_its_steps(tmp_path):
    """2,000-step runs of 0.2 core-hours: a 10,000-step run of the same size is estimated at 1.0; a cached
    1,000-step run of 0.2 counts as 0.4 per 2,000 steps (median of 0.2, 0.2, 0.4 = 0.2)."""
    specs = [_timed_run(tmp_path, "digits16", "SiT", s, 0.2) for s in range(2)]
    short = digits.RunSpec("digits16", "ViT-5 (γ0=1)", 0, steps=1000, results_dir=str(tmp_path))
    short.result_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(short.result_path, json.dumps({**_run("digits16", "ViT-5 (γ0=1)", 0, 0.4), "steps": 1000,
                                                     "train_seconds": 600, "eval_seconds": 120}))
    long = [digits.RunSpec("digits16", v, 0, steps=digits.LONG_STEPS, results_dir=str(tmp_path)) for v in digits.LONG]
    rows = {r["size"]: r for r in digits.sweep_status(specs + long)}
    assert rows["4×64"]["core_h_per_run"] == pytest.approx(0.2)
    assert rows[f"4×64, {digits.LONG_STEPS} steps"]["core_h_per_run"] == pytest.approx(1.0)
    assert rows[f"4×64, {digits.LONG_STEPS} steps"]["core_h_left"] == pytest.approx(2.0)


def test_status_reads_runs_of_the_same_step_count_before_scaling_others(tmp_path):
    """2,000-step runs of 0.2 core-hours and 10,000-step runs of 0.5 and 0.7 (median 0.6, not the 1.0 that
    scaling would give: a run's evaluation does not grow with its steps)."""
    specs = [_timed_run(tmp_path, "digits16", "SiT", s, 0.2) for s in range(3)]
    long = [digits.RunSpec("digits16", v, s, steps=digits.LONG_STEPS, results_dir=str(tmp_path))
            for v in digits.LONG for s in range(2)]
    for spec, hours in zip(long[:2], (0.5, 0.7), strict=True):
        spec.result_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(spec.result_path, json.dumps({
            **_run("digits16", spec.variant, spec.seed, 0.4), "steps": digits.LONG_STEPS,
            "train_seconds": 3000 * hours, "eval_seconds": 600 * hours}))
    rows = {r["size"]: r for r in digits.sweep_status(specs + long)}
    assert rows["4×64"]["core_h_per_run"] == pytest.approx(0.2)
    assert rows[f"4×64, {digits.LONG_STEPS} steps"]["core_h_per_run"] == pytest.approx(0.6)
    assert rows[f"4×64, {digits.LONG_STEPS} steps"]["core_h_left"] == pytest.approx(1.2)


def test_ends_by_starts_a_run_only_if_its_estimate_times_the_margin_fits(tmp_path):
    """Cached 4×64 runs of 0.2 and 0.4 core-hours (median 0.3): a 4×64 run needs 0.3 × 1.25 h = 1350 s
    before the stop; 8×128 has no estimate (run nowhere) and never starts."""
    _timed_run(tmp_path, "digits8", "SiT", 0, 0.2)
    _timed_run(tmp_path, "digits8", "SiT", 1, 0.4)
    small = digits.RunSpec("digits8", "ViT-5 (γ0=1)", 0, results_dir=str(tmp_path))
    big = digits.RunSpec("digits8", claims.size_variant("SiT", "8×128"), 0, results_dir=str(tmp_path))
    need = 0.3 * digits.STOP_BY_MARGIN * 3600
    assert digits.ends_by(1000.0 + need, clock=lambda: 1000.0)(small)
    assert not digits.ends_by(1000.0 + need - 1, clock=lambda: 1000.0)(small)
    assert not digits.ends_by(1e12, clock=lambda: 1000.0)(big)


def test_a_sweep_with_a_stop_skips_the_runs_that_do_not_fit_and_tries_the_next(tmp_path, monkeypatch, capsys):
    """In order: a cached run (returned though ``fits`` refuses it too), a long run that does not fit, a
    short one that does; sequential and two at a time alike."""
    cached = _timed_run(tmp_path, "digits8", "SiT", 0, 0.1)
    long_run = digits.RunSpec("digits8", "SiT lr=0.01", 0, results_dir=str(tmp_path))
    short = digits.RunSpec("digits8", "SiT lr=0.01", 1, results_dir=str(tmp_path))
    ran = []

    def fake_run(spec, threads):
        if digits._is_cached(spec):
            return json.loads(spec.result_path.read_text())
        ran.append(spec.seed)
        return {**_run("digits8", spec.variant, spec.seed, 0.4)}

    monkeypatch.setattr(digits, "run_one", fake_run)
    fits = lambda spec: spec is short  # noqa: E731
    for jobs, executor in ((1, None), (2, ThreadPoolExecutor(2))):
        ran.clear()
        out = digits.sweep([cached, long_run, short], jobs, executor=executor, fits=fits)
        assert ran == [1] and [(r["variant"], r["seed"]) for r in out] == [("SiT", 0), ("SiT lr=0.01", 1)]
        assert "1 runs not started: not estimated to end in time (digits8 SiT lr=0.01 s0)" in capsys.readouterr().out


def test_stop_by_is_the_next_such_time_or_an_iso_date_time():
    from datetime import datetime

    morning, evening = datetime(2026, 12, 2, 9, 30), datetime(2026, 12, 2, 20, 0)
    assert cli.stop_by_time("14:08", morning) == datetime(2026, 12, 2, 14, 8).timestamp()
    assert cli.stop_by_time("14:08", evening) == datetime(2026, 12, 3, 14, 8).timestamp()  # tomorrow
    assert cli.stop_by_time("2026-12-05T01:00") == datetime(2026, 12, 5, 1, 0).timestamp()
    for bad in ("25:00", "noon", "1:2:3"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--stop-by '{bad}'"):
            cli.stop_by_time(bad, morning)
    assert cli.parser().parse_args(["--stop-by", "2026-12-05T01:00"]).stop_by == pytest.approx(
        datetime(2026, 12, 5, 1, 0).timestamp())


def test_a_sweep_process_writes_the_run_console_to_its_log(tmp_path, monkeypatch, capsys):
    spec = digits.RunSpec("digits8", "SiT", 0, runs_dir=str(tmp_path / "runs"), results_dir=str(tmp_path))

    def chatty(s, threads):
        print("step 0000001 | loss 1.0")
        print("a warning too", file=sys.stderr)
        return {"ran": s.variant}

    monkeypatch.setattr(digits, "run_one", chatty)
    assert digits._worker(spec, 1) == {"ran": "SiT"}  # in the caller's process: its console as it is
    assert not spec.log_path.exists() and "step 0000001" in capsys.readouterr().out
    monkeypatch.setattr(digits, "parent_process", lambda: object())  # as in a spawned sweep process
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert digits._worker(spec, 1) == {"ran": "SiT"}
    assert digits._worker(spec, 1) == {"ran": "SiT"}  # a resume appends
    assert spec.log_path == tmp_path / "runs" / "digits8" / "sit" / "seed0.log"
    log = spec.log_path.read_text()
    assert log.count("step 0000001 | loss 1.0") == 2 and "a warning too" in log
    assert "step" not in capsys.readouterr().out and os.environ["TQDM_DISABLE"] == "1"


def test_claims_page_puts_the_hand_written_summary_before_the_table(tmp_path):
    without = claims.write_claims([], tmp_path, "cmd").read_text()
    assert "## In plain words" not in without and "| C1 Scale |" in without
    (tmp_path / "claims_summary.md").write_text("## In plain words\n\nNothing ran yet.\n")
    text = claims.write_claims([], tmp_path, "cmd").read_text()
    assert text.index("Verdicts use one Holm") < text.index("Nothing ran yet.") < text.index("## One row per claim")
    assert "pending" in text.split("## One row per claim")[1]  # no run: every claim still pending
