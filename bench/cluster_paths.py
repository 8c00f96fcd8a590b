"""The paths a cluster user runs, end to end at full size on this machine, one subprocess per stage.

    python -m bench.cluster_paths                                   # sit-xl-2 vit5-xl-2 dit-xl-2, fp32
    python -m bench.cluster_paths --configs vit5-xl-2 --precision bf16 --threads 2
    python -m bench.cluster_paths --depth 1 --json out.json         # the reduced-size check (tests)
    python -m bench.cluster_paths --configs sit-xl-2-repa vit5-xl-2-repa --depth 1 --image-size 32

For each ``configs/imagenet/<name>.yaml``, unchanged except batch size, steps, paths and CPU settings:

1. (once) a small ImageFolder: JPEGs of several sizes, one grayscale, one CMYK, one PNG with alpha, one
   smaller than the crop; an ``AutoencoderKL`` with stabilityai/sd-vae-ft-ema's architecture (random
   weights, ``save_pretrained``, passed as a local ``vae.name``); its latent cache, built with
   ``python -m sit_vit5.cache_latents`` at 256 px;
2. ``train.py``: 2 steps at global batch 2 from the cache, in the config's precision (or ``--precision``),
   a checkpoint at step 2; then ``--resume latest`` for 1 more step;
3. ``sample.py grid``: 2 images (classes 207, 360) decoded by the VAE to 256 x 256;
4. ``python -m sit_vit5.export`` of the run, then ``SiTPipeline`` on the export: the same 2 images,
   which must equal sample.py's pixel for pixel.

The REPA configs (``REPA_CONFIGS``, not in the default list) train from the same cache with the
ImageFolder beside it (``data.image_root``: the encoder sees each latent's image, as in REPA's own
training) with an encoder of DINOv2-B/14's
architecture (timm's ``vit_base_patch14_dinov2``, seeded random weights, saved as a local timm
folder) in place of the torch.hub download; at a reduced ``--image-size`` the encoder's input side
follows the model's grid (``repa.resolution`` unset). ``bench.plan``'s prediction counts the encoder
and the projector (``bench.plan.repa_extras``).

The table gives per config and stage the wall time (train: seconds per optimizer step of the second step,
from ``metrics.jsonl``, so start-up and checkpointing are left out), the peak resident memory of the
stage's process, and for the training stages ``bench.plan``'s prediction of the step's memory next to the
measured peak minus the resident memory of a process that only imported the libraries. Memory is measured as
``bench.plan --measure-cpu`` measures it: glibc hands every block over 64 KiB back to the system when it is
freed (``MALLOC_MMAP_THRESHOLD_``), so the peak counts live tensors, not the heap's high-water mark
(``--glibc-default`` measures the default allocator instead, which keeps freed activations resident while
the gradients are allocated). CPU numbers: the time is for ratios and planning only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("sit-xl-2", "vit5-xl-2", "dit-xl-2")
REPA_CONFIGS = ("sit-xl-2-repa", "vit5-xl-2-repa")  # run when named in --configs
CLASSES = (207, 360)
#: (file name, mode, width, height): the image modes and sizes an ImageNet folder holds
IMAGES = (("n01440764/rgb_400x300.jpg", "RGB", 400, 300), ("n01440764/gray.jpg", "L", 320, 300),
          ("n01440764/cmyk.jpg", "CMYK", 300, 360), ("n01443537/alpha.png", "RGBA", 300, 300),
          ("n01443537/rgb_333x500.jpg", "RGB", 333, 500), ("n01443537/small.jpg", "RGB", 200, 180))
COLUMNS = ("config", "stage", "seconds", "s_per_step", "peak_rss_gib", "above_baseline_gib", "plan_gib",
           "plan_error")
GIB = 2**30


@dataclass
class Stage:
    """One subprocess: what ran, how long, its peak resident memory (bytes)."""

    config: str
    stage: str
    argv: list[str]
    seconds: float
    peak_rss: int
    s_per_step: float | None = None
    plan_bytes: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run_stage(config: str, stage: str, argv: list[str], env: dict[str, str], log: Path) -> Stage:
    """Run ``argv`` (stdout/stderr appended to ``log``); raise naming the stage and the log on failure."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{config}: stage {stage} exited {proc.returncode}; log {log}:\n{tail}")
    return Stage(config, stage, argv, seconds, usage.ru_maxrss * 1024)  # ru_maxrss: KiB on Linux


