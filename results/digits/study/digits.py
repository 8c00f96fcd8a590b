"""The digits proxy for "ViT-5 vs SiT": small backbones on scikit-learn's digits, CPU, minutes a run.

The protocol (datasets, variants, seeds, checkpoints, metrics, decision rules) is fixed in
``results/digits/PROTOCOL.md``, written and committed before any run of it was read (later additions dated,
each saying whether it came before its runs; the paper's other claims: ``claims``; sample quality:
``samples``). In short: every variant trains on
the train split of the digits at 8×8 (16 tokens) and upsampled to 16×16 (64 tokens) with the recipe of
``configs/digits/repro.yaml``; at 25/50/75/100 % of the run its EMA weights are scored by

* the held-out flow-matching loss: the run's own transport loss on the test split, on a fixed grid of
  ``HELDOUT_TIMES`` times per image with noise from a fixed seed (the same draws for every run), and
* digits-FID and class accuracy of ``num_samples`` samples (ODE Euler, labels i mod 10, fixed noise seed).

Every run is cached as one JSON file under ``results/digits/runs/`` (committed: a later session continues a
sweep where the last one stopped); checkpoints live in the run directory under ``runs/``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from multiprocessing import get_context, parent_process
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from tqdm import tqdm

from fid.digits import digits_metrics, load_digits_net
from fid.metrics import precision_recall
from sit_vit5 import training
from sit_vit5.config import configs_dir, load_config
from sit_vit5.datasets import DigitsDataset
from sit_vit5.experiments import report
from sit_vit5.experiments.nfe import git_commit, utc_now
from sit_vit5.models import count_params, flops, load_model, model_from_config
from sit_vit5.models.layers import sincos_pos_embed_2d
from sit_vit5.objective import transport_kwargs
from sit_vit5.sampling import SampleSpec, SamplingPipeline
from sit_vit5.training.checkpoint import checkpoint_name, latest_checkpoint
from sit_vit5.training.data import build_dataset
from sit_vit5.transport import create_transport
from sit_vit5.utils.atomic_files import TMP_PREFIX, atomic_write_text
from sit_vit5.utils.errors import SitVit5Error

STUDY = Path(__file__).resolve().parent  # results/digits/study: the code of this study
REPO = STUDY.parents[2]
BASE_CONFIG = configs_dir() / "digits" / "repro.yaml"
RESULTS = Path("results") / "digits"  # relative: the report goes where the command runs

#: The two datasets: dotted overrides of the base config.
DATASETS: dict[str, list[str]] = {"digits8": ["data.image_size=8"], "digits16": ["data.image_size=16"]}
CHECKPOINT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
DEFAULT_STEPS = 2000  # the common recipe's run length (configs/digits/repro.yaml)
HELDOUT_TIMES, HELDOUT_SEED = 8, 20261130  # t_k = (k + 1/2) / 8 on the transport's interval
SAMPLE_SEED = 0  # the same initial noise for every run: paired comparisons between variants

_VIT5 = {"model.name": "ViT5-S/2"}
_NEW = {**_VIT5, "model.layer_scale_init": 1.0}
#: Every variant as dotted config overrides of the base config (the runs spell γ0 out, so that changing the
#: ViT5 default cannot change a cached run).
PROXY_VARIANTS: dict[str, dict[str, Any]] = {
    "SiT": {"model.name": "SiT-S/2"},
    "ViT-5 (γ0=1)": _NEW,
    "ViT-5 (γ0=1e-4)": {**_VIT5, "model.layer_scale_init": 1e-4},
    "ViT-5 − LayerScale": {**_VIT5, "model.layer_scale_init": None},
    # leave-one-out on ViT-5 (γ0=1); "− LayerScale" above is the seventh component
    "ViT-5 − RMSNorm": {**_NEW, "model.norm": "layernorm"},
    "ViT-5 − QK-Norm": {**_NEW, "model.qk_norm": False},
    "ViT-5 + qkv bias": {**_NEW, "model.qkv_bias": True},
    "ViT-5 − APE": {**_NEW, "model.pos_embed": "none"},
    "ViT-5 − RoPE": {**_NEW, "model.rope": False, "model.register_rope_theta": None},
    "ViT-5 − registers": {**_NEW, "model.num_registers": 0},
    # LayerScale x SwiGLU: our FLOP-matched SwiGLU and the official one (4·D hidden, bias-free)
    "ViT-5 + SwiGLU": {**_NEW, "model.mlp": "swiglu"},
    "ViT-5 + SwiGLU − LayerScale": {**_NEW, "model.mlp": "swiglu", "model.layer_scale_init": None},
    "ViT-5 + SwiGLU-official": {**_NEW, "model.mlp": "swiglu_vit5"},
    "ViT-5 + SwiGLU-official − LayerScale": {**_NEW, "model.mlp": "swiglu_vit5", "model.layer_scale_init": None},
    "ViT-5 (γ0=1e-4) + SwiGLU-official": {**_VIT5, "model.mlp": "swiglu_vit5", "model.layer_scale_init": 1e-4},
    # the paper's third row: the SiT backbone under DiT's objective (DDPM, ε + learned variance)
    "DiT w. ViT": {"model.name": "DiT-S/2", "model.learn_sigma": True, "transport.objective": "ddpm",
                   "sample.method": "ddim"},
    # exploratory (added later): IDDPM's cosine schedule, made for low resolution, instead of DiT's linear one
    "DiT w. ViT (cosine)": {"model.name": "DiT-S/2", "model.learn_sigma": True, "transport.objective": "ddpm",
                            "transport.noise_schedule": "cosine", "sample.method": "ddim"},
}

# The claims addition (PROTOCOL.md, 2026-12-01): every setting spelled out, so no code default enters a run.
_SIT_ALL = {"model.name": "SiT-S/2", "model.norm": "layernorm", "model.qk_norm": False, "model.qkv_bias": True,
            "model.layer_scale_init": None, "model.mlp": "gelu", "model.mlp_act": "gelu_tanh",
            "model.pos_embed": "fixed", "model.rope": False, "model.rope_theta": 10000.0,
            "model.num_registers": 0, "model.register_rope_theta": None}
_VIT5_ALL = {"model.name": "ViT5-S/2", "model.norm": "rmsnorm", "model.qk_norm": True, "model.qkv_bias": False,
             "model.layer_scale_init": 1.0, "model.mlp": "gelu", "model.mlp_act": "gelu_tanh",
             "model.pos_embed": "learned", "model.rope": True, "model.rope_theta": 10000.0,
             "model.num_registers": 4, "model.register_rope_theta": 100.0}
SIZES = {"6×96": {"model.depth": 6, "model.hidden_size": 96, "model.num_heads": 6},
         "8×128": {"model.depth": 8, "model.hidden_size": 128, "model.num_heads": 8}}
BASE_SIZE = "4×64"  # the base config's depth × width
SPIKE_LRS = (3e-3, 1e-2)
EXTRA_SPIKE_LR = 3e-2  # only if SiT spikes at neither of SPIKE_LRS (protocol)
_NO_QK = {**_VIT5_ALL, "model.qk_norm": False}
CLAIM_VARIANTS: dict[str, dict[str, Any]] = {
    # C3: where the registers' RoPE matters
    "ViT-5 registers without RoPE": {**_VIT5_ALL, "model.register_rope_theta": None},
    "ViT-5 registers at θ=1e4": {**_VIT5_ALL, "model.register_rope_theta": 10000.0},
    # C7: the official code's exact GELU (ours: SiT's tanh approximation)
    "ViT-5 (γ0=1) exact GELU": {**_VIT5_ALL, "model.mlp_act": "gelu"},
    # C4: learning rates at which loss spikes can appear (no gradient clipping in the base config)
    **{f"{name} lr={lr:g}": {**base, "optim.lr": lr, "optim.grad_clip": None}
       for lr in (*SPIKE_LRS, EXTRA_SPIKE_LR)
       for name, base in (("SiT", _SIT_ALL), ("ViT-5 (γ0=1)", _VIT5_ALL), ("ViT-5 − QK-Norm", _NO_QK))},
    # C1: two larger sizes (head dim 16 as at 4×64)
    **{f"{name} {size}": {**base, **dims} for size, dims in SIZES.items()
       for name, base in (("SiT", _SIT_ALL), ("ViT-5 (γ0=1)", _VIT5_ALL))},
}
# C5: trained like the main pair; their final checkpoints are also scored at other image sizes
CLAIM_VARIANTS.update({"SiT (resolution)": _SIT_ALL, "ViT-5 (γ0=1) (resolution)": _VIT5_ALL})
EVAL_SIZES: dict[str, tuple[int, ...]] = {v: (6, 12, 16) for v in ("SiT (resolution)", "ViT-5 (γ0=1) (resolution)")}
# The REPA addition (PROTOCOL.md, 2026-12-02): the digits feature network as the target, every key
# spelled out
REPA_SETTINGS = {"repa.encoder": "digits", "repa.weights": None, "repa.depth": 1,
                 "repa.projector_dim": 128, "repa.coeff": 0.5, "repa.resolution": None,
                 "repa.mean": None, "repa.std": None, "repa.interpolation": "bicubic"}
REPA_VARIANTS: dict[str, dict[str, Any]] = {"SiT + REPA": {**_SIT_ALL, **REPA_SETTINGS},
                                            "ViT-5 (γ0=1) + REPA": {**_VIT5_ALL, **REPA_SETTINGS}}
# The sample-quality addition (PROTOCOL.md, 2026-12-04): the main pair's own settings under other names, so
# a rerun (FID16 for seeds that predate the 16×16 network) and a 5× longer run are cache entries of their own.
LONG_STEPS = 10_000
RERUN = {"SiT (rerun)": "SiT", "ViT-5 (γ0=1) (rerun)": "ViT-5 (γ0=1)"}
LONG = {"SiT (10k steps)": "SiT", "ViT-5 (γ0=1) (10k steps)": "ViT-5 (γ0=1)"}
LONG_OF = {base: variant for variant, base in LONG.items()}  # backbone → its 10k-step variant
SAMPLE_VARIANTS: dict[str, dict[str, Any]] = {v: PROXY_VARIANTS[base] for v, base in {**RERUN, **LONG}.items()}
FIRST_SAMPLE_SEED = 6  # the main pair's seeds 0–5 belong to the earlier additions, 6 on to the sample-quality one
# The MeanFlow addition (PROTOCOL.md, 2026-12-06): every objective key written out (names.MEANFLOW_DEFAULTS with
# configs/demo-meanflow.yaml's guidance off), the common recipe's no clipping spelled too (the demo clips at 1.0),
# and the training grid sampled by the objective's own method (the base config's ODE is a flow sampler).
MEANFLOW_SETTINGS: dict[str, Any] = {
    "transport.objective": "meanflow", "model.interval_embed": True, "model.learn_sigma": False,
    "transport.meanflow_time_mean": -0.4, "transport.meanflow_time_std": 1.0, "transport.meanflow_ratio": 0.25,
    "transport.meanflow_norm_p": 1.0, "transport.meanflow_norm_c": 0.01, "transport.meanflow_omega": 1.0,
    "transport.meanflow_kappa": 0.0, "transport.meanflow_class_dropout": 0.1, "optim.grad_clip": None,
    "sample.method": "meanflow", "sample.num_steps": 1, "sample.sampling_method": None}
MEANFLOW_ARMS = {"SiT (meanflow)": "SiT", "ViT-5 (γ0=1) (meanflow)": "ViT-5 (γ0=1)"}  # arm → its flow pair
# the flow main pair retrained with its own overrides (its checkpoints are not kept): SDE-250 at the end
FLOW_REFERENCES = {"SiT (flow reference)": "SiT", "ViT-5 (γ0=1) (flow reference)": "ViT-5 (γ0=1)"}
MEANFLOW_VARIANTS: dict[str, dict[str, Any]] = {
    "SiT (meanflow)": {**_SIT_ALL, **MEANFLOW_SETTINGS},
    "ViT-5 (γ0=1) (meanflow)": {**_VIT5_ALL, **MEANFLOW_SETTINGS},
    **{v: PROXY_VARIANTS[base] for v, base in FLOW_REFERENCES.items()}}
MEANFLOW_NFES = (1, 2, 4)  # every checkpoint of a meanflow run: 1 is the primary (unsuffixed keys)
# SampleSpec keywords sampled once, at the final checkpoint, per variant (the flow references' 250-NFE SDE:
# SampleSpec's defaults = SiT's sample.py: Euler, σ diffusion, last step Mean 0.04)
FINAL_SAMPLES: dict[str, dict[str, dict[str, Any]]] = {
    v: {"sde250": {"method": "sde", "sampling_method": "Euler", "num_steps": 250}} for v in FLOW_REFERENCES}
GRID_SEED, GRID_IMAGES = 0, 40  # the report's grids: seed 0, the first 40 of the 1,000 samples
# the grids each variant's seed-0 run draws at its final checkpoint (label → SampleSpec keywords)
GRIDS: dict[str, dict[str, dict[str, Any]]] = {
    **{v: {f"{k} NFE": {"method": "meanflow", "num_steps": k} for k in MEANFLOW_NFES} for v in MEANFLOW_ARMS},
    **{v: {"UniPC-8": {"method": "ode", "sampling_method": "unipc", "num_steps": 9},
           "SDE-250": FINAL_SAMPLES[v]["sde250"]} for v in FLOW_REFERENCES}}
VARIANTS: dict[str, dict[str, Any]] = {**PROXY_VARIANTS, **CLAIM_VARIANTS, **REPA_VARIANTS, **SAMPLE_VARIANTS,
                                       **MEANFLOW_VARIANTS}
MAIN = ("SiT", "ViT-5 (γ0=1)", "ViT-5 (γ0=1e-4)", "ViT-5 − LayerScale")
THIRD_ROW = ("DiT w. ViT", "DiT w. ViT (cosine)")  # added after the protocol's first version: after MAIN
LAYER_SCALE_CANDIDATES = ("ViT-5 (γ0=1)", "ViT-5 (γ0=1e-4)", "ViT-5 − LayerScale")
DECISION_SEEDS = 3  # the LayerScale rule reads seeds 0–2, the protocol's main-variant seeds
ABLATIONS = tuple(v for v in PROXY_VARIANTS if v not in MAIN + THIRD_ROW)
PLOTTED = MAIN + THIRD_ROW  # the curves, as the paper's Fig. 6


def count_spikes(losses: Sequence[float], window: int = 100, factor: float = 2.0, skip: int = 100) -> int:
    """Steps whose loss exceeds ``factor`` x the median of the previous ``window`` losses (after ``skip``)."""
    spikes = 0
    for i in range(max(skip, window), len(losses)):
        if losses[i] > factor * statistics.median(losses[i - window : i]):
            spikes += 1
    return spikes


def slug(text: str) -> str:
    """File-name form of a variant name: ``ViT-5 − QK-Norm`` -> ``vit-5-minus-qk-norm``."""
    text = text.lower().replace("−", "minus").replace("+", "plus").replace("γ0", "g").replace("θ", "theta")
    return "-".join(filter(None, "".join(c if c.isalnum() or c == "." else "-" for c in text).split("-")))


@dataclass
class RunSpec:
    """One training run of the sweep: a variant on a dataset with a seed."""

    dataset: str
    variant: str
    seed: int
    steps: int = 2000
    runs_dir: str = "runs/digits-proxy"
    results_dir: str = str(RESULTS)
    num_samples: int = 1000
    sample_steps: int = 25
    base_config: str = str(BASE_CONFIG)
    extra_overrides: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.dataset / slug(self.variant) / f"seed{self.seed}"

    @property
    def result_path(self) -> Path:
        return Path(self.results_dir) / "runs" / self.dataset / f"{slug(self.variant)}-seed{self.seed}.json"

    @property
    def log_path(self) -> Path:
        """The console of the run in a parallel sweep (beside ``run_dir``: a restart from scratch
        keeps it; appended on resume)."""
        return self.run_dir.with_name(f"seed{self.seed}.log")

    @property
    def checkpoint_steps(self) -> list[int]:
        return [round(f * self.steps) for f in CHECKPOINT_FRACTIONS]

    def overrides(self) -> list[str]:
        every = self.checkpoint_steps[0]
        variant = [f"{k}={'null' if v is None else v}" for k, v in VARIANTS[self.variant].items()]
        return [*DATASETS[self.dataset], *variant, "data.split=train", f"train.seed={self.seed}",
                f"train.steps={self.steps}", f"train.ckpt_every={every}",
                f"train.keep_last={len(CHECKPOINT_FRACTIONS)}", f"train.sample_every={self.steps}",
                "train.log_every=1", f"train.out_dir={self.run_dir}", *self.extra_overrides]


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["step"])


def _block_means(rows: Sequence[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """Rows ``{"step", "value"}``: the mean of every per-block metric ``prefix + "NN"`` of each row."""
    out = []
    for r in rows:
        values = [v for k, v in r.items() if k.startswith(prefix) and k[len(prefix):].isdigit()]
        out.append({"step": r["step"], "value": statistics.fmean(values) if values else None})
    return out


def layer_scale_summary(model: nn.Module) -> dict[str, float] | None:
    """Mean |γ| of the attention and MLP LayerScales over blocks and channels (None without LayerScale)."""
    blocks = [b for b in getattr(model, "blocks", []) if getattr(b, "gamma_1", None) is not None]
    if not blocks:
        return None
    return {"attn": statistics.fmean(b.gamma_1.abs().mean().item() for b in blocks),
            "mlp": statistics.fmean(b.gamma_2.abs().mean().item() for b in blocks)}


def _curve(rows: Sequence[dict[str, Any]], key: str, every: int = 20) -> list[list[float]]:
    """``[[step, mean of key over the last `every` steps], ...]``: a compact training curve (short runs: at
    least four points)."""
    every = max(1, min(every, len(rows) // 4))
    points = []
    for end in range(every, len(rows) + 1, every):
        values = [r[key] for r in rows[end - every : end] if r.get(key) is not None]
        if values:
            points.append([rows[end - 1]["step"], statistics.fmean(values)])
    return points


def test_split(cfg: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """All test-split images (N, C, H, W) in [-1, 1] and labels (N,) of the run's data section."""
    dataset = build_dataset({**cfg["data"], "split": "test", "random_flip": False, "seed": 0})
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.tensor(labels)


