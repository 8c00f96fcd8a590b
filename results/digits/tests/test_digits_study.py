"""The digits study's sweep (results/digits/study/digits.py, featnet.py, the folder's command line):
plan, decision rule, tables, run identity and caching, end to end (moved from tests/test_experiments.py)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from digits_study import cli as digits_cli
from digits_study import digits, featnet, samples

from sit_vit5.config import load_config


def test_count_spikes_on_constructed_sequences():
    flat = [1.0] * 300
    assert digits.count_spikes(flat) == 0
    spiky = list(flat)
    spiky[150] = spiky[220] = 2.5  # > 2x the running median
    spiky[250] = 1.9  # not a spike
    assert digits.count_spikes(spiky) == 2
    assert digits.count_spikes(spiky, factor=1.8) == 3
    spiky[50] = 10.0  # inside the warm-up window: ignored
    assert digits.count_spikes(spiky) == 2


def test_plan_covers_main_variants_seeds_datasets_and_the_ablations():
    specs = digits.plan(seeds=3, ablation_seeds=2)
    main = [s for s in specs if s.variant in digits.MAIN]
    assert len(main) == 2 * 3 * len(digits.MAIN) and specs[: len(main)] == main  # main runs come first
    assert [s.dataset for s in specs[:12]] == ["digits8"] * 12 and {s.seed for s in main} == {0, 1, 2}
    n_third = 2 * 3 * len(digits.THIRD_ROW)  # the paper's third row (DiT's objective) next, 3 seeds each
    third = specs[len(main): len(main) + n_third]
    assert {s.variant for s in third} == set(digits.THIRD_ROW) and {s.seed for s in third} == {0, 1, 2}
    ablations = specs[len(main) + n_third:]
    assert len(ablations) == 2 * 2 * len(digits.ABLATIONS) and {s.seed for s in ablations} == {0, 1}
    assert len({s.run_dir for s in specs}) == len(specs) == len({s.result_path for s in specs})
    from sit_vit5.models import create_model
    from sit_vit5.models.registry import model_kwargs

    for variant in digits.VARIANTS:  # every variant spells out LayerScale (or is SiT) and builds
        spec = digits.RunSpec("digits16", variant, 0)
        cfg = load_config(spec.base_config, spec.overrides())
        assert cfg["data"]["split"] == "train" and cfg["data"]["image_size"] == 16
        is_sit = digits.VARIANTS[variant] == digits.VARIANTS["SiT"]  # SiT itself, or its rerun / longer run
        assert is_sit or variant in digits.THIRD_ROW or "layer_scale_init" in cfg["model"], variant
        kwargs = {**model_kwargs(cfg["model"]), "input_size": 16, "in_channels": 1, "num_classes": 10}
        create_model(cfg["model"]["name"], **kwargs)
    leave_one_out = [v for v in digits.ABLATIONS if "SwiGLU" not in v] + ["ViT-5 − LayerScale"]
    assert len(leave_one_out) == 7


def test_heldout_loss_of_the_zero_model_is_the_mean_target_norm():
    """A network that outputs 0 scores mean |u_t|^2 = mean |x1 - x0|^2 on the Linear path, whatever t."""
    from sit_vit5.transport import create_transport

    x1, y = torch.randn(5, 1, 4, 4), torch.arange(5)
    zero = lambda x, t, y: torch.zeros_like(x)  # noqa: E731
    zero.eval = lambda: None
    expected = sum(((x1 - torch.randn(x1.shape, generator=torch.Generator().manual_seed(7 + k))) ** 2).mean()
                   for k in range(3)) / 3
    got = digits.heldout_loss(zero, create_transport(), x1, y, num_times=3, seed=7)
    assert got == pytest.approx(expected.item(), rel=1e-6)


def _fake(dataset: str, variant: str, seed: int, loss: float) -> dict:
    return {"dataset": dataset, "variant": variant, "seed": seed, "steps": 4,
            "checkpoints": {"4": {"heldout_loss": loss, "digits_fid": 10 * loss, "accuracy": 0.5}}}


def test_layer_scale_decision_rule_and_significance():
    base = {"SiT": 1.0, "ViT-5 (γ0=1)": 0.95, "ViT-5 (γ0=1e-4)": 1.05, "ViT-5 − LayerScale": 0.90}
    results = [_fake(d, v, s, m + 0.001 * s) for d in digits.DATASETS for v, m in base.items() for s in range(3)]
    assert digits.decide_default(results)[0] == "ViT-5 − LayerScale"  # 0.90 vs 0.95: beyond the seed spread
    close = [_fake(d, v, s, m + 0.1 * s) for d in digits.DATASETS for v, m in base.items() for s in range(3)]
    assert digits.decide_default(close)[0] == "ViT-5 (γ0=1)"  # within spread: keep the component
    assert digits.decide_default(results[:-1])[0] is None  # a candidate with 2 seeds: undecided
    c = digits.compare([1.0, 1.1, 1.2], [2.0, 2.1, 2.2])
    assert c["delta"] == pytest.approx(-1.0) and c["exceeds_spread"] and c["p"] < 0.01
    assert digits.compare([1.0, 1.5, 2.0], [1.2, 1.3, 1.4])["exceeds_spread"] is False
    assert digits.compare([1.0], [2.0])["exceeds_spread"] is None


def test_load_results_keeps_complete_runs_of_known_variants(tmp_path, capsys):
    runs = tmp_path / "runs" / "digits8"
    runs.mkdir(parents=True)
    for name, variant, complete in (("a", "SiT", True), ("b", "SiT", False), ("c", "Some newer variant", True)):
        (runs / f"{name}.json").write_text(json.dumps({**_fake("digits8", variant, 0, 1.0), "complete": complete}))
    assert [r["variant"] for r in digits.load_results(tmp_path)] == ["SiT"]
    assert "Some newer variant" in capsys.readouterr().out


def test_ablation_rows_are_compared_with_the_variant_they_modify():
    losses = {"SiT": 1.0, "ViT-5 (γ0=1)": 0.9, "ViT-5 (γ0=1e-4)": 1.1, "ViT-5 − RoPE": 0.99,
              "ViT-5 (γ0=1e-4) + SwiGLU-official": 1.078}
    extra = {"params": 1, "mflops": 1.0, "final_loss": 1.0, "loss_spikes": 0, "gate_attn_curve": [[4, 0.1]],
             "gate_mlp_curve": [[4, 0.1]]}
    results = [{**_fake("digits8", v, s, m + 1e-4 * s), **extra} for v, m in losses.items() for s in range(2)]
    rows = {r["variant"]: r for r in digits.summary_rows(results, "digits8", digits.ABLATIONS, ablations=True)}
    assert set(rows) == {"ViT-5 − RoPE", "ViT-5 (γ0=1e-4) + SwiGLU-official"}
    assert rows["ViT-5 − RoPE"]["Δ loss vs its base"].startswith("+10.00 % (")  # 0.99 / 0.9
    assert rows["ViT-5 − RoPE"]["Δ loss vs its base"].endswith("beyond spread: yes) vs γ0=1")
    assert rows["ViT-5 (γ0=1e-4) + SwiGLU-official"]["Δ loss vs its base"].startswith("-2.00 % (")  # 1.078 / 1.1
    assert rows["ViT-5 − RoPE"]["Δ loss vs SiT"].startswith("-1.00 % (")
    main = digits.summary_rows(results, "digits8", digits.MAIN)
    assert all("Δ loss vs its base" not in r for r in main)


@pytest.mark.slow
def test_digits_proxy_end_to_end_and_cached(tmp_path, monkeypatch):
    out = tmp_path / "results"
    argv = ["--seeds", "2", "--steps", "8", "--num-samples", "20", "--datasets", "digits8",
            "--variants", "SiT", "ViT-5 (γ0=1)", "DiT w. ViT", "--jobs", "1", "--runs-dir", str(tmp_path / "runs"),
            "--out", str(out), "model.depth=1", "model.hidden_size=32", "model.num_heads=2"]
    page = digits.REPO / samples.COMPARISON_PAGE
    quoted = page.read_text()
    assert digits_cli.main(argv) == 0
    assert page.read_text() == quoted  # a scratch --out leaves the manual's bottom line alone
    text = (out / "README.md").read_text()
    assert "| SiT | 2 |" in text and "| ViT-5 (γ0=1) | 2 |" in text and "Commit:" in text
    assert "PROTOCOL.md" in text and "floor" in text
    assert "| DiT w. ViT | 2 |" in text and "n/a (ε objective)" in text
    results = digits.load_results(out)
    assert len(results) == 6
    for r in results:
        assert sorted(int(s) for s in r["checkpoints"]) == [2, 4, 6, 8]
        for m in r["checkpoints"].values():
            flow = r["variant"] != "DiT w. ViT"
            assert (m["heldout_loss"] > 0) if flow else math.isnan(m["heldout_loss"])
            assert m["digits_fid"] > 0 and 0 <= m["accuracy"] <= 1
        assert r["gate_attn_curve"] == [] or all(v[1] >= 0 for v in r["gate_attn_curve"])
    for name in ("fid_curves.png", "loss_curves.png", "gates.png", "results.csv",
                 "samples-digits8-sit.png", "samples-digits8-vit-5-g-1.png"):
        assert (out / name).is_file(), name
    retrain = lambda *a, **k: pytest.fail("cached runs must not retrain")  # noqa: E731
    monkeypatch.setattr(digits, "run_one", functools.partial(digits.run_one, train=retrain))
    assert digits_cli.main(argv) == 0
    assert digits_cli.main(["--report-only", "--out", str(out)]) == 0


def test_a_comment_edit_of_the_base_config_keeps_the_cached_runs():
    """Run identity compares the base config as parsed YAML: rewording a comment (as moving the study
    did) must not retrain the cache, a changed value must."""

    base = "model:\n  depth: 4  # four blocks\ntrain:\n  steps: 2000\n"
    stored = {"base_config": base, "overrides": ["model.name=SiT-S/2"]}
    reworded = {**stored, "base_config": base.replace("# four blocks", "# 4 blocks, see README")}
    changed = {**stored, "base_config": base.replace("steps: 2000", "steps: 1000")}
    assert digits.same_identity(stored, reworded)
    assert not digits.same_identity(stored, changed)
    assert not digits.same_identity(stored, {**stored, "overrides": ["model.name=ViT5-S/2"]})
    assert not digits.same_identity(None, stored)


@pytest.mark.slow
def test_featnet_check_reproduces_a_cached_run_and_compares_networks(tmp_path):
    common = dict(steps=8, num_samples=20, extra_overrides=["model.depth=1", "model.hidden_size=32",
                                                            "model.num_heads=2"])
    out = tmp_path / "results"
    digits.run_one(digits.RunSpec(*featnet.CHECKED, runs_dir=str(tmp_path / "runs"), results_dir=str(out), **common))
    data = featnet.featnet_check(out, str(tmp_path / "runs"), **common)
    rows = data["rows"]
    assert [r["samples"] for r in rows] == ["2", "4", "6", "8", "real digits16"]
    for r in rows[:-1]:  # the same machine retrains bitwise, and the shipped nets are what scores runs
        for key in ("heldout_loss", "digits_fid", "digits_fid16"):
            assert r[f"committed {key}"] == r[f"retrained {key}"], key
        assert r["FID16 shipped"] == pytest.approx(r["retrained digits_fid16"], rel=1e-12)
        assert r["FID8 shipped"] == pytest.approx(r["retrained digits_fid"], rel=1e-12)
        assert r["FID16 two-thread"] != r["FID16 shipped"]  # another reduction order: another network
        assert r["FID16 two-thread"] == pytest.approx(r["FID16 shipped"], rel=0.2)
    real = rows[-1]  # real upsamples (20 of them: FID's small-N bias) score better at 16×16 than noise-like samples
    assert real["FID16 shipped"] < min(r["FID16 shipped"] for r in rows[:-1]) and real["FID16 shipped"] < real[
        "FID8 shipped"]
    spec = digits.RunSpec(*featnet.CHECKED)
    stem = out / f"featnet_check-{spec.dataset}-{spec.result_path.stem}"
    text = Path(f"{stem}.md").read_text()
    assert "| real digits16 |" in text and text.count("\n|") == 7
    assert json.loads(Path(f"{stem}.json").read_text()) == data


def test_gate_rows_average_the_final_gamma_and_gates_of_runs_that_cache_them():
    def run(variant, seed, gamma, spread, gate):
        return {"dataset": "digits8", "variant": variant, "seed": seed,
                "layer_scale": None if gamma is None else {"attn": gamma, "mlp": 2 * gamma},
                "gate_spread_attn_curve": [[20, 9.0], [40, spread]], "gate_spread_mlp_curve": [[40, 2 * spread]],
                "gate_attn_curve": [[40, gate]], "gate_mlp_curve": [[40, 2 * gate]]}

    old = {**run("SiT", 9, None, 1.0, 1.0), "gate_spread_attn_curve": []}  # the original sweep: no spread cached
    results = [run("ViT-5 (γ0=1e-4)", 0, 0.02, 0.01, 0.04), run("ViT-5 (γ0=1e-4)", 1, 0.04, 0.03, 0.06),
               run("SiT", 0, None, 0.1, 0.3), old, run("ViT-5 − RoPE", 0, 1.0, 0.1, 0.3)]
    rows = digits.gate_rows(results)
    assert [(r["variant"], r["n"]) for r in rows] == [("SiT", 1), ("ViT-5 (γ0=1e-4)", 2)]
    assert rows[0]["mean abs(γ)"] == "– (no LayerScale)" and rows[0]["mean abs(gate·γ)"] == "0.300 / 0.600"
    assert rows[1]["mean abs(γ)"] == "0.030 / 0.060"
    assert rows[1]["spread of gate·γ across the batch"] == "0.020 / 0.040"


def test_a_stopped_run_keeps_its_folder_and_record_and_resumes(tmp_path):
    """A run stopped by a signal (train() checkpoints and returns ``preempted``) or killed during training keeps
    its run folder: its record is written before training starts, so the next start resumes instead of wiping
    the folder, and the stop is a one-line RunStopped, not an evaluation of checkpoints that do not exist."""
    spec = digits.RunSpec("digits8", "SiT", 0, runs_dir=str(tmp_path / "runs"), results_dir=str(tmp_path / "out"),
                          steps=8, num_samples=20)
    calls = []

    def stopped_train(cfg, resume=None):
        calls.append(resume)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        (spec.run_dir / "progress.txt").write_text("trained so far")  # what a checkpoint stands for here
        return type("Result", (), {"preempted": "SIGTERM", "step": 3})()

    with pytest.raises(digits.RunStopped, match="digits8 SiT seed 0: stopped by SIGTERM.*rerun the same command"):
        digits.run_one(spec, train=stopped_train)
    record = json.loads(spec.result_path.read_text())
    assert record["complete"] is False and record["seed"] == 0 and record["identity"]["overrides"]
    assert record["started_utc"].endswith("Z") and record["commit"] != ""  # issue 55: order provable
    assert record["train_seconds"] >= 0 and "checkpoints" not in record

    def killed_train(cfg, resume=None):
        assert (spec.run_dir / "progress.txt").read_text() == "trained so far"  # the folder was kept
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        digits.run_one(spec, train=killed_train)
    with pytest.raises(digits.RunStopped):
        digits.run_one(spec, train=stopped_train)
    assert (spec.run_dir / "progress.txt").is_file() and len(calls) == 2
    assert json.loads(spec.result_path.read_text())["train_seconds"] >= record["train_seconds"]

    fresh = digits.RunSpec("digits8", "SiT", 1, runs_dir=str(tmp_path / "runs"), results_dir=str(tmp_path / "out"),
                           steps=8, num_samples=20)
    fresh.run_dir.mkdir(parents=True)
    (fresh.run_dir / "stale.txt").write_text("no record says whose folder this is")
    with pytest.raises(KeyboardInterrupt):  # killed during its first training: the record is already there
        digits.run_one(fresh, train=lambda cfg, resume=None: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert not (fresh.run_dir / "stale.txt").exists()  # a folder without a record was started over
    assert json.loads(fresh.result_path.read_text())["complete"] is False
