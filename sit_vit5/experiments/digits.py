"""Small-scale reproduction of the ViT-5 vs SiT comparison on the embedded 8x8 digits (CPU, minutes a run).

Every run trains one variant of ``configs/digits/repro.yaml`` (same recipe, steps and data for all), then
draws ``num_samples`` images from its EMA weights (labels i mod 10, per-sample seeds) and scores them with the
digits feature network of ``fid.digits``: digits-FID against the 1,797 real digits and class accuracy.
Loss spikes are counted on the per-step training loss (see ``count_spikes``). Results are cached per run
(``result.json`` in its run directory), so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fid.digits import digits_metrics

from .. import training
from ..config import load_config
from ..models import count_params, flops, load_model
from ..sampling import SampleSpec, SamplingPipeline
from ..training.checkpoint import latest_checkpoint
from . import report

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "configs" / "digits" / "repro.yaml"

#: The two backbones compared at matched size (the base config shrinks both identically).
BACKBONES: dict[str, dict[str, Any]] = {"SiT": {"name": "SiT-S/2"}, "ViT-5": {"name": "ViT5-S/2"}}

#: The paper's leave-one-out ablation: ViT-5 minus each of its 7 components, and the LayerScale x SwiGLU pair.
ABLATIONS: dict[str, dict[str, Any]] = {
    "ViT-5 − LayerScale": {"layer_scale_init": None},
    "ViT-5 − RMSNorm (LayerNorm)": {"norm": "layernorm"},
    "ViT-5 − QK-Norm": {"qk_norm": False},
    "ViT-5 + qkv bias": {"qkv_bias": True},
    "ViT-5 − APE (RoPE only)": {"pos_embed": "none"},
    "ViT-5 − RoPE (APE only)": {"rope": False, "register_rope_theta": None},
    "ViT-5 − registers": {"num_registers": 0},
    "ViT-5 + SwiGLU": {"mlp": "swiglu"},
    "ViT-5 + SwiGLU − LayerScale": {"mlp": "swiglu", "layer_scale_init": None},
}


def count_spikes(losses: Sequence[float], window: int = 100, factor: float = 2.0, skip: int = 100) -> int:
    """Steps whose loss exceeds ``factor`` x the median of the previous ``window`` losses (after ``skip``)."""
    spikes = 0
    for i in range(max(skip, window), len(losses)):
        if losses[i] > factor * statistics.median(losses[i - window : i]):
            spikes += 1
    return spikes


@dataclass
class RunSpec:
    """One training run of the sweep."""

    variant: str
    model: dict[str, Any]
    seed: int
    steps: int
    runs_dir: str
    num_samples: int = 1000
    sample_steps: int = 50
    base_config: str = str(BASE_CONFIG)
    extra_overrides: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        slug = "".join(c if c.isalnum() else "-" for c in self.variant.lower().replace("−", "minus"))
        return Path(self.runs_dir) / f"{'-'.join(filter(None, slug.split('-')))}" / f"seed{self.seed}"

    def overrides(self) -> list[str]:
        model = [f"model.{k}={'null' if v is None else v}" for k, v in self.model.items()]
        return [*model, f"train.seed={self.seed}", f"train.steps={self.steps}", f"train.ckpt_every={self.steps}",
                f"train.sample_every={self.steps}", "train.log_every=1", f"train.out_dir={self.run_dir}",
                *self.extra_overrides]


def _read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in sorted(rows, key=lambda r: r["step"]) if "loss" in row]


def run_one(spec: RunSpec, threads: int | None = None) -> dict[str, Any]:
    """Train (or resume) one run, evaluate it and return its result dict (cached in ``result.json``)."""
    if threads:
        torch.set_num_threads(threads)
    run_dir = spec.run_dir
    cached = run_dir / "result.json"
    cfg = load_config(spec.base_config, spec.overrides())
    requested = json.loads(json.dumps(cfg))  # the request as JSON (tuples -> lists), to compare
    if cached.is_file():
        result = json.loads(cached.read_text())
        if result.get("config") == requested:
            return result
        shutil.rmtree(run_dir)  # settings changed: start over
    resume = "latest" if latest_checkpoint(run_dir / "checkpoints") is not None else None
    start = time.perf_counter()
    trained = training.train(cfg, resume=resume)  # looked up at call time (tests patch it)
    train_seconds = time.perf_counter() - start

    loaded = load_model(trained.checkpoint)
    model = loaded.model
    sample_spec = SampleSpec(method="ode", sampling_method="euler", num_steps=spec.sample_steps)
    pipeline = SamplingPipeline.for_model(loaded, sample_spec)
    indices = list(range(spec.num_samples))
    labels = [i % model.num_classes for i in indices]
    pixels, all_labels = [], []
    for start_i in range(0, spec.num_samples, 250):
        batch = pipeline.generate(indices[start_i : start_i + 250], global_seed=spec.seed,
                                  labels=labels[start_i : start_i + 250])
        pixels.append(batch.pixels)
        all_labels.append(torch.as_tensor(batch.labels))
    metrics = digits_metrics(torch.cat(pixels).clamp(-1, 1), torch.cat(all_labels))
    losses = _read_losses(run_dir)
    tail = losses[-100:]
    result = {
        "variant": spec.variant, "seed": spec.seed, "steps": spec.steps, "model": cfg["model"]["name"],
        "num_samples": spec.num_samples,
        "params": count_params(model), "mflops": flops(model) * 1e3,
        "digits_fid": metrics["digits_fid"], "accuracy": metrics["digits_accuracy"],
        "loss_spikes": count_spikes(losses), "final_loss": sum(tail) / max(1, len(tail)),
        "train_seconds": train_seconds, "sample_grid": str(trained.sample_grid), "run_dir": str(run_dir),
        "config": requested,
    }
    cached.write_text(json.dumps(result, indent=1))
    return result


def _worker(spec: RunSpec, threads: int) -> dict[str, Any]:
    os.environ["TQDM_DISABLE"] = "1"  # parallel runs would garble each other's bars; the sweep has its own
    return run_one(spec, threads)


def sweep(specs: Sequence[RunSpec], jobs: int = 1) -> list[dict[str, Any]]:
    """Run every spec (``jobs`` processes with ``ceil(cores / jobs)`` threads each); results in spec order."""
    threads = max(1, math.ceil((os.cpu_count() or 1) / jobs))
    results: dict[int, dict[str, Any]] = {}
    bar = tqdm(total=len(specs), desc="digits runs", unit="run")
    if jobs <= 1:
        for i, spec in enumerate(specs):
            results[i] = run_one(spec, threads)
            bar.update()
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_worker, spec, threads): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                r = results[futures[future]]
                bar.set_postfix_str(f"{r['variant']} s{r['seed']}: FID {r['digits_fid']:.2f}")
                bar.update()
    bar.close()
    return [results[i] for i in range(len(specs))]


def plan(seeds: int = 3, ablation_seeds: int = 1, steps: int = 2000, runs_dir: str = "runs/digits-repro",
         num_samples: int = 1000, ablations: bool = True, extra_overrides: Sequence[str] = ()) -> list[RunSpec]:
    """The runs of the reproduction: both backbones x ``seeds``, then each ablation x ``ablation_seeds``."""
    common = dict(steps=steps, runs_dir=runs_dir, num_samples=num_samples, extra_overrides=list(extra_overrides))
    specs = [RunSpec(v, m, s, **common) for s in range(seeds) for v, m in BACKBONES.items()]
    if ablations:
        vit5 = BACKBONES["ViT-5"]
        specs += [RunSpec(v, {**vit5, **sw}, s, **common) for s in range(ablation_seeds) for v, sw in ABLATIONS.items()]
    return specs


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: mean ± std over seeds of FID, accuracy, spikes, final loss; params and MFLOPs."""
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["variant"] == variant]

        def ms(key: str, runs: list[dict[str, Any]] = runs) -> tuple[float, float]:
            values = [float(r[key]) for r in runs]
            return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")

        fid, fid_sd = ms("digits_fid")
        acc, acc_sd = ms("accuracy")
        spikes, _ = ms("loss_spikes")
        loss, _ = ms("final_loss")
        rows.append({
            "variant": variant, "seeds": len(runs), "params": runs[0]["params"], "MFLOPs": runs[0]["mflops"],
            "digits_fid": fid, "digits_fid_std": fid_sd, "accuracy": acc, "accuracy_std": acc_sd,
            "loss_spikes": spikes, "final_loss": loss,
            "digits-FID": f"{fid:.3f} ± {fid_sd:.3f}" if len(runs) > 1 else f"{fid:.3f}",
            "class acc.": f"{acc:.3f} ± {acc_sd:.3f}" if len(runs) > 1 else f"{acc:.3f}",
            "train s": statistics.fmean(r["train_seconds"] for r in runs),
        })
    return rows