def make_image_folder(root: Path) -> Path:
    """The ImageFolder of ``IMAGES`` (smooth random content), returned as its root."""
    rng = np.random.default_rng(0)
    for name, mode, w, h in IMAGES:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
        image = image.convert(mode) if mode != "RGBA" else image.convert("RGBA")
        if mode == "RGBA":  # a real alpha channel: a transparent corner
            alpha = np.full((h, w), 255, np.uint8)
            alpha[: h // 3, : w // 3] = 0
            image.putalpha(Image.fromarray(alpha))
        image.save(path, quality=90) if path.suffix == ".jpg" else image.save(path)
    return root


def make_vae(path: Path, arch: str = "sd-arch") -> Path:
    """An AutoencoderKL with seeded random weights saved as a diffusers folder (what an offline user passes
    as ``vae.name``): ``sd-arch`` = stabilityai/sd-vae-ft-ema's architecture, ``tiny`` = its factor 8 only."""
    import torch
    from diffusers import AutoencoderKL

    from bench.common import BUILT_VAES
    from sit_vit5.names import SD_VAE_SCALING_FACTOR

    torch.manual_seed(0)
    AutoencoderKL(**BUILT_VAES[arch], scaling_factor=SD_VAE_SCALING_FACTOR).save_pretrained(path)
    return path


def make_repa_encoder(path: Path) -> Path:
    """DINOv2-B/14's architecture (timm ``vit_base_patch14_dinov2``, seeded random weights) as a
    local timm folder: what an offline user passes as ``repa.encoder`` for the torch.hub id."""
    import timm
    import torch
    from timm.models import save_for_hf

    torch.manual_seed(0)
    net = timm.create_model("vit_base_patch14_dinov2", pretrained=False, img_size=224,
                            num_classes=0)
    save_for_hf(net, str(path), safe_serialization=True)
    return path


def step_seconds(run_dir: Path, step: int) -> float | None:
    """Seconds of optimizer step ``step`` from the run's metrics.jsonl (logged every step)."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == step and row.get("steps_per_s"):
            return 1.0 / row["steps_per_s"]
    return None


def plan_bytes(config_path: Path, precision: str, depth: int | None, image_size: int = 256) -> float:
    """bench.plan's peak memory of one training step of the config's model at batch 2 on one CPU process
    (a REPA config: with ``make_repa_encoder``'s encoder and its projector; the latents are cached)."""
    import torch

    from bench.plan import GIB as PLAN_GIB
    from bench.plan import plan, repa_extras

    cfg = yaml.safe_load(config_path.read_text())
    model = cfg["model"]
    overrides = {k: v for k, v in model.items() if k not in ("name", "in_channels") and v is not None}
    if depth is not None:
        overrides["depth"] = depth
    if image_size != 256:
        overrides["input_size"] = image_size // 8
    extras = None
    if cfg.get("repa", {}).get("encoder"):
        import timm

        grid = overrides.get("input_size", 32) // overrides.get("patch_size", 2)
        with torch.device("meta"):
            encoder = timm.create_model("vit_base_patch14_dinov2", pretrained=False, num_classes=0)
            encoder.set_input_size(img_size=(14 * grid, 14 * grid))
        extras = repa_extras(encoder, 14 * grid, cfg["repa"]["projector_dim"])
    return plan(model["name"], 2, precision, "ddp", 1, device="cpu", extras=extras,
                **overrides).peak_gib * PLAN_GIB


def baseline_rss(env: dict[str, str], log: Path) -> int:
    """Peak resident memory of a process that imports what train.py imports and nothing else."""
    code = "import torch, diffusers, accelerate, sit_vit5.training, sit_vit5.pipeline"
    return run_stage("-", "baseline", [sys.executable, "-c", code], env, log).peak_rss


PIPELINE_CHECK = """
import sys, numpy as np
from PIL import Image
from sit_vit5.pipeline import SiTPipeline  # the module exported folders name (diffusers imports it)
export, grid, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
labels = [int(c) for c in sys.argv[4:]]
pipe = SiTPipeline.from_pretrained(export)
pipe.set_progress_bar_config(disable=True)
images = pipe(labels, num_inference_steps=steps, generator=0, output_type="uint8").images
expected = np.stack([np.asarray(Image.open(f"{grid}/{i:06d}.png")) for i in range(len(labels))])
assert images.shape == expected.shape, (images.shape, expected.shape)
assert np.array_equal(images, expected), f"pipeline != sample.py: {np.abs(images.astype(int) - expected).max()}"
print("pipeline == sample.py grid", images.shape)
"""


def run_config(name: str, work: Path, cache: Path, vae: Path, env: dict[str, str], args: argparse.Namespace,
               log: Path, images: Path | None = None) -> list[Stage]:
    """Train, resume, sample, export and pipeline-sample ``configs/imagenet/<name>.yaml`` (a REPA
    config: the cache's images read from ``images`` beside it, the encoder of ``make_repa_encoder``)."""
    config = REPO / "configs" / "imagenet" / f"{name}.yaml"
    precision = args.precision or yaml.safe_load(config.read_text())["train"]["precision"]
    run_dir, py = work / name / "run", sys.executable
    overrides = ["data.kind=latents", f"data.root={cache}", "data.global_batch_size=2", "data.num_workers=0",
                 f"vae.name={vae}", f"train.out_dir={run_dir}", "train.sample_every=0", "train.log_every=1",
                 "train.ckpt_every=2", "train.milestone_every=0", "train.keep_last=1", "train.cpu=true",
                 f"train.cpu_threads={args.threads}", f"train.precision={precision}"]
    if args.depth is not None:
        overrides.append(f"model.depth={args.depth}")
    if args.image_size != 256:  # the reduced check: a smaller image through the same VAE architecture
        overrides += [f"data.image_size={args.image_size}", f"model.input_size={args.image_size // 8}"]
    if name in REPA_CONFIGS:  # the encoder sees each latent's image, read beside the cache
        encoder = work / "repa-encoder"
        if not encoder.is_dir():
            make_repa_encoder(encoder)
        overrides += [f"data.image_root={images}", f"repa.encoder={encoder}"]
        if args.depth is not None:
            overrides.append(f"repa.depth={min(args.depth, 8)}")
        if args.image_size != 256:
            overrides.append("repa.resolution=null")  # DINOv2's patch x the smaller grid
    train = [py, "train.py", "--config", str(config), *overrides]
    stages = [run_stage(name, "train 2 steps", [*train, "train.steps=2"], env, log),
              run_stage(name, "resume +1 step", [*train, "train.steps=3", "--resume", "latest"], env, log)]
    for stage, step in zip(stages, (2, 3)):
        stage.s_per_step = step_seconds(run_dir, step)
        stage.plan_bytes = plan_bytes(config, precision, args.depth, args.image_size)
    if args.train_only:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return stages
    ckpt = run_dir / "checkpoints" / "0000003.pt"
    grid = work / name / "grid"
    steps = str(args.sample_steps)
    stages.append(run_stage(name, "sample.py grid", [
        py, "sample.py", "grid", "--ckpt", str(ckpt), "--classes", *map(str, CLASSES), "--seed", "0",
        "--num-steps", steps, "--device", "cpu", "--precision", args.sample_precision, "--out", str(grid),
        "--no-progress"], env, log))
    sizes = {Image.open(grid / f"{i:06d}.png").size for i in range(len(CLASSES))}
    stages[-1].extra["image_sizes"] = sorted(sizes)
    export = work / name / "export"
    stages.append(run_stage(name, "export", [py, "-m", "sit_vit5.export", str(run_dir), str(export)], env, log))
    stages.append(run_stage(name, "pipeline", [py, "-c", PIPELINE_CHECK, str(export), str(grid), steps,
                                               *map(str, CLASSES)], env, log))
    if not args.keep:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 10.8 GB per XL checkpoint
        shutil.rmtree(export, ignore_errors=True)
    return stages


def rows_of(stages: list[Stage], baseline: int) -> list[dict[str, Any]]:
    rows = []
    for s in stages:
        above = s.peak_rss - baseline
        rows.append({"config": s.config, "stage": s.stage, "seconds": round(s.seconds, 1),
                     "s_per_step": None if s.s_per_step is None else round(s.s_per_step, 2),
                     "peak_rss_gib": round(s.peak_rss / GIB, 2), "above_baseline_gib": round(above / GIB, 2),
                     "plan_gib": None if s.plan_bytes is None else round(s.plan_bytes / GIB, 2),
                     "plan_error": None if s.plan_bytes is None else f"{above / s.plan_bytes - 1:+.1%}"})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_paths", description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help="configs/imagenet/<name>.yaml stems")
    p.add_argument("--precision", default=None, help="train.precision (default: the config's)")
    p.add_argument("--sample-precision", default="fp32", help="sample.py --precision")
    p.add_argument("--sample-steps", type=int, default=3, help="sampler steps of the grid and the pipeline")
    p.add_argument("--depth", type=int, default=None, help="model.depth override (reduced-size check)")
    p.add_argument("--image-size", type=int, default=256, help="pixels (a multiple of 8; reduced checks)")
    p.add_argument("--vae", choices=("sd-arch", "tiny"), default="sd-arch",
                   help="sd-arch: SD-VAE ft-EMA's architecture; tiny: the same factor 8, ~1000x cheaper")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per stage (OMP_NUM_THREADS)")
    p.add_argument("--work", default=None, help="working directory (default: a temporary one, removed)")
    p.add_argument("--keep", action="store_true", help="keep checkpoints and exports")
    p.add_argument("--train-only", action="store_true", help="only the train and resume stages")
    p.add_argument("--glibc-default", action="store_true",
                   help="measure with glibc's default allocator (no MALLOC_MMAP_THRESHOLD_)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="cluster-paths-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if not args.glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # as bench.plan --measure-cpu
    try:
        baseline = baseline_rss(env, log)
        images = make_image_folder(work / "images")
        vae = make_vae(work / f"vae-{args.vae}", args.vae)
        cache = work / "latents"
        stages = [run_stage("(all)", "cache_latents", [
            sys.executable, "-m", "sit_vit5.cache_latents", "--data-dir", str(images), "--out", str(cache),
            "--vae", str(vae), "--image-size", str(args.image_size), "--batch-size", "2", "--num-workers", "0",
            "--cpu"], env, log)]
        for name in args.configs:
            stages += run_config(name, work, cache, vae, env, args, log, images)
            rows = rows_of(stages, baseline)
            if args.json:
                Path(args.json).write_text(json.dumps({"rows": rows, "stages": [asdict(s) for s in stages],
                                                       "baseline_rss": baseline, "args": vars(args)}, indent=1))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    from bench.common import print_table

    print_table(rows, COLUMNS, title=f"cluster paths (CPU, {args.threads} thread(s); baseline RSS "
                                     f"{baseline / GIB:.2f} GiB)")
    return rows


if __name__ == "__main__":
    main()