@torch.no_grad()
def heldout_loss(model: nn.Module, transport, x1: Tensor, y: Tensor, num_times: int = HELDOUT_TIMES,
                 seed: int = HELDOUT_SEED) -> float:
    """Mean transport loss on ``(x1, y)`` over the fixed grid t_k = t0 + (t1 − t0)(k + ½)/num_times, with
    noise from generators seeded ``seed + k``: deterministic, and the same draws for every model."""
    model.eval()
    t0, t1 = transport.check_interval(transport.train_eps, transport.sample_eps)
    total = 0.0
    for k in range(num_times):
        x0 = torch.randn(x1.shape, generator=torch.Generator().manual_seed(seed + k))
        t = torch.full((len(x1),), t0 + (t1 - t0) * (k + 0.5) / num_times)
        total += transport.losses_at(model, t, x0, x1, dict(y=y))["loss"].mean().item()
    return total / num_times


def evaluate_checkpoint(path: Path, spec: RunSpec, test_data: tuple[Tensor, Tensor]) -> dict[str, float]:
    """Held-out loss, digits-FID and accuracy of the EMA weights in checkpoint ``path`` (a meanflow model: at
    each of ``MEANFLOW_NFES``, the first unsuffixed, the others with the suffix ``_nfe<k>``)."""
    loaded = load_model(path)
    model = loaded.model
    extra: dict[str, SampleSpec] = {}
    if loaded.objective_name in ("sit", "meanflow"):
        # a meanflow model without an interval computes exactly its h = 0 function (the interval embedding
        # is h_emb(h) − h_emb(0)): the velocity it also learns, scored by the common flow-matching loss
        loss = heldout_loss(model, create_transport(**transport_kwargs(loaded.objective)), *test_data)
        spec_ = SampleSpec(method="ode", sampling_method="euler", num_steps=spec.sample_steps)
        if loaded.objective_name == "meanflow":  # PROTOCOL.md, 2026-12-06: 1 NFE primary, 2 and 4 beside
            first, *others = MEANFLOW_NFES
            spec_ = SampleSpec(method="meanflow", num_steps=first)
            extra = {f"_nfe{k}": SampleSpec(method="meanflow", num_steps=k) for k in others}
    else:  # DiT's objective: its loss is in other units (ε-MSE + VLB), so no flow-matching loss
        loss = float("nan")
        spec_ = SampleSpec(method="ddim", num_steps=spec.sample_steps)
    out = {"heldout_loss": loss, **sample_metrics(loaded, spec_, spec.num_samples)}
    for suffix, sample_spec in extra.items():
        out.update({k + suffix: v for k, v in sample_metrics(loaded, sample_spec, spec.num_samples).items()})
    return out


