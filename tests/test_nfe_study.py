"""The NFE study (``python -m sit_vit5.experiments nfe``): rows per solver at honest NFE counts, cached
and resumed, a table and a plot; diffusers' schedulers restart per batch (issue 39's groundwork)."""

import datetime
import itertools
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from sit_vit5.config import load_config
from sit_vit5.experiments import nfe
from sit_vit5.experiments.__main__ import main as experiments_main
from sit_vit5.models import create_model
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.training import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def tiny_checkpoint(tmp_path) -> str:
    """Our checkpoint of a tiny random 8×8 pixel model (the digits shape)."""
    arch = dict(depth=1, hidden_size=32, num_heads=2, input_size=8, in_channels=1, num_classes=10)
    cfg = load_config("configs/demo.yaml", [f"model.{k}={v}" for k, v in arch.items()]
                      + ["model.name=SiT-S/2", "vae.name=none"])
    torch.manual_seed(0)
    model = create_model("SiT-S/2", **arch, learn_sigma=cfg["model"]["learn_sigma"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    state = {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": cfg, "step": 1}
    return str(save_checkpoint(state, tmp_path / "run" / "checkpoints", step=1))


def test_rows_count_nfe_honestly_and_resume_from_the_cache(tmp_path, monkeypatch, capsys):
    ckpt, out = tiny_checkpoint(tmp_path), tmp_path / "nfe"
    argv = ["nfe", ckpt, "--out", str(out), "--solvers", "ode-euler", "ode-heun", "unipc",
            "sde-euler-mean", "--nfe", "2", "4", "--num-samples", "12", "--batch-size", "5"]
    assert experiments_main(argv) == 0
    name = nfe.checkpoint_name(ckpt)
    assert name.endswith("run-0000001")
    rows = json.loads((out / f"{name}.json").read_text())
    by_key = {(r["solver"], r["target"]): r for r in rows.values()}
    assert len(by_key) == 8  # every solver at every NFE (an NFE a solver cannot make is refused)
    for (solver, target), row in by_key.items():
        assert row["nfe"] == target and row["fid"] > 0 and 0 <= row["accuracy"] <= 1, (solver, row)
    assert (out / f"{name}.md").is_file() and (out / f"{name}.png").is_file()
    assert "best" in capsys.readouterr().out
    calls = []
    monkeypatch.setattr(nfe, "run_row", lambda *args: calls.append(args) or {})
    assert experiments_main(argv) == 0 and calls == []  # every row came from the cache


def test_each_time_shift_makes_its_own_rows_on_its_own_grid(tmp_path, monkeypatch):
    """Shift 1 keeps the plain label (old caches stay valid); another shift is labelled and samples
    with that shift, exactly what sample.py --time-shift gives."""
    ckpt, out = tiny_checkpoint(tmp_path), tmp_path / "nfe"
    specs = []
    monkeypatch.setattr(nfe, "run_row", lambda loaded, solver, spec, *a: specs.append(spec) or {
        "nfe": spec.nfe, "fid": 1.0, "accuracy": 1.0})
    argv = ["nfe", ckpt, "--out", str(out), "--solvers", "ode-euler", "unipc", "--nfe", "4",
            "--time-shifts", "1", "3", "--num-samples", "4"]
    assert experiments_main(argv) == 0
    rows = json.loads((out / f"{nfe.checkpoint_name(ckpt)}.json").read_text())
    assert sorted(rows) == ["ode-euler 4 cfg1", "ode-euler shift3 4 cfg1", "unipc 4 cfg1",
                            "unipc shift3 4 cfg1"]
    assert sorted(s.time_shift or 1 for s in specs) == [1, 1, 3, 3]
    flags = [SampleSpec(method="ode", sampling_method=name, time_shift=shift).with_nfe(4)
             for name in ("euler", "unipc") for shift in (None, 3.0)]  # sample.py --time-shift
    assert sorted(map(repr, specs)) == sorted(map(repr, flags))


def test_a_diffusers_scheduler_restarts_for_every_batch(tmp_path):
    """Image i does not depend on how the images are batched, with a stateful multistep scheduler."""
    from sit_vit5.models import load_model
    from sit_vit5.sampling import SamplingPipeline

    pipe = SamplingPipeline.for_model(load_model(tiny_checkpoint(tmp_path)),
                                      nfe.SOLVERS["unipc"].spec(4))
    for steps in (None, pipe.steps()):  # the whole-trajectory sampler, and step by step
        one = pipe.generate(range(4), 0, labels=[1, 2, 3, 4], steps=steps).pixels
        two = [pipe.generate(range(lo, lo + 2), 0, labels=[1 + lo, 2 + lo], steps=steps).pixels
               for lo in (0, 2)]
        assert torch.allclose(one, torch.cat(two), atol=1e-6)


def test_the_summary_holds_each_setting_against_the_sde_over_seeds(tmp_path):
    """Ratios to the same checkpoint's 250-NFE SDE, per kind and CFG scale, over the seeds that have
    both rows; digits16 reads FID16, digits8 the 8x8 FID; a file without the reference is left out."""
    from sit_vit5.experiments.__main__ import main as experiments_main
    from sit_vit5.experiments.nfe import seed_fids, summary_rows

    def row(solver, nfe, cfg, fid, fid16=None):
        return {"solver": solver, "nfe": nfe, "target": nfe, "cfg_scale": cfg, "fid": fid,
                **({} if fid16 is None else {"fid16": fid16})}

    files = {
        "digits8-sit-seed1-0002000": [row("sde-euler-mean", 250, 1.0, 10.0), row("unipc", 8, 1.0, 12.0),
                                      row("sde-euler-mean", 250, 1.5, 4.0), row("unipc", 8, 1.5, 5.0)],
        "digits8-sit-seed2-0002000": [row("sde-euler-mean", 250, 1.0, 8.0), row("unipc", 8, 1.0, 6.0)],
        "digits8-sit-seed3-0002000": [row("unipc", 8, 1.0, 1.0)],  # no reference: not counted
        "digits16-sit-seed1-0002000": [row("sde-euler-mean", 250, 1.0, 100.0, 20.0),
                                       row("unipc", 8, 1.0, 50.0, 10.0)],
    }
    for name, rows in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({str(i): r for i, r in enumerate(rows)}))
    table = {(r["checkpoint"], r["cfg_scale"], r["setting"]): r for r in summary_rows(seed_fids(tmp_path))}
    assert set(table) == {("digits8-sit", 1.0, "unipc 8"), ("digits8-sit", 1.5, "unipc 8"),
                          ("digits16-sit", 1.0, "unipc 8")}
    d8 = table["digits8-sit", 1.0, "unipc 8"]
    assert d8["n"] == 2 and d8["seeds"] == "1 2"
    assert d8["mean_ratio"] == pytest.approx((1.2 + 0.75) / 2)
    assert (d8["min_ratio"], d8["max_ratio"]) == pytest.approx((0.75, 1.2))
    assert table["digits8-sit", 1.5, "unipc 8"]["mean_ratio"] == pytest.approx(1.25)
    assert table["digits16-sit", 1.0, "unipc 8"]["mean_ratio"] == pytest.approx(0.5)  # FID16
    assert experiments_main(["nfe-summary", "--out", str(tmp_path)]) == 0
    assert "| digits8-sit | 1.5 | unipc 8 | 1 | 1.250 |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "summary.png").stat().st_size > 0


def test_each_sample_seed_is_stored_with_its_start_time_and_commit_and_resumes(tmp_path,
                                                                                monkeypatch):
    """--sample-seeds runs each row once per seed (seeds outermost), writes each result as it
    completes with its UTC start and the commit, reports mean and sd, and a rerun with more seeds
    runs only the new ones; --labels random makes its own rows with the pipeline's random labels."""
    ckpt, out = tiny_checkpoint(tmp_path), tmp_path / "nfe"
    calls = []

    def fake_row(loaded, solver, spec, num, batch, seed=0, labels="cycle"):
        calls.append((spec.sampling_method, seed, labels))
        return {"nfe": spec.nfe, "fid": 10.0 + seed, "accuracy": 0.5}

    monkeypatch.setattr(nfe, "run_row", fake_row)
    monkeypatch.setattr(nfe, "git_commit", lambda: "c" * 40)
    base = ["nfe", ckpt, "--out", str(out), "--solvers", "ode-euler", "unipc", "--nfe", "4"]
    assert experiments_main([*base, "--sample-seeds", "0", "1"]) == 0
    assert calls == [("euler", 0, "cycle"), ("unipc", 0, "cycle"), ("euler", 1, "cycle"),
                     ("unipc", 1, "cycle")]
    rows = json.loads((out / f"{nfe.checkpoint_name(ckpt)}.json").read_text())
    row = rows["unipc 4 cfg1"]
    assert sorted(row["seeds"]) == ["0", "1"] and row["n_seeds"] == 2
    assert row["fid"] == pytest.approx(10.5) and row["fid_sd"] == pytest.approx(2 ** -0.5)
    for result in row["seeds"].values():
        assert result["commit"] == "c" * 40
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", result["started_utc"])
    calls.clear()
    assert experiments_main([*base, "--sample-seeds", "0", "1", "2"]) == 0
    assert calls == [("euler", 2, "cycle"), ("unipc", 2, "cycle")]  # only the new seed
    calls.clear()
    assert experiments_main([*base[:5], "unipc", "--nfe", "4", "--labels", "random"]) == 0
    assert calls == [("unipc", 0, "random")]
    rows = json.loads((out / f"{nfe.checkpoint_name(ckpt)}.json").read_text())
    assert "unipc random-labels 4 cfg1" in rows


def test_random_labels_are_the_pipelines_own_draw_and_cycle_is_i_mod_10(tmp_path, monkeypatch):
    """What the two label choices hand the pipeline: i mod K, or None (its seeded uniform draw,
    what sample.py bulk uses by default)."""
    from sit_vit5.models import load_model
    from sit_vit5.sampling import SamplingPipeline

    seen = []
    original = SamplingPipeline.generate

    def spy(self, indices, seed, labels=None, **kw):
        seen.append(labels)
        return original(self, indices, seed, labels=labels, **kw)

    monkeypatch.setattr(SamplingPipeline, "generate", spy)
    monkeypatch.setattr(nfe, "score", lambda images, labels: {"fid": 1.0, "accuracy": 1.0})
    loaded = load_model(tiny_checkpoint(tmp_path))
    spec = nfe.SOLVERS["ode-euler"].spec(2)
    nfe.run_row(loaded, nfe.SOLVERS["ode-euler"], spec, 12, 12, 3, "cycle")
    nfe.run_row(loaded, nfe.SOLVERS["ode-euler"], spec, 12, 12, 3, "random")
    assert seen == [[i % 10 for i in range(12)], None]


def test_the_ratio_interval_is_the_delta_method_on_log_ratio():
    """By hand: means 6 and 5, sds 0.6 and 0.5 at n = 5: se(log R) = sqrt(2 * 0.01 / 5) = 0.0632,
    t(0.975, 4) = 2.776, t(0.8, 4) = 0.941; a wrong formula (sd instead of se, z instead of t)
    fails."""
    setting = [6 + 0.6 * v for v in (-1.2649, -0.6325, 0, 0.6325, 1.2649)]  # sd 0.6 (ddof 1)
    reference = [5 + 0.5 * v for v in (-1.2649, -0.6325, 0, 0.6325, 1.2649)]
    out = nfe.ratio_interval(setting, reference)
    se = (2 * 0.01 / 5) ** 0.5
    assert out["ratio"] == pytest.approx(1.2)
    assert out["lo"] == pytest.approx(1.2 * math.exp(-2.7764 * se), rel=1e-3)
    assert out["hi"] == pytest.approx(1.2 * math.exp(2.7764 * se), rel=1e-3)
    assert out["detectable"] == pytest.approx(math.expm1((2.7764 + 0.9410) * se), rel=1e-3)
    assert math.isnan(nfe.ratio_interval([1.0], [1.0, 2.0])["lo"])  # one seed: no interval
    assert [nfe.reading(lo, hi) for lo, hi in ((0.9, 0.99), (0.97, 1.04), (1.06, 1.2),
                                               (1.0, 1.2))] == [
        "below the reference", "within 5 %", "more than 5 % above", "not resolved"]


def test_the_seed_summary_reads_each_files_reference_and_training_seeds(tmp_path):
    """SiT files against the 250-NFE SDE, DiT files against DDPM 250, digits16 by FID16; the kind
    table is the geometric mean of training seeds' ratios with a t interval over their logs."""
    def row(solver, target, fids, cfg=1.0, metric="fid"):
        return {"solver": solver, "target": target, "cfg_scale": cfg,
                "seeds": {str(i): {"nfe": target, metric: f} for i, f in enumerate(fids)}}

    files = {
        "runs-demo-0002000": [row("sde-euler-mean", 250, [5, 5.5, 4.5]),
                              row("unipc", 8, [6, 6.6, 5.4])],
        "runs-demo-dit-0002000": [row("ddpm", 250, [5, 6, 7]),
                                  row("ddpm-dpm++2m-sde", 12, [6, 6, 6])],
        "digits16-sit-seed12-0002000": [row("sde-euler-mean", 250, [10, 11, 9], metric="fid16"),
                                        row("unipc", 8, [8, 8.8, 7.2], metric="fid16")],
        "digits16-sit-seed13-0002000": [row("sde-euler-mean", 250, [10, 10, 10.5],
                                            metric="fid16"),
                                        row("unipc", 8, [9, 9, 9.45], metric="fid16")],
    }
    for name, rows in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({str(i): r for i, r in enumerate(rows)}))
    table = {(r["checkpoint"], r["setting"]): r for r in nfe.seed_summary_rows(tmp_path)}
    assert table["runs-demo-0002000", "unipc 8"]["ratio"] == pytest.approx(1.2)
    assert table["runs-demo-dit-0002000", "ddpm-dpm++2m-sde 12"]["ratio"] == pytest.approx(1.0)
    assert table["runs-demo-dit-0002000", "ddpm-dpm++2m-sde 12"]["verdict"]
    assert table["digits16-sit-seed12-0002000", "unipc 8"]["ratio"] == pytest.approx(0.8)
    kinds = nfe.kind_summary_rows(list(table.values()))
    assert len(kinds) == 1 and kinds[0]["n_training_seeds"] == 2
    assert kinds[0]["ratio"] == pytest.approx((0.8 * 0.9) ** 0.5)
    half = 12.706 * abs(math.log(0.8) - math.log(0.9)) / 2  # t(0.975, 1) * sd / sqrt(2)
    assert kinds[0]["hi"] == pytest.approx((0.8 * 0.9) ** 0.5 * math.exp(half), rel=1e-3)
    # pooled paired (exploratory): the six (training, sample) seed ratios 0.8 x 3 and 0.9 x 3
    assert kinds[0]["n_paired"] == 6 and kinds[0]["paired"] == pytest.approx((0.8 * 0.9) ** 0.5)
    sd = math.sqrt(6 / 5) * abs(math.log(0.8) - math.log(0.9)) / 2  # ddof 1 of a two-point split
    assert kinds[0]["paired_hi"] == pytest.approx(
        (0.8 * 0.9) ** 0.5 * math.exp(2.5706 * sd / math.sqrt(6)), rel=1e-3)
    assert experiments_main(["nfe-summary", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "| runs-demo-0002000 | 1.0 | unipc 8 | yes | 3 | 6.00 ± 0.60 |" in text


#: result folders whose records a protocol addition judges -> (the page, the addition's heading)
PROTOCOL_OF = {"results/nfe/sample-seeds": ("results/nfe/README.md",
                                            "## Addition, 2026-12-06")}


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("folder", list(PROTOCOL_OF))
def test_every_sample_seed_record_ran_from_a_commit_after_its_protocol(folder):
    """The commit that added the protocol addition is an ancestor of every commit a record of
    ``folder`` carries, the record's code was clean at that commit (no ``-dirty``), and the record
    started after the addition was committed. Skipped outside a git checkout with that history."""
    page, heading = PROTOCOL_OF[folder]
    added = git("log", "--reverse", "--format=%H %cI", "-S", heading, "--", page)
    if added.returncode or not added.stdout.strip():
        pytest.skip("no git history of the protocol page here")
    commit, when = added.stdout.split("\n")[0].split()
    added_at = datetime.datetime.fromisoformat(when)
    records = [(path.name, key, seed, result) for path in sorted((ROOT / folder).glob("*.json"))
               for key, row in json.loads(path.read_text()).items()
               for seed, result in row.get("seeds", {}).items()]
    assert records, f"{folder}: no per-seed records"
    for name, key, seed, result in records:
        where = (name, key, seed, result.get("commit"))
        assert result.get("commit") and not result["commit"].endswith("-dirty"), where
        assert git("merge-base", "--is-ancestor", commit, result["commit"]).returncode == 0, where
        started = datetime.datetime.fromisoformat(result["started_utc"].replace("Z", "+00:00"))
        assert started >= added_at, (where, result["started_utc"], when)


def test_every_row_of_the_sample_seed_records_has_five_sample_seeds():
    """Issue 55: every reference and verdict row of the rerun study (each row its records hold)
    is read over five or more sample seeds, each with its own record."""
    files = sorted((ROOT / "results" / "nfe" / "sample-seeds").glob("*.json"))
    assert len(files) >= 14, [f.name for f in files]  # the demo, the DiT demo, 12 digits checkpoints
    short = {(f.name, key): (row["n_seeds"], len(row["seeds"]))
             for f in files for key, row in json.loads(f.read_text()).items()
             if row["n_seeds"] < 5 or len(row["seeds"]) < 5}
    assert not short, short


def test_the_paired_ratio_is_over_the_seeds_both_rows_have():
    """Per-seed ratios 1.1, 0.9 (seed 2 only in one row: left out): geometric mean sqrt(0.99),
    interval t(0.975, 1) * sd(log) / sqrt(2) either side."""
    out = nfe.paired_ratio({"0": 11.0, "1": 9.0, "2": 50.0}, {"0": 10.0, "1": 10.0})
    assert out["n"] == 2 and out["ratio"] == pytest.approx(0.99 ** 0.5)
    half = 12.706 * abs(math.log(1.1) - math.log(0.9)) / 2
    assert out["hi"] == pytest.approx(0.99 ** 0.5 * math.exp(half), rel=1e-3)


def test_a_random_labels_row_is_held_against_the_random_labels_reference(tmp_path):
    """Labels i mod 10 and random labels are different draws: a random-labels row is read against
    the random-labels SDE 250 only, and is left out while that has not run."""
    def row(solver, target, fids):
        return {"solver": solver, "target": target, "cfg_scale": 1.0,
                "seeds": {str(i): {"nfe": target, "fid": f} for i, f in enumerate(fids)}}

    rows = [row("sde-euler-mean", 250, [5, 5]), row("unipc random-labels", 8, [6, 6.2])]
    path = tmp_path / "runs-demo-0002000.json"
    path.write_text(json.dumps({str(i): r for i, r in enumerate(rows)}))
    assert nfe.seed_summary_rows(tmp_path) == []
    rows.append(row("sde-euler-mean random-labels", 250, [6, 6]))
    path.write_text(json.dumps({str(i): r for i, r in enumerate(rows)}))
    (only,) = nfe.seed_summary_rows(tmp_path)
    assert only["reference"] == "sde-euler-mean random-labels 250"
    assert only["ratio"] == pytest.approx(6.1 / 6)


#: few-step sentences issue 55 quoted as saying more than the runs; no page may carry them again
STALE = (
    "converges at its order there as the steps double (Euler 1, Heun / midpoint / UniPC 2",
    "the best found at <= 20 NFE as well",
    "the best found at ≤ 10 and ≤ 20 NFE",
    "sampling noise of a few percent",
    "a few percent of sampling noise",
    "UniPC at 8 NFE is 1.14 × the 250-NFE SDE's FID",
)


def _page(path: Path) -> str:
    """A page with line breaks folded, so a sentence wrapped across lines matches."""
    return " ".join(path.read_text().split())


def test_no_page_repeats_a_few_step_sentence_issue_55_quoted():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "results").rglob("*.md"))]
    found = [(p.name, s) for p in pages for s in STALE if s in _page(p)]
    assert not found, found