def _git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(results: Sequence[dict[str, Any]], out_dir: str | os.PathLike, command: str) -> Path:
    """results/digits: README.md (table, command, commit), results.csv, runs.csv, fid.png, loss.png, grids."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    columns = ["variant", "seeds", "params", "MFLOPs", "digits-FID", "class acc.", "loss_spikes", "final_loss",
               "train s"]
    report.write_csv(rows, ["variant", "seeds", "params", "MFLOPs", "digits_fid", "digits_fid_std", "accuracy",
                            "accuracy_std", "loss_spikes", "final_loss"], out / "results.csv")
    report.write_csv(results, ["variant", "seed", "steps", "params", "mflops", "digits_fid", "accuracy",
                               "loss_spikes", "final_loss", "train_seconds"], out / "runs.csv")
    report.plot_bars([r["variant"] for r in rows], [r["digits_fid"] for r in rows],
                     [0.0 if math.isnan(r["digits_fid_std"]) else r["digits_fid_std"] for r in rows],
                     out / "fid.png", "digits-FID (lower is better)", "8x8 digits, same recipe and steps",
                     highlight=list(BACKBONES))
    curves = {}
    for variant in BACKBONES:
        run = next((r for r in results if r["variant"] == variant and r["seed"] == 0), None)
        if run is None:
            continue
        losses = _read_losses(Path(run["run_dir"]))
        k = 50  # moving average over 50 steps
        smooth = [statistics.fmean(losses[max(0, i - k) : i + 1]) for i in range(len(losses))]
        curves[variant] = (list(range(1, len(losses) + 1)), smooth)
        if run.get("sample_grid") and Path(run["sample_grid"]).is_file():
            shutil.copy(run["sample_grid"], out / f"samples-{variant.lower().replace('-', '')}.png")
    if curves:
        report.plot_curves(curves, out / "loss.png", "step", "training loss (50-step mean)", "seed 0", logy=True)
    baseline = {r["variant"]: r for r in rows}
    verdict = ""
    if {"SiT", "ViT-5"} <= baseline.keys():
        sit, vit5 = baseline["SiT"], baseline["ViT-5"]
        better = "lower (better)" if vit5["digits_fid"] < sit["digits_fid"] else "higher (worse)"
        verdict = (f"ViT-5 digits-FID {vit5['digits-FID']} vs SiT {sit['digits-FID']}: ViT-5 is {better} at "
                   f"this scale.\n")
    text = (f"# Digits reproduction: ViT-5 vs SiT\n\nCommand: `{command}`  \nCommit: `{_git_commit()}`  \n"
            f"Base config: `configs/digits/repro.yaml`; {results[0]['steps']} steps per run; metrics from "
            f"`fid.digits` on {results[0]['num_samples']} samples of the EMA weights (ODE Euler, labels i mod 10)."
            "\n\n"
            f"{verdict}\n{report.markdown_table(rows, columns)}\n"
            "![digits-FID](fid.png)\n\n![loss](loss.png)\n")
    (out / "README.md").write_text(text)
    return out / "README.md"
