"""Each bench script runs end to end on a tiny config and writes the JSON it promises (no timings checked)."""

from __future__ import annotations

import json
import statistics

import pytest

from bench import attention_tiles, data_path, sample_speed, suite, train_step
from sit_vit5.sample_spec import FEW_STEPS, SampleSpec

TINY = ["--device", "cpu", "--threads", "1", "--warmup", "1", "--steps", "1", "--rounds", "1", "--depth", "1"]


def _load(path):
    out = json.loads(path.read_text())
    assert out["env"]["torch"] and out["settings"]["device"] == "cpu"
    return out


def test_train_step_loop_rows_beside_the_plain_step(tmp_path):
    """--loop: each model's step as training/loop.py runs it (clipping, the two host reads, EMA) timed beside
    its plain step, and the ratio per model from the same rounds."""
    path = tmp_path / "loop.json"
    train_step.main([*TINY, "--rounds", "2", "--sizes", "S", "--input-size", "8", "--batch-size", "2",
                     "--models", "SiT", "ViT5", "--loop", "--json", str(path)])
    out = _load(path)
    rows = {r["model"]: r for r in out["rows"]}
    assert list(rows) == ["SiT", "SiT+loop", "ViT5", "ViT5+loop"]
    (group,) = out["ratios"]
    for b in ("SiT", "ViT5"):
        paired = statistics.median(x / y for x, y in zip(rows[f"{b}+loop"]["rounds_ms"], rows[b]["rounds_ms"]))
        assert group["loop_over_step"][b]["ratio"] == pytest.approx(paired, rel=1e-3)
    assert group["vit5_over_sit"] == pytest.approx(  # the plain steps' ratio, as without --loop
        statistics.median(x / y for x, y in zip(rows["ViT5"]["rounds_ms"], rows["SiT"]["rounds_ms"])), rel=1e-3)


def test_train_step_bench_rows_ratios_and_flops(tmp_path):
    pytest.importorskip("timm")
    path = tmp_path / "train.json"
    train_step.main([*TINY, "--sizes", "S", "--input-size", "8", "--batch-size", "2", "--json", str(path)])
    out = _load(path)
    assert out["bench"] == "train_step"
    assert out["adamw"] == "default"  # the CPU's AdamW, as training builds it (fused: CUDA only)
    assert [r["model"] for r in out["rows"]] == ["SiT", "ViT5", "Timm"]
    for row in out["rows"]:
        assert row["step_ms"] > 0 and row["img_per_s"] == pytest.approx(2e3 / row["step_ms"])
        # training FLOPs = 3 x forward, x 2 because flops() counts a multiply-add once
        assert row["tflops"] == pytest.approx(row["img_per_s"] * 6 * row["fwd_gflops"] / 1e3)
        assert row["mfu"] is None and row["peak_mem_gb"] is None  # CPU: no peak, no CUDA memory
    sit, vit5, timm = out["rows"]
    assert sit["fwd_gflops"] == timm["fwd_gflops"] < vit5["fwd_gflops"]  # ViT-5 adds 4 register tokens
    (ratio,) = out["ratios"]
    paired = lambda a, b: statistics.median(x / y for x, y in zip(a["rounds_ms"], b["rounds_ms"]))  # noqa: E731
    assert ratio["vit5_over_sit"] == pytest.approx(paired(vit5, sit), rel=1e-4)  # rounds_ms are rounded
    assert ratio["sit_over_timm"] == pytest.approx(paired(sit, timm), rel=1e-4)
    assert ratio["vit5_over_sit_min"] == pytest.approx(vit5["step_ms_min"] / sit["step_ms_min"])
    path = tmp_path / "no_optimizer.json"  # forward + backward only; one model: no ratio
    train_step.main([*TINY, "--sizes", "S", "--input-size", "8", "--batch-size", "2", "--models", "SiT",
                     "--optimizer", "none", "--json", str(path)])
    out = _load(path)
    assert len(out["rows"]) == 1 and out["ratios"][0]["vit5_over_sit"] is None


def test_sample_bench_counts_function_evaluations(tmp_path):
    path = tmp_path / "sample.json"
    sample_speed.main([*TINY, "--sizes", "S", "--input-size", "8", "--batch-size", "2", "--num-steps", "3",
                 "--samplers", "sde", "ode", "--json", str(path)])
    rows = _load(path)["rows"]
    assert [(r["model"], r["sampler"]) for r in rows] == [("SiT", "sde"), ("ViT5", "sde"), ("SiT", "ode"),
                                                          ("ViT5", "ode")]
    assert [r["nfe"] for r in rows] == [3, 3, 2, 2]  # SDE: 2 Euler steps + the last step; ODE: 2 Euler steps
    for row in rows:
        assert row["img_per_s"] == pytest.approx(2 / row["run_s"])
        assert row["ms_per_nfe"] == pytest.approx(row["run_s"] * 1e3 / row["nfe"])