def test_the_quoted_few_step_figures_are_the_sample_seed_records():
    """Every FID (mean ± sd) and ratio interval the results page and the README quote for the demos
    is what ``seed_summary_rows`` computes from the committed per-seed records."""
    rows = {(r["checkpoint"], r["setting"]): r
            for r in nfe.seed_summary_rows(ROOT / "results" / "nfe" / "sample-seeds")
            if r["cfg_scale"] == 1}
    results_page, readme = (_page(ROOT / "results" / "nfe" / "README.md"),
                            _page(ROOT / "docs" / "few-step.md"))  # the README's few-step page

    def fid(r):
        return f"{r['fid']:.2f} ± {r['fid_sd']:.2f}"

    def ratio(r):
        return f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"

    quoted = [("runs-demo-0002000", "unipc 8"), ("runs-demo-0002000", "unipc 16"),
              ("runs-demo-0002000", "ode-dopri5 0.0001"), ("runs-demo-dit-0002000", "ddim 16"),
              ("runs-demo-dit-0002000", "ddpm-dpm++2m-sde 8"),
              ("runs-demo-dit-0002000", "ddpm-dpm++2m-sde 12")]
    for key in quoted:
        r = rows[key]
        assert r["n"] == r["n_reference"] == 5, key
        assert fid(r) in results_page and ratio(r) in results_page, (key, fid(r), ratio(r))
        assert f"{100 * r['detectable']:.1f} %" in results_page and r["reading"] in results_page
    for key in quoted[:1] + quoted[3:]:
        assert ratio(rows[key]) in readme, key
    guided = {(r["checkpoint"], r["setting"]): r
              for r in nfe.seed_summary_rows(ROOT / "results" / "nfe" / "sample-seeds")
              if r["cfg_scale"] == 1.5 and r["checkpoint"] == "runs-demo-0002000"}
    for key, r in guided.items():
        assert fid(r) in results_page and ratio(r) in results_page, key
    assert ratio(guided["runs-demo-0002000", "unipc 8"]) in readme
    demo = rows["runs-demo-0002000", "unipc 8"]
    assert f"{demo['reference_fid']:.2f} ± {demo['reference_sd']:.2f}" in readme
    for arm in ("sit", "vit-5-g-1"):  # group 7: the ODE's limit on digits8 seed 12
        r = rows[f"digits8-{arm}-seed12-0002000", "ode-dopri5 0.0001"]
        paired = f"{r['paired']:.3f} [{r['paired_lo']:.3f}, {r['paired_hi']:.3f}]"
        assert r["n"] == r["n_reference"] == 5, arm
        row = (f"{fid(r)} | SDE 250: {r['reference_fid']:.2f} ± {r['reference_sd']:.2f} | {ratio(r)} | "
               f"{100 * r['detectable']:.1f} % | {r['reading']} | {paired} |")
        assert row in results_page and ratio(r) in readme, (arm, row)