def sample_metrics(loaded: Any, sample_spec: SampleSpec, num_samples: int) -> dict[str, float]:
    """digits-FID and accuracy (both networks on digits16) and pixel precision / recall of ``num_samples``
    samples of the protocol's noise and labels, drawn from the loaded model with ``sample_spec``."""
    images, labels_ = generate_digits(SamplingPipeline.for_model(loaded, sample_spec), num_samples)
    metrics = digits_metrics(images, labels_)
    out = {"digits_fid": metrics["digits_fid"], "accuracy": metrics["digits_accuracy"]}
    if images.shape[-1] == 16:  # digits16: also the 16×16 network, whose floor is not the 8×8 one's 142
        metrics16 = digits_metrics(images, labels_, load_digits_net(resolution=16))
        out.update(digits_fid16=metrics16["digits_fid"], accuracy16=metrics16["digits_accuracy"])
    return {**out, **pixel_precision_recall(images)}


def save_sample_grid(loaded: Any, sample_spec: SampleSpec, path: Path) -> Path:
    """The first ``GRID_IMAGES`` of the protocol's samples (same noise and labels as the scored ones; rows the
    classes 0–9) drawn with ``sample_spec``, as a PNG grid at ``path``."""
    from sit_vit5.images import save_grid

    images, _ = generate_digits(SamplingPipeline.for_model(loaded, sample_spec), GRID_IMAGES)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_grid((images + 1) / 2, path, nrow=10)
    return path


def pixel_precision_recall(images: Tensor, k: int = 3) -> dict[str, float]:
    """Improved precision / recall (k-NN balls, squared distances) of ``images`` [N, 1, H, W] in [-1, 1]
    against all 1,797 real digits at the same side H (DigitsDataset's resize), in pixel space: a
    sample-quality measure that no feature network enters (PROTOCOL.md, 2026-12-04)."""
    real = DigitsDataset(image_size=images.shape[-1]).images
    precision, recall = precision_recall(real.flatten(1), images.flatten(1).float(), k=k)
    return {"pixel_precision": precision, "pixel_recall": recall}