def test_sample_bench_settings_side_by_side_with_speedups(tmp_path):
    """--settings: the NFE study's solvers at given NFEs on one model, each row's speedup against the first."""
    path = tmp_path / "settings.json"
    sample_speed.main([*TINY, "--models", "SiT", "--sizes", "S", "--input-size", "8", "--batch-size", "2",
                       "--rounds", "2", "--cfg-scale", "1", "--settings", "sde-euler-mean:6", "unipc:3",
                       "ode-heun:4", "--json", str(path)])
    rows = _load(path)["rows"]
    assert [(r["setting"], r["nfe"]) for r in rows] == [("sde-euler-mean:6", 6), ("unipc:3", 3), ("ode-heun:4", 4)]
    reference = rows[0]["rounds_s"]
    for row in rows:
        paired = statistics.median(a / b for a, b in zip(reference, row["rounds_s"]))
        assert row["speedup"] == pytest.approx(paired, rel=0.02)  # rounds_s are rounded to 0.1 ms
        assert row["img_per_s"] == pytest.approx(2 / row["run_s"])
    assert rows[0]["speedup"] == 1
    assert all(s in suite.STAGES["sample_fewstep"][1] for s in sample_speed.FEW_STEP_SETTINGS)


def test_sample_bench_times_the_dit_objective_on_the_same_network(tmp_path):
    """DDPM and DPM-Solver++ 2M SDE sample the network as a DiT-objective model (one evaluation a step), beside
    a SiT setting; the GPU stage carries the DiT objective's few-step setting of sample_spec.FEW_STEPS."""
    path = tmp_path / "dit.json"
    sample_speed.main([*TINY, "--models", "SiT", "--sizes", "S", "--input-size", "8", "--batch-size", "2",
                       "--rounds", "2", "--cfg-scale", "1.5", "--settings", "sde-euler-mean:6", "ddpm:6",
                       "ddpm-dpm++2m-sde:4", "--json", str(path)])
    rows = _load(path)["rows"]
    assert [(r["setting"], r["nfe"]) for r in rows] == [("sde-euler-mean:6", 6), ("ddpm:6", 6),
                                                        ("ddpm-dpm++2m-sde:4", 4)]
    assert all(r["run_s"] > 0 and r["speedup"] > 0 for r in rows)
    few = FEW_STEPS["ddpm"]
    assert f"ddpm-{few['sampling_method']}:{SampleSpec(**few).nfe}" in sample_speed.FEW_STEP_SETTINGS


def test_data_path_bench_fractions(tmp_path):
    path = tmp_path / "data.json"
    data_path.main([*TINY, "--vae", "tiny", "--image-size", "32", "--num-images", "4", "--batch-size", "2",
                    "--workdir", str(tmp_path / "work"), "--json", str(path)])
    out = _load(path)
    assert out["latent_shape"] == [4, 4, 4]  # 32 px through an 8x-downsampling VAE
    raw, cache, step = out["rows"]
    assert raw["batch_ms"] == pytest.approx(raw["decode_ms"] + raw["encode_ms"])
    for row in (raw, cache):
        assert row["fraction_of_step"] == pytest.approx(row["batch_ms"] / step["batch_ms"])
    assert (tmp_path / "work" / "latents" / "manifest.json").is_file()


def test_attention_tiles_bench_prices_ragged_tails(tmp_path):
    """The model's column: 260 tokens cost 3 x 5 flash tiles where 256 cost 2 x 4; 384 fills whole tiles, so its
    predicted ratio is its FLOP ratio."""
    path = tmp_path / "tiles.json"
    attention_tiles.main([*TINY, "--batch-size", "1", "--heads", "1", "--tokens", "256", "260", "384",
                          "--backends", "math", "cudnn", "--json", str(path)])
    rows = _load(path)["rows"]
    assert [r["tokens"] for r in rows] == [256, 260, 384]
    assert rows[1]["model_ratio"] == pytest.approx(1.875) and rows[1]["flop_ratio"] == pytest.approx(1.03, abs=0.01)
    assert rows[2]["model_ratio"] == pytest.approx(rows[2]["flop_ratio"]) == pytest.approx(2.25)
    assert all(r["ms"] > 0 and r["fwd_ms"] > 0 for r in rows)
    # the opt-in tail attention is timed where it applies (260 = 256 + 4, bf16), and only there
    assert [r["split_ms"] is not None for r in rows] == [False, True, False] and rows[1]["split_ms"] > 0
    # SDPA held to another kernel: math runs on a CPU, cuDNN's is skipped (reported, not fatal)
    assert all(r["math_ms"] > 0 and "cudnn_ms" not in r for r in rows)


def test_suite_runs_every_stage_and_writes_one_json_each(tmp_path):
    pytest.importorskip("timm")
    status = suite.main(["--out", str(tmp_path), "--smoke"])
    assert status == {name: "ok" for name in suite.STAGES}
    for name in suite.STAGES:
        assert _load(tmp_path / f"{name}.json")["rows"]


def test_bad_arguments_are_named():
    for main, bad in ((train_step.main, ["--sizes", "M"]), (sample_speed.main, ["--samplers", "heun"]),
                      (sample_speed.main, ["--settings", "ode-heun:3"]), (sample_speed.main, ["--settings", "ddim:64"]),
                      (data_path.main, ["--model", "SiT-M/2"]), (train_step.main, ["--rounds", "0"])):
        with pytest.raises(SystemExit) as err:
            main([*TINY, *bad])
        assert err.value.code  # argparse / setup refuse with a nonzero status before any work
