"""The REPA addition of the digits proxy (PROTOCOL.md, 2026-12-02): plan, its 12-test family, the
paired convergence score, the verdict rules and its own budget (fast: synthetic results)."""

from __future__ import annotations

import json
import math

import pytest
from digits_study import digits, repa


def _run(dataset, variant, seed, losses, fids=None, **extra):
    """A complete cached run with checkpoints at 1..4 of 4 steps."""
    fids = fids or [10.0] * 4
    return {
        "dataset": dataset,
        "variant": variant,
        "seed": seed,
        "steps": 4,
        "complete": True,
        "loss_spikes": 0,
        "checkpoints": {
            str(i + 1): {"heldout_loss": l, "digits_fid": f, "accuracy": 1.0}
            for i, (l, f) in enumerate(zip(losses, fids))
        },
        **extra,
    }


def test_variants_spell_out_repa_and_build(tmp_path):
    specs = repa.plan_repa(results_dir=tmp_path)
    names = [(s.dataset, s.variant, s.seed) for s in specs]
    assert len(names) == len(set(names)) == 24
    assert names[:6] == [
        ("digits8", v, s) for s in range(3) for v in ("SiT", "ViT-5 (γ0=1)")
    ]  # cached refs
    assert names[6:12] == [
        ("digits8", v, s) for s in range(3) for v in ("SiT + REPA", "ViT-5 (γ0=1) + REPA")
    ]
    assert all(d == "digits16" for d, _, _ in names[12:])
    for spec in specs:
        cfg = digits.load_config(spec.base_config, spec.overrides())
        on = "REPA" in spec.variant
        assert (cfg["repa"]["encoder"] == "digits") is on
        if on:  # every REPA key spelled out in the run's identity
            assert {o.split("=")[0] for o in spec.overrides() if o.startswith("repa.")} == set(
                digits.REPA_SETTINGS
            )
            assert (cfg["repa"]["depth"], cfg["repa"]["projector_dim"], cfg["repa"]["coeff"]) == (
                1,
                128,
                0.5,
            )


def test_family_has_the_protocols_12_tests():
    tests = repa.family()
    assert len(tests) == 12 and len({t.name + t.dataset for t in tests}) == 12
    assert [t.kind for t in tests].count("R") == 8


def test_convergence_score_is_the_mean_log_over_the_checkpoints():
    run = _run("digits8", "SiT", 0, [1.0, 0.5, 0.25, 0.125])
    assert repa.convergence_score(run, "loss") == pytest.approx(math.log(0.5) * 1.5)
    assert repa.convergence_score(run, "fid") == pytest.approx(math.log(10.0))
    del run["checkpoints"]["4"]  # diverged before the end
    assert repa.convergence_score(run, "loss") is None


def _results(ref, rep, vit_ref, vit_rep, d="digits8"):
    rows = []
    for name, values in (
        ("SiT", ref),
        ("SiT + REPA", rep),
        ("ViT-5 (γ0=1)", vit_ref),
        ("ViT-5 (γ0=1) + REPA", vit_rep),
    ):
        rows += [_run(d, name, s, [v * 2, v * 1.5, v * 1.2, v]) for s, v in enumerate(values)]
    return rows


def test_paired_speedup_and_gap_verdicts():
    results = _results(
        [0.40, 0.41, 0.42], [0.36, 0.37, 0.381], [0.38, 0.39, 0.40], [0.34, 0.35, 0.362]
    )
    r = repa.RepaTest("R", "digits8", "SiT")
    out = repa.evaluate_test(r, results)
    assert out["pairs"] == 3 and out["effect"] < 0 and out["p"] < 0.01  # paired: tight
    assert repa.verdict_of(r, out, 0.01) == "yes (REPA faster)"
    assert repa.verdict_of(r, out, 0.2) == "inconclusive"
    slower = repa.evaluate_test(
        r, _results([0.36, 0.37, 0.381], [0.40, 0.41, 0.42], [0.4] * 3, [0.4] * 3)
    )
    assert repa.verdict_of(r, slower, 0.01) == "slower with REPA"
    g = repa.RepaTest("G", "digits8")
    gap = repa.evaluate_test(g, results)
    assert gap["groups"] == [3, 3] and gap["effect"] < 0
    i = repa.evaluate_test(repa.RepaTest("I", "digits8"), results)
    assert i["groups"] == [3, 3, 3, 3]
    assert repa.gap_verdict("ViT-5 lower", "no change detected") == "survives"
    assert repa.gap_verdict("ViT-5 lower", "gap grows") == "grows"
    assert repa.gap_verdict("ViT-5 lower", "gap shrinks") == "shrinks"
    assert repa.gap_verdict("not significant", "gap shrinks") == "vanishes"
    assert repa.gap_verdict("equivalent", "no change detected") == "vanishes"
    assert repa.gap_verdict("SiT lower", "gap shrinks") == "reverses"
    assert repa.gap_verdict("not significant", "no change detected") == "inconclusive"
    assert repa.speedup_verdict(["yes (REPA faster)"] * 3 + ["slower with REPA"]) == "no (slower)"
    assert repa.speedup_verdict(["yes (REPA faster)"] * 4) == "yes"


def test_pending_rows_and_the_claims_rows(tmp_path):
    rows = repa.evaluate_repa([])
    assert len(rows) == 12 and all(
        r["p_holm"] == 1.0 and r["verdict"].startswith("pending") for r in rows
    )
    claim_rows, lines = repa.repa_report(
        _results([0.4] * 3, [0.39] * 3, [0.38] * 3, [0.37] * 3), tmp_path
    )
    assert [r["claim"][:3] for r in claim_rows] == ["C8a", "C8b"]
    assert (
        claim_rows[0]["runs done / planned"] == "12 / 24" and claim_rows[0]["verdict"] == "pending"
    )
    assert lines[0].startswith("## C8: REPA") and any(
        "| digits8 | SiT + REPA |" in line for line in lines
    )


def test_repa_budget_counts_only_repa_runs(tmp_path):
    runs = tmp_path / "runs" / "digits8"
    runs.mkdir(parents=True)
    for name, variant in (("a.json", "SiT + REPA"), ("b.json", "SiT lr=0.01")):
        (runs / name).write_text(
            json.dumps(
                {
                    **_run("digits8", variant, 0, [1.0] * 4),
                    "train_seconds": 3600.0,
                    "eval_seconds": 0.0,
                }
            )
        )
    assert repa.spent(tmp_path) == pytest.approx(1.0)
    assert digits.core_hours_spent(tmp_path, exclude=tuple(digits.REPA_VARIANTS)) == pytest.approx(
        1.0
    )
    assert digits.core_hours_spent(tmp_path) == pytest.approx(2.0)