def test_the_quoted_digits_kind_ratios_are_the_sample_seed_records():
    """The digits8 and digits16 kinds' ratios over training seeds (the rule's interval and the pooled
    paired one) that the results page and the README quote are what ``kind_summary_rows`` computes."""
    table = nfe.seed_summary_rows(ROOT / "results" / "nfe" / "sample-seeds")
    kinds = {(k["cfg_scale"], k["kind"], k["setting"]): k for k in nfe.kind_summary_rows(table)}
    results_page, readme = (_page(ROOT / "results" / "nfe" / "README.md"),
                            _page(ROOT / "docs" / "few-step.md"))  # the README's few-step page

    def interval(value: float, lo: float, hi: float) -> str:
        return f"{value:.3f} [{lo:.3f}, {hi:.3f}]"

    for cfg, dataset, arm, setting in itertools.product((1, 1.5), ("digits8", "digits16"),
                                                        ("sit", "vit-5-g-1"), ("unipc 8", "unipc 16")):
        where = (cfg, dataset, arm, setting)
        k = kinds[cfg, f"{dataset}-{arm}", setting]
        assert k["n_training_seeds"] == 3 and k["n_paired"] == 15
        rule = interval(k["ratio"], k["lo"], k["hi"])
        pooled = interval(k["paired"], k["paired_lo"], k["paired_hi"])
        assert (f"{rule}, {k['reading']}" in results_page
                and f"{pooled}, {k['paired_reading']}" in results_page), where
        per_seed = " / ".join(interval(r["ratio"], r["lo"], r["hi"]) for r in sorted(
            (r for r in table if r["cfg_scale"] == cfg and r["setting"] == setting
             and r["checkpoint"].startswith(f"{dataset}-{arm}-seed")), key=lambda r: r["checkpoint"]))
        assert per_seed.count("/") == 2 and per_seed in results_page, where
        if cfg == 1 or setting == "unipc 8":  # the few-step page: every unguided kind, guided UniPC 8
            assert rule in readme, where
        if cfg == 1.5 and setting == "unipc 8":  # with its pooled interval
            assert pooled in readme, where
    rows = {(r["checkpoint"], r["setting"]): r for r in table if r["cfg_scale"] == 1}
    for name, setting in itertools.product(("sit", "vit-5-g-1"), ("unipc 8", "unipc 16")):
        r = rows[f"digits16-{name}-seed12-0002000", setting]  # seed 12: the 12-04 draw explained
        assert f"{r['fid']:.2f} ± {r['fid_sd']:.2f}" in results_page
        if setting == "unipc 8":
            assert interval(r["ratio"], r["lo"], r["hi"]) in readme, name