def generate_digits(pipeline: SamplingPipeline, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples 0..num_samples-1 of the protocol's noise seed with labels i mod num_classes, in batches of
    250: (images (N, C, H, W) clamped to [-1, 1], labels (N,))."""
    pixels, labels = [], []
    for start in range(0, num_samples, 250):
        indices = list(range(start, min(start + 250, num_samples)))
        batch = pipeline.generate(indices, global_seed=SAMPLE_SEED,
                                  labels=[i % pipeline.num_classes for i in indices])
        pixels.append(batch.pixels)
        labels.append(torch.as_tensor(batch.labels))
    return torch.cat(pixels).clamp(-1, 1), torch.cat(labels)


@contextmanager
def recomputed_sincos(model: nn.Module):
    """SiT's frozen sin-cos table rebuilt for the grid in use (integer positions, as DiT builds it for a new
    size) instead of the code's bicubic resampling of the training table; learned tables are unchanged."""
    table = getattr(model, "pos_embed", None)
    if table is None or getattr(model, "switches", {}).get("pos_embed") != "fixed":
        yield model
        return
    model.pos_embed_for = lambda grid: sincos_pos_embed_2d(table.shape[-1], *grid).unsqueeze(0).to(table)
    try:
        yield model
    finally:
        del model.pos_embed_for  # the instance attribute shadowed the method


def evaluate_at_size(path: Path, spec: RunSpec, cfg: dict[str, Any], size: int) -> dict[str, float]:
    """C5: the checkpoint at image side ``size`` (trained at another): held-out loss on the test split resized
    to ``size``, digits-FID / accuracy of samples area-resized to 8×8 and the real-vs-real floor of the same
    pipeline. Fixed sin-cos tables are recomputed for the new grid; ``heldout_loss_interpolated`` is the loss
    with the code's resampled table (for learned tables: the same number)."""
    loaded = load_model(path)
    model, transport = loaded.model, create_transport(**transport_kwargs(loaded.objective))
    data = test_split({**cfg, "data": {**cfg["data"], "image_size": size}})
    out = {"heldout_loss_interpolated": heldout_loss(model, transport, *data)}
    with recomputed_sincos(model):
        out["heldout_loss"] = heldout_loss(model, transport, *data)
        sample_spec = SampleSpec(method="ode", sampling_method="euler", num_steps=spec.sample_steps)
        pipeline = SamplingPipeline.for_model(loaded, sample_spec, vae="none", image_size=size)
        images, labels = generate_digits(pipeline, spec.num_samples)
    metrics = digits_metrics(images, labels)
    floor = fid_floor(size, spec.num_samples)
    return {**out, "digits_fid": metrics["digits_fid"], "accuracy": metrics["digits_accuracy"],
            "fid_floor": floor[0]}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))  # a reader sees the old or the new file


def same_identity(stored: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    """Whether a cached run was asked for with ``current``'s settings: the base config compared as
    parsed YAML (an edited comment changes no run), the overrides and eval sizes as they are."""
    if stored is None or set(stored) != set(current):
        return False
    parse = lambda text: yaml.safe_load(text)  # noqa: E731
    return all(parse(stored[k]) == parse(current[k]) if k == "base_config" else stored[k] == current[k]
               for k in current)


class RunStopped(SitVit5Error):
    """A signal stopped a run's training; its checkpoint and record are kept, so the next start resumes it."""


def run_one(spec: RunSpec, threads: int | None = None,
            train: Callable[..., Any] = training.train) -> dict[str, Any]:
    """Train (or resume) one run, evaluate its checkpoints and return its result (cached, see module
    doc). ``train(cfg, resume=...)`` trains it: ``sit_vit5.training.train`` (tests pass a stub)."""
    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(spec.base_config, spec.overrides())
    requested = json.loads(json.dumps(cfg))  # the request as JSON (tuples -> lists), for the record
    # A run is identified by what the sweep asked for (base config file + overrides), not by the resolved
    # config, whose new default keys (added by later code) do not change what an existing run means.
    identity: dict[str, Any] = {"base_config": Path(spec.base_config).read_text(), "overrides": spec.overrides()}
    if spec.variant in EVAL_SIZES:
        identity["eval_sizes"] = list(EVAL_SIZES[spec.variant])
    if spec.variant in FINAL_SAMPLES:
        identity["final_samples"] = FINAL_SAMPLES[spec.variant]
    result: dict[str, Any] = {}
    if spec.result_path.is_file():
        result = json.loads(spec.result_path.read_text())
        if not same_identity(result.get("identity"), identity):
            result = {}  # settings changed: start over
        elif result.get("complete"):
            return result
    ckpt_dir = spec.run_dir / "checkpoints"
    if not result:
        if spec.run_dir.exists():
            shutil.rmtree(spec.run_dir)  # a folder without this run's record: another request's, start over
        # issue 55: when and from which commit the run started, so its order against a protocol
        # addition can be checked (test_digits_prose.py)
        result = {"dataset": spec.dataset, "variant": spec.variant, "seed": spec.seed, "steps": spec.steps,
                  "identity": identity, "complete": False, "started_utc": utc_now(), "commit": git_commit()}
        _write_json(spec.result_path, result)  # the folder's record from the start: a stop keeps the folder
    if not (ckpt_dir / checkpoint_name(spec.steps, False)).is_file() and "diverged_at_step" not in result:
        resume = "latest" if latest_checkpoint(ckpt_dir) is not None else None
        start = time.perf_counter()
        stopped = None
        try:
            stopped = getattr(train(cfg, resume=resume), "preempted", None)
        except training.NonFiniteLossError as err:  # a diverged run is a result (protocol, C4), not a crash
            result["diverged_at_step"] = err.step
        result["train_seconds"] = result.get("train_seconds", 0.0) + time.perf_counter() - start
        if stopped:  # checkpointed by train(): record the time and leave the evaluations to the next start
            _write_json(spec.result_path, result)
            raise RunStopped(f"{spec.dataset} {spec.variant} seed {spec.seed}: stopped by {stopped} and "
                             f"checkpointed in {spec.run_dir}; rerun the same command to resume it")
    rows = _read_metrics(spec.run_dir)
    losses = [r.get("loss_diffusion", r["loss"]) for r in rows]  # REPA runs: the diffusion part
    resolved = load_config(spec.run_dir / "config.yaml")  # train() saved it with the data-derived keys
    model = model_from_config(resolved["model"])
    result.update({
        "dataset": spec.dataset, "variant": spec.variant, "seed": spec.seed, "steps": spec.steps,
        "num_samples": spec.num_samples, "sample_steps": spec.sample_steps, "identity": identity,
        "config": requested,
        "params": count_params(model), "mflops": flops(model) * 1e3,
        "loss_spikes": count_spikes(losses), "final_loss": statistics.fmean(losses[-100:]) if losses else math.nan,
        "loss_curve": _curve(rows, "loss_diffusion" if rows and "loss_diffusion" in rows[0]
                             else "loss"),
        "repa_loss_curve": _curve(rows, "loss_repa"),  # REPA's alignment loss ([] without REPA)
        "gate_attn_curve": _curve(rows, "gate/attn/mean"),
        "gate_mlp_curve": _curve(rows, "gate/mlp/mean"),
        # the class/time-dependent part of the gates, mean over blocks (diagnostics.GateMonitor)
        "gate_spread_attn_curve": _curve(_block_means(rows, "gate_spread/attn/"), "value"),
        "gate_spread_mlp_curve": _curve(_block_means(rows, "gate_spread/mlp/"), "value"),
    })
    grid = spec.run_dir / "samples" / f"{spec.steps:07d}.png"
    if grid.is_file():
        result["sample_grid"] = str(grid)
    evaluations = result.setdefault("checkpoints", {})
    test_data = test_split(cfg)
    start = time.perf_counter()
    for step in spec.checkpoint_steps:
        path = ckpt_dir / checkpoint_name(step, False)
        if str(step) not in evaluations and (path.is_file() or "diverged_at_step" not in result):
            evaluations[str(step)] = evaluate_checkpoint(path, spec, test_data)
            _write_json(spec.result_path, result)
    final = ckpt_dir / checkpoint_name(spec.steps, False)
    if final.is_file():
        result["layer_scale"] = layer_scale_summary(load_model(final).model)
        at_sizes = result.setdefault("resolution", {}) if spec.variant in EVAL_SIZES else {}
        for size in EVAL_SIZES.get(spec.variant, ()):
            if str(size) not in at_sizes:
                at_sizes[str(size)] = evaluate_at_size(final, spec, cfg, size)
                _write_json(spec.result_path, result)
        finals = result.setdefault("final_samples", {}) if spec.variant in FINAL_SAMPLES else {}
        for label, kwargs in FINAL_SAMPLES.get(spec.variant, {}).items():  # resumable, one entry at a time
            if label not in finals:
                finals[label] = sample_metrics(load_model(final), SampleSpec(**kwargs), spec.num_samples)
                _write_json(spec.result_path, result)
        if spec.seed == GRID_SEED and spec.variant in GRIDS:
            loaded = load_model(final)
            result["grids"] = {label: str(save_sample_grid(loaded, SampleSpec(**kwargs),
                                                           spec.run_dir / "grids" / f"{slug(label)}.png"))
                               for label, kwargs in GRIDS[spec.variant].items()}
    result["eval_seconds"] = result.get("eval_seconds", 0.0) + time.perf_counter() - start
    result["complete"] = True
    _write_json(spec.result_path, result)
    return result


def _worker(spec: RunSpec, threads: int) -> dict[str, Any]:
    """``run_one`` for a parallel sweep. In a sweep's own process (not a thread of the caller's) the
    run's console (a line per step) goes to ``spec.log_path`` and its bars are off, so the terminal
    shows the sweep's bar instead of interleaved runs."""
    if parent_process() is None:
        return run_one(spec, threads)
    os.environ["TQDM_DISABLE"] = "1"
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "a") as log, redirect_stdout(log), redirect_stderr(log):
        return run_one(spec, threads)


def cached_runs(results_dir: str | os.PathLike = RESULTS) -> list[dict[str, Any]]:
    """Every cached run JSON under ``results_dir/runs`` (complete or not, any variant)."""
    paths = sorted(Path(results_dir).glob("runs/*/*.json"))
    # a writer's temporary file (atomic_write) also ends in .json: not a run
    return [json.loads(p.read_text()) for p in paths if not p.name.startswith(TMP_PREFIX)]


def core_hours_spent(results_dir: str | os.PathLike = RESULTS,
                     variants: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> float:
    """Core-hours of the runs that record their evaluation time (those of the claims and REPA
    additions, one thread each), of ``variants`` only (None: all) and not of ``exclude``: training +
    evaluation seconds / 3600."""
    runs = [r for r in cached_runs(results_dir) if "eval_seconds" in r
            and r["variant"] not in exclude and (variants is None or r["variant"] in variants)]
    return sum(map(run_cost, runs))


def is_sample_run(run: dict[str, Any]) -> bool:
    """Whether a cached run belongs to the sample-quality addition (2026-12-04) and so to its budget."""
    return run["variant"] in SAMPLE_VARIANTS or (run["variant"] in RERUN.values() and run["seed"] >= FIRST_SAMPLE_SEED)


def claims_spent(results_dir: str | os.PathLike = RESULTS) -> float:
    """Core-hours the claims addition has spent of its budget (the REPA, sample-quality and MeanFlow additions
    have their own)."""
    return sum(run_cost(r) for r in cached_runs(results_dir)
               if "eval_seconds" in r and r["variant"] not in REPA_VARIANTS and not is_sample_run(r)
               and r["variant"] not in MEANFLOW_VARIANTS)


def _is_cached(spec: RunSpec) -> bool:
    return spec.result_path.is_file() and json.loads(spec.result_path.read_text()).get("complete", False)


MEANFLOW_SIZE = f"{BASE_SIZE} meanflow"  # a cost class of its own: a MeanFlow step costs ≈ 2 flow steps
MEANFLOW_COST_RATIO = 2.0  # bench.meanflow_step on the CPU (docs/PERFORMANCE.md: 1.93–2.08×): until one ran


def size_of(variant: str) -> str:
    """A variant's model size, depth×width: one of ``SIZES`` or ``BASE_SIZE`` (``MEANFLOW_SIZE`` for the
    meanflow arms, whose runs cost about twice a flow run of the same size)."""
    if variant in MEANFLOW_ARMS:
        return MEANFLOW_SIZE
    dims = VARIANTS[variant]
    return next((name for name, size in SIZES.items()
                 if all(dims.get(k) == v for k, v in size.items())), BASE_SIZE)


def run_cost(run: dict[str, Any]) -> float:
    """Core-hours of one recorded run (one thread): training + evaluation seconds / 3600."""
    return (run.get("train_seconds", 0.0) + run.get("eval_seconds", 0.0)) / 3600


def cost_model(runs: Sequence[dict[str, Any]]) -> Callable[..., float | None]:
    """``cost(dataset, size, steps=2000)``: core-hours of one run, the median of the complete ``runs`` of
    that dataset, size and step count (any variant, evaluation time recorded). Without such runs: the median
    of that dataset and size, each scaled to ``steps`` in proportion (a run's fixed costs make this high for
    longer runs: 0.98 estimated against 0.48 measured for the 10,000-step arm). A size not run yet on a
    dataset is scaled from another dataset where both it and 4×64 ran:
    cost(d, size) = cost(d, 4×64) × cost(d', size) / cost(d', 4×64) (None when nothing allows an
    estimate)."""
    known: dict[tuple[str, str], list[float]] = {}
    measured: dict[tuple[str, str, int], list[float]] = {}
    for run in runs:
        if run.get("complete") and "eval_seconds" in run and run["variant"] in VARIANTS:
            per_run = run_cost(run) * DEFAULT_STEPS / run["steps"]  # as if it had the common 2,000 steps
            known.setdefault((run["dataset"], size_of(run["variant"])), []).append(per_run)
            measured.setdefault((run["dataset"], size_of(run["variant"]), run["steps"]), []).append(
                run_cost(run))
    median = {k: statistics.median(v) for k, v in known.items()}

    def cost(d: str, size: str, steps: int = DEFAULT_STEPS) -> float | None:
        if (d, size, steps) in measured:
            return statistics.median(measured[(d, size, steps)])
        scale = steps / DEFAULT_STEPS  # training dominates: a run's cost grows with its steps
        if (d, size) in median:
            return median[(d, size)] * scale
        if size == MEANFLOW_SIZE and not any(sz == size for _, sz in median):  # before any meanflow run
            flow = cost(d, BASE_SIZE, steps)
            return None if flow is None else MEANFLOW_COST_RATIO * flow
        base = median.get((d, BASE_SIZE))
        ratios = [median[(o, size)] / median[(o, BASE_SIZE)] for o, sz in median
                  if sz == size and (o, BASE_SIZE) in median]
        return base * statistics.median(ratios) * scale if base is not None and ratios else None

    return cost


def sweep_status(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """Per (dataset, model size, steps) of ``specs``: runs planned, complete, left, the core-hours of one run
    (``cost_model``) and the estimate for the runs left. Reads the run cache once."""
    runs = [r for r in (cached_runs(specs[0].results_dir) if specs else []) if r.get("complete")]
    done = {(r["dataset"], r["variant"], r["seed"]) for r in runs}
    cost = cost_model(runs)
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for spec in specs:
        key = (spec.dataset, size_of(spec.variant), spec.steps)
        size = key[1] if spec.steps == DEFAULT_STEPS else f"{key[1]}, {spec.steps} steps"
        row = rows.setdefault(key, {"dataset": key[0], "size": size, "planned": 0, "complete": 0})
        row["planned"] += 1
        row["complete"] += (spec.dataset, spec.variant, spec.seed) in done
    for (d, size, steps), row in rows.items():
        row["left"] = row["planned"] - row["complete"]
        row["core_h_per_run"] = cost(d, size, steps)
        row["core_h_left"] = None if row["core_h_per_run"] is None else row["left"] * row["core_h_per_run"]
    return list(rows.values())


STOP_BY_MARGIN = 1.25  # a run's estimated time × this must fit before --stop-by (runs slow down under load)


def ends_by(stop_by: float, margin: float = STOP_BY_MARGIN,
            clock: Callable[[], float] = time.time) -> Callable[[RunSpec], bool]:
    """A sweep's ``fits``: may ``spec`` start now, its one-thread run ending before ``stop_by`` (seconds
    since the epoch)? Its duration is ``cost_model`` of the cached runs (re-read at each start) ×
    ``margin``; a run with no estimate does not start. For sessions or cluster jobs with a hard end, where a
    run cut off loses its work unless its run folder survives."""
    def fits(spec: RunSpec) -> bool:
        hours = cost_model(cached_runs(spec.results_dir))(spec.dataset, size_of(spec.variant), spec.steps)
        return hours is not None and clock() + margin * hours * 3600 <= stop_by

    return fits


def sweep(specs: Sequence[RunSpec], jobs: int = 1, budget_core_hours: float | None = None,
          spent: Callable[[str], float] | None = None, executor: Executor | None = None,
          fits: Callable[[RunSpec], bool] | None = None) -> list[dict[str, Any]]:
    """Run every spec in ``jobs`` processes of one thread each (tiny models: more threads only spin), started
    in the order given. With ``budget_core_hours``, no new run starts once ``spent(results_dir)`` (default: the
    claims addition's ``claims_spent``) reaches it; a run counts once it is complete,
    so with ``jobs`` > 1 the runs in flight can take the spending past the budget by up to ``jobs`` − 1
    runs. With ``fits`` (e.g. ``ends_by``), a run not cached that does not fit when its turn comes is skipped
    and the next ones are tried. The runs not started are left out of the returned list. ``executor``: the
    pool for ``jobs`` > 1 (default: ``jobs`` spawned processes; tests pass threads)."""
    spent = spent or claims_spent
    skipped: list[RunSpec] = []
    results: dict[int, dict[str, Any]] = {}
    bar = tqdm(total=len(specs), desc="digits runs", unit="run")

    def done(i: int, r: dict[str, Any]) -> None:
        results[i] = r
        final = r["checkpoints"].get(str(r["steps"]))
        score = (f"loss {final['heldout_loss']:.4f} FID {final['digits_fid']:.2f}" if final
                 else f"diverged at step {r.get('diverged_at_step')}")
        bar.set_postfix_str(f"{r['dataset']} {r['variant']} s{r['seed']}: {score}")
        bar.update()

    def over_budget(spec: RunSpec, left: int) -> bool:
        if budget_core_hours is None or _is_cached(spec) or spent(spec.results_dir) < budget_core_hours:
            return False
        print(f"budget of {budget_core_hours:g} core-hours spent: {left} runs not started")
        return True

    def may_start(spec: RunSpec) -> bool:
        if fits is None or _is_cached(spec) or fits(spec):
            return True
        skipped.append(spec)
        return False

    queue = list(enumerate(specs))
    if jobs <= 1:  # in this process (tests, debugging)
        for i, spec in queue:
            if over_budget(spec, len(specs) - i):
                break
            if may_start(spec):
                done(i, run_one(spec, 1))
    else:
        if specs:
            print(f"{jobs} runs at a time; each run's console: {specs[0].runs_dir}/<dataset>/<variant>/seed<N>.log")
        running: dict[Future, int] = {}
        with executor or ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            while queue or running:
                while queue and len(running) < jobs:  # start the next runs in order, budget allowing
                    if over_budget(queue[0][1], len(queue)):
                        queue.clear()
                        break
                    i, spec = queue.pop(0)
                    if may_start(spec):
                        running[pool.submit(_worker, spec, 1)] = i
                if running:
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        done(running.pop(future), future.result())
    bar.close()
    if skipped:
        print(f"{len(skipped)} runs not started: not estimated to end in time "
              f"({', '.join(f'{s.dataset} {s.variant} s{s.seed}' for s in skipped)})")
    return [results[i] for i in sorted(results)]


def plan(seeds: int = 3, ablation_seeds: int = 2, datasets: Sequence[str] = tuple(DATASETS),
         variants: Sequence[str] | None = None, **common: Any) -> list[RunSpec]:
    """The sweep in priority order: the main variants x ``seeds`` on each dataset, then the ablations x
    ``ablation_seeds`` on each dataset (``variants`` restricts to those names)."""
    chosen = set(variants or VARIANTS)
    specs = [RunSpec(d, v, s, **common) for d in datasets for s in range(seeds) for v in MAIN if v in chosen]
    specs += [RunSpec(d, v, s, **common) for d in datasets for s in range(seeds) for v in THIRD_ROW if v in chosen]
    specs += [RunSpec(d, v, s, **common)
              for d in datasets for s in range(ablation_seeds) for v in ABLATIONS if v in chosen]
    return specs


def load_results(results_dir: str | os.PathLike = RESULTS) -> list[dict[str, Any]]:
    """Every complete cached run under ``results_dir/runs`` of a variant this code knows (a cache shared with
    newer code may hold others: they are named and left out)."""
    complete = [r for r in cached_runs(results_dir) if r.get("complete")]
    unknown = sorted({r["variant"] for r in complete} - set(VARIANTS))
    if unknown:
        print(f"left out of the report (variants this code does not define): {', '.join(unknown)}")
    return [r for r in complete if r["variant"] in VARIANTS]


# ----------------------------------------------------------------------------- report


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for n < 2)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def fmt(values: Sequence[float], digits: int = 4) -> str:
    """``mean ± std`` (std only where n >= 2)."""
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}" if len(values) > 1 else f"{m:.{digits}f}"


def sample_grid_name(dataset: str, variant: str) -> str:
    """The report's copy of a variant's seed-0 sample grid."""
    return f"samples-{dataset}-{slug(variant)}.png"


def copy_sample_grid(results: Sequence[dict[str, Any]], dataset: str, variant: str, out: Path) -> None:
    """Copy seed 0's final sample grid into ``out`` when its run folder still has it (a committed copy
    stays when the run folder is gone)."""
    run = next((r for r in _by(results, dataset, variant) if r["seed"] == 0 and r.get("sample_grid")), None)
    if run and Path(run["sample_grid"]).is_file():
        shutil.copy(run["sample_grid"], out / sample_grid_name(dataset, variant))


def sample_grid_table(out: Path, cells: dict[str, dict[str, tuple[str, str]]]) -> str:
    """A markdown table of the sample grids in ``out``: ``cells[row][column]`` is the (dataset, variant) whose
    grid the cell shows ("–" when ``out`` lacks it). Empty when no grid is there."""
    rows, found = [], False
    for label, columns in cells.items():
        row = {"": label}
        for column, (dataset, variant) in columns.items():
            name = sample_grid_name(dataset, variant)
            present = (out / name).is_file()
            found |= present
            row[column] = f"![{label}, {column}]({name})" if present else "–"
        rows.append(row)
    return report.markdown_table(rows, ["", *next(iter(cells.values()))]) if found else ""


def _by(results: Sequence[dict[str, Any]], dataset: str, variant: str) -> list[dict[str, Any]]:
    return [r for r in results if r["dataset"] == dataset and r["variant"] == variant]


def _final(runs: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [r["checkpoints"][str(r["steps"])][key] for r in runs]


def compare(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """a vs b: difference of means, Welch's t-test p (n >= 2 each) and whether |Δ| exceeds the seed spread
    (the larger of the two standard deviations), the protocol's significance rule."""
    from scipy import stats

    delta = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return {"delta": delta, "p": float("nan"), "exceeds_spread": None}
    spread = max(statistics.stdev(a), statistics.stdev(b))
    p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return {"delta": delta, "p": p, "exceeds_spread": abs(delta) > spread}


def fid_floor(image_size: int, num_samples: int, repeats: int = 5, resolution: int = 8) -> tuple[float, float]:
    """Real-vs-real digits-FID: random ``num_samples``-subsets of the real digits (at ``image_size``, as the
    models see them) against all real digits, by the ``resolution``×``resolution`` feature network; mean
    and std over ``repeats`` subsets."""
    real = DigitsDataset(image_size=image_size)
    labels = torch.as_tensor(real.labels)
    net = load_digits_net(resolution=resolution)
    fids = []
    for r in range(repeats):
        idx = torch.randperm(len(real), generator=torch.Generator().manual_seed(r))[:num_samples]
        fids.append(digits_metrics(real.images[idx], labels[idx], net)["digits_fid"])
    return mean_std(fids)


def decide_default(results: Sequence[dict[str, Any]]) -> tuple[str | None, str]:
    """The protocol's rule for ViT-5's LayerScale default (see PROTOCOL.md): lowest held-out loss relative to
    SiT, averaged over the datasets; within the seed spread of the runner-up -> keep γ0=1. It reads the seeds
    the protocol planned for it (0–2): later additions' seeds do not move the decision."""
    results = [r for r in results if r["seed"] < DECISION_SEEDS]
    scores: dict[str, float] = {}
    for cand in LAYER_SCALE_CANDIDATES:
        ratios = []
        for d in DATASETS:
            sit, runs = _final(_by(results, d, "SiT"), "heldout_loss"), _final(_by(results, d, cand), "heldout_loss")
            if len(sit) < 3 or len(runs) < 3:
                return None, f"undecided: {cand} or SiT has fewer than 3 seeds on {d}"
            ratios.append(statistics.fmean(runs) / statistics.fmean(sit))
        scores[cand] = statistics.fmean(ratios)
    ranked = sorted(scores, key=scores.get)
    best, second = ranked[0], ranked[1]
    within = all(not compare(_final(_by(results, d, best), "heldout_loss"),
                             _final(_by(results, d, second), "heldout_loss"))["exceeds_spread"] for d in DATASETS)
    text = ", ".join(f"{c}: {scores[c]:.4f}" for c in ranked)
    if within and "ViT-5 (γ0=1)" in (best, second):
        return "ViT-5 (γ0=1)", f"held-out loss / SiT's (mean of datasets): {text}; best two within seed spread"
    return best, f"held-out loss / SiT's (mean of datasets): {text}"


def _plot_metric(results: Sequence[dict[str, Any]], variants: Sequence[str], key: str, ylabel: str,
                 path: Path, floors: dict[str, tuple[float, float]] | None = None) -> None:
    """Fig. 6 style: one panel per dataset, metric vs training step (log scale: early and late
    differences both visible), mean line ± std band over seeds."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(DATASETS), figsize=(5.5 * len(DATASETS), 4))
    for ax, d in zip(axes, DATASETS):
        for v in variants:
            runs = _by(results, d, v)
            if not runs or math.isnan(runs[0]["checkpoints"][str(runs[0]["steps"])][key]):
                continue  # e.g. no flow-matching loss for DiT's objective
            steps = sorted(int(s) for s in runs[0]["checkpoints"])
            values = [[r["checkpoints"][str(s)][key] for r in runs] for s in steps]
            means = [statistics.fmean(x) for x in values]
            line, = ax.plot(steps, means, marker="o", label=f"{v} (n={len(runs)})")
            if len(runs) > 1:
                sds = [statistics.stdev(x) for x in values]
                ax.fill_between(steps, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                                color=line.get_color(), alpha=0.2)
        if floors and d in floors:
            ax.axhline(floors[d][0], color="grey", linestyle="--", label="real-vs-real floor")
        ax.set_title(d)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    report.save_figure(fig, path)


def _plot_training(results: Sequence[dict[str, Any]], variants: Sequence[str], key: str, ylabel: str,
                   path: Path, logy: bool = False) -> None:
    """Seed-mean training curves (stored every 20 steps) per dataset."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(DATASETS), figsize=(5.5 * len(DATASETS), 4))
    for ax, d in zip(axes, DATASETS):
        for v in variants:
            curves = [r[key] for r in _by(results, d, v) if r.get(key)]
            if curves:
                n = min(len(c) for c in curves)
                ax.plot([c[0] for c in curves[0][:n]], [statistics.fmean(c[i][1] for c in curves) for i in range(n)],
                        label=f"{v} (n={len(curves)})")
        ax.set_title(d)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    report.save_figure(fig, path)


def _git(*args: str) -> str:
    run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    return run.stdout.strip()


def _git_commit() -> str:
    """HEAD's SHA, with ``+dirty`` when tracked code (the package or this study) has changes."""
    try:
        sha = _git("rev-parse", "HEAD")
        # the report's own outputs (results/) do not make the code that wrote them dirty, the
        # study's code (results/digits/study) does: a negative pathspec cannot re-include it
        status = ("status", "--porcelain", "--untracked-files=no", "--")
        dirty = _git(*status, ".", ":!results") or _git(*status, STUDY.relative_to(REPO).as_posix())
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ablation_base(variant: str) -> str:
    """The variant an ablation leaves one thing out of (or adds one thing to)."""
    return "ViT-5 (γ0=1e-4)" if "γ0=1e-4" in variant else "ViT-5 (γ0=1)"


def _delta(runs: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> str:
    """Final held-out loss of ``runs`` relative to ``reference``: "+1.23 % (p=.., beyond spread: yes)"."""
    c = compare(_final(runs, "heldout_loss"), _final(reference, "heldout_loss"))
    rel = 100 * c["delta"] / statistics.fmean(_final(reference, "heldout_loss"))
    verdict = {True: "yes", False: "no", None: "n<2"}[c["exceeds_spread"]]
    return f"{rel:+.2f} % (p={c['p']:.2g}, beyond spread: {verdict})"


def summary_rows(results: Sequence[dict[str, Any]], dataset: str, variants: Sequence[str],
                 ablations: bool = False) -> list[dict[str, Any]]:
    """One table row per variant with results on ``dataset``: n, metrics at every checkpoint, Δ vs SiT
    (and, for ``ablations``, Δ vs the ViT-5 variant each one modifies)."""
    rows = []
    sit = _by(results, dataset, "SiT")
    for v in variants:
        runs = _by(results, dataset, v)
        if not runs:
            continue
        steps = sorted(int(s) for s in runs[0]["checkpoints"])
        row: dict[str, Any] = {"variant": v, "n": len(runs), "params": runs[0]["params"],
                               "MFLOPs": f"{runs[0]['mflops']:.3f}"}
        for s in steps:
            row[f"FID@{s}"] = fmt([r["checkpoints"][str(s)]["digits_fid"] for r in runs], 2)
        fid16 = [r["checkpoints"][str(r["steps"])]["digits_fid16"] for r in runs
                 if "digits_fid16" in r["checkpoints"][str(r["steps"])]]
        if fid16:  # digits16 runs scored since the 16×16 network exists
            row[f"FID16@{steps[-1]} (16×16 net)"] = f"{fmt(fid16, 2)} (n={len(fid16)})"
        flow_matching = not math.isnan(_final(runs, "heldout_loss")[0])
        row["held-out loss"] = fmt(_final(runs, "heldout_loss")) if flow_matching else "n/a (ε objective)"
        row["acc."] = fmt(_final(runs, "accuracy"), 3)
        row["train loss"] = fmt([r["final_loss"] for r in runs])
        row["mean abs(gate·γ) attn/mlp"] = (f"{statistics.fmean(r['gate_attn_curve'][-1][1] for r in runs):.3f} / "
                                    f"{statistics.fmean(r['gate_mlp_curve'][-1][1] for r in runs):.3f}")
        if sit and v != "SiT" and flow_matching:
            row["Δ loss vs SiT"] = _delta(runs, sit)
        base = _by(results, dataset, ablation_base(v))
        if ablations and base:
            row["Δ loss vs its base"] = f"{_delta(runs, base)} vs {ablation_base(v).removeprefix('ViT-5 ').strip('()')}"
        row["spikes per run"] = "/".join(str(r["loss_spikes"]) for r in runs)
        rows.append(row)
    return rows


GATE_VARIANTS = ("SiT", "ViT-5 (γ0=1)", "ViT-5 (γ0=1e-4)", "ViT-5 (γ0=1e-4) + SwiGLU-official")


def gate_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The γ-stall hypothesis checked on the cached runs that record γ and the gate spread (2026-12-01 on): per
    dataset and variant of ``GATE_VARIANTS``, n and the means over runs at the end of training of |γ|
    (LayerScale), of the spread of gate·γ across the batch and of |gate·γ|, as "attention / MLP"."""
    def pair(values: Sequence[dict[str, float]]) -> str:
        return " / ".join(f"{statistics.fmean(v[b] for v in values):.3f}" for b in ("attn", "mlp"))

    rows = []
    for d in DATASETS:
        for v in GATE_VARIANTS:
            runs = [r for r in _by(results, d, v) if r.get("gate_spread_attn_curve")]
            if not runs:
                continue
            final = {key: [{b: r[f"{key}_{b}_curve"][-1][1] for b in ("attn", "mlp")} for r in runs]
                     for key in ("gate_spread", "gate")}
            gammas = [r["layer_scale"] for r in runs if r.get("layer_scale")]
            rows.append({"dataset": d, "variant": v, "n": len(runs),
                         "mean abs(γ)": pair(gammas) if gammas else "– (no LayerScale)",
                         "spread of gate·γ across the batch": pair(final["gate_spread"]),
                         "mean abs(gate·γ)": pair(final["gate"])})
    return rows


def write_report(results: Sequence[dict[str, Any]], out_dir: str | os.PathLike, command: str,
                 preface: str = "") -> Path:
    """results/digits/README.md (``preface``, then tables per dataset, decision, plots) + results.csv, from
    cached runs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = sorted(results, key=lambda r: (list(DATASETS).index(r["dataset"]), list(VARIANTS).index(r["variant"]),
                                             r["seed"]))
    num_samples = results[0]["num_samples"]
    floors = {d: fid_floor(int(DATASETS[d][0].split("=")[1]), num_samples) for d in DATASETS}
    floor16 = fid_floor(16, num_samples, resolution=16)
    _plot_metric(results, PLOTTED, "digits_fid", f"digits-FID ({num_samples} samples, lower is better)",
                 out / "fid_curves.png", floors)
    _plot_metric(results, MAIN, "heldout_loss", "held-out flow-matching loss (EMA)", out / "loss_curves.png")
    _plot_training(results, PLOTTED, "loss_curve", "training loss (20-step mean)", out / "train_loss.png", logy=True)
    _plot_training(results, PLOTTED, "gate_attn_curve", "mean |gate·γ| (attention branches)", out / "gates.png")
    flat = [{"dataset": r["dataset"], "variant": r["variant"], "seed": r["seed"], "step": int(s), **m}
            for r in results for s, m in r["checkpoints"].items()]
    report.write_csv(flat, ["dataset", "variant", "seed", "step", "heldout_loss", "digits_fid", "accuracy"],
                     out / "results.csv")
    for d in DATASETS:
        for v in MAIN:  # the grids this report shows (samples_report copies its own)
            copy_sample_grid(results, d, v, out)
    default, reason = decide_default(results)
    lines = [
        "# Digits proxy: ViT-5 vs SiT\n",
        *([preface + "\n"] if preface else []),
        "Protocol (written and committed before any run of it was read; later additions dated, each saying "
        "whether it was written before its runs: four were not, the clip-x0 addition of 2026-11-30 and the "
        "clarifications of 2026-12-02, 2026-12-03 and 2026-12-04): [PROTOCOL.md](PROTOCOL.md); the paper's "
        "other claims with corrected verdicts: [CLAIMS.md](CLAIMS.md)  ",
        f"Command: `{command}`  ",
        f"Commit: `{_git_commit()}`  ",
        f"Runs: {len(results)} complete; base config `configs/digits/repro.yaml`.\n",
        f"**LayerScale default, confirmed by the protocol's rule afterwards:** {default or 'not decided yet'} "
        f"({reason}). γ0 = 1 was made the code default with digits8 numbers only, before any digits16 run was "
        "committed.\n",
        "Real-vs-real digits-FID floor at the same sample count: "
        + "; ".join(f"{d}: {m:.2f} ± {s:.2f} (5 subsets)" for d, (m, s) in floors.items())
        + f"; digits16 by the 16×16 feature network (column FID16): {floor16[0]:.2f} ± {floor16[1]:.2f}.\n",
    ]
    for d in DATASETS:
        for title, variants in (("main comparison", PLOTTED), ("ablations (on ViT-5 γ0=1 unless named)", ABLATIONS)):
            rows = summary_rows(results, d, variants, ablations=variants is ABLATIONS)
            if rows:
                columns = list(dict.fromkeys(k for row in rows for k in row))
                lines += [f"## {d}: {title}\n", report.markdown_table(rows, columns)]
    lines += ["FID at each checkpoint and the held-out loss (final checkpoint) are mean ± std over n seeds; "
              "'beyond spread' = |Δ| larger than the larger seed std (the original protocol's rule); p = Welch's "
              "t-test, uncorrected (CLAIMS.md corrects them). abs(gate·γ) = mean of |gate·γ| over blocks, batch "
              "and channels at the end of training. Spikes per run in seed order (training loss > 2× the median "
              "of the previous 100 steps).\n",
              "![digits-FID vs step](fid_curves.png)\n", "![held-out loss vs step](loss_curves.png)\n",
              "![mean abs(gate·γ)](gates.png)\n", "![training loss](train_loss.png)\n"]
    grids = sample_grid_table(out, {v: {d: (d, v) for d in DATASETS} for v in MAIN})
    if grids:
        lines += ["## Samples\n", "Seed 0 of each arm at its final checkpoint (2,000 steps): 40 samples of the "
                  "protocol's fixed noise, rows the classes 0–9 four times (ODE Euler, 50 steps, no guidance), "
                  "so the same cell is the same noise and class in every grid.\n", grids]
    gates = gate_rows(results)
    if gates:
        lines += ["## LayerScale and the gates at the end of training\n",
                  "From the runs that cache γ and the gate spread (those of 2026-12-01 on; the original sweep's "
                  "runs keep neither): means over n runs, attention / MLP. The hypothesis below is about these "
                  "numbers.\n", report.markdown_table(gates, list(gates[0]))]
    analysis = out / "analysis.md"
    if analysis.is_file():
        lines += [analysis.read_text()]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path
