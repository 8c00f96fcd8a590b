"""Every precision the code offers (fp32, bf16, fp16), end to end on the CPU: a training step (weights,
optimizer and EMA stay fp32 in checkpoints; fp16's loss scaler is saved and resumes exactly), the sampling
pipeline (sample.py's grid), the diffusers pipeline (``torch_dtype=`` at load and ``.to(dtype)`` after),
export in half precision and the VAE of the latent cache.

Tolerances, against fp32 on the same weights and noise: bf16 keeps 8 mantissa bits (relative rounding
2^-9 ≈ 2e-3 per op), fp16 11 bits (2^-12 ≈ 2.4e-4); through a few blocks and sampler steps the errors add
up to the bounds below (a few times the per-op rounding), while a wrong cast (fp32 weights ignored, a
dtype mismatch) is off by O(1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from sit_vit5 import SiTPipeline
from sit_vit5 import cache_latents as cache_latents_module
from sit_vit5.config import ConfigError, load_config
from sit_vit5.models import load_model
from sit_vit5.sampling import SampleSpec, SamplingPipeline
from sit_vit5.training import read_checkpoint, train
from sit_vit5.utils.precision import PRECISION_OF_DTYPE, PRECISIONS
from tests.test_pipeline import checkpoint as pipeline_checkpoint
from tests.test_pipeline import exported
from tests.test_train import TINY

HALF = ("bf16", "fp16")
#: |loss(half) / loss(fp32) - 1| after one step of the tiny model
LOSS_RTOL = {"bf16": 3e-2, "fp16": 5e-3}
#: max |pixel(half) - pixel(fp32)| on [-1, 1] after a 4-step sampler
PIXEL_ATOL = {"bf16": 0.15, "fp16": 0.02}


def test_precisions_offered():
    assert set(PRECISIONS) == {"fp32", "bf16", "fp16"}


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory):
    """One training step of the tiny digits model in each precision, same seed: {precision: TrainResult}."""
    root = tmp_path_factory.mktemp("precision")
    runs = {}
    for precision in PRECISIONS:
        cfg = load_config(None, [*TINY, f"train.out_dir={root / precision}", "train.steps=2",
                                 "train.ckpt_every=1", "train.log_every=1", f"train.precision={precision}",
                                 "data.global_batch_size=16"])
        runs[precision] = train(cfg)
    return runs


@pytest.mark.parametrize("precision", HALF)
def test_training_step_agrees_with_fp32(one_step_runs, precision):
    ref, run = one_step_runs["fp32"], one_step_runs[precision]
    assert len(run.losses) == 2 and all(np.isfinite(run.losses))
    # step 1: the zero-init network outputs exactly 0 in any precision, so its loss is fp32's bit for bit
    assert run.losses[0] == ref.losses[0]
    rel = abs(run.losses[1] / ref.losses[1] - 1)  # step 2: after one update through the half-precision graph
    assert 0 < rel < LOSS_RTOL[precision], rel  # > 0: the step really ran in another precision


@pytest.mark.parametrize("precision", [*HALF, "fp32"])
def test_checkpoints_hold_fp32_weights_optimizer_and_ema(one_step_runs, precision):
    state = read_checkpoint(one_step_runs[precision].checkpoint)
    for part in ("model", "ema"):
        assert {v.dtype for v in state[part].values() if v.is_floating_point()} == {torch.float32}, part
    moments = [t for s in state["opt"]["state"].values() for t in s.values() if t.dim() > 0]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert ("scaler" in state) == (precision == "fp16")
    if precision == "fp16":
        assert state["scaler"]["scale"] > 0 and state["scaler"]["_growth_tracker"] >= 0


def test_fp16_resume_is_exact_and_restores_the_loss_scale(one_step_runs, tmp_path):
    """2 steps, then resume from the step-1 checkpoint: step 2 repeats bit for bit, scaler included."""
    full = one_step_runs["fp16"]
    ckpt1 = full.run_dir / "checkpoints" / "0000001.pt"
    cfg = load_config(None, [*TINY, f"train.out_dir={tmp_path / 'resumed'}", "train.steps=2",
                             "train.ckpt_every=1", "train.log_every=1", "train.precision=fp16",
                             "data.global_batch_size=16"])
    resumed = train(cfg, resume=str(ckpt1))
    assert resumed.losses == full.losses[1:]
    a, b = read_checkpoint(full.checkpoint), read_checkpoint(resumed.checkpoint)
    assert a["scaler"] == b["scaler"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_fp16_refused_under_fsdp_with_the_reason():
    with pytest.raises(ConfigError, match=r"train.precision=fp16 with train.distributed=fsdp.*bf16"):
        load_config(None, [*TINY, "train.precision=fp16", "train.distributed=fsdp"])


def _sampling(ckpt: str, precision: str) -> torch.Tensor:
    loaded = load_model(ckpt)
    spec = SampleSpec(method="ode", sampling_method="euler", num_steps=5)
    pipe = SamplingPipeline.for_model(loaded, spec, precision=precision)
    return pipe.generate(range(4), 1, [1, 2, 3, 4]).pixels


@pytest.mark.parametrize("precision", HALF)
def test_sampling_pipeline_agrees_with_fp32(tmp_path, precision):
    ckpt = pipeline_checkpoint(tmp_path / "run", 1, "none")
    ref, half = _sampling(ckpt, "fp32"), _sampling(ckpt, precision)
    assert half.dtype == torch.float32
    err = (half - ref).abs().max().item()
    assert 0 < err < PIXEL_ATOL[precision], err


@pytest.mark.parametrize("precision", HALF)
def test_sample_py_grid_in_half_precision(tmp_path, precision):
    ckpt = pipeline_checkpoint(tmp_path / "run", 1, "none")
    images = {}
    for p in ("fp32", precision):
        out = tmp_path / p
        assert sample.main(["grid", "--ckpt", ckpt, "--classes", "3", "1", "--seed", "2", "--num-steps", "4",
                            "--method", "ode", "--sampling-method", "euler", "--precision", p, "--out",
                            str(out), "--no-progress"]) == 0
        images[p] = np.stack([np.asarray(Image.open(out / f"{i:06d}.png"), dtype=np.int64) for i in range(2)])
    diff = np.abs(images[precision] - images["fp32"]).max()
    assert diff <= 255 * PIXEL_ATOL[precision] / 2 + 1, diff


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["torch_dtype", "to"])
def test_diffusers_pipeline_in_half_precision(tmp_path, vae_dir, dtype, how):
    """A latent model with its VAE: float32 / uint8 images, equal to the fp32 pipeline within rounding."""
    ckpt = pipeline_checkpoint(tmp_path / "run", 4, str(vae_dir))
    ref_pipe = exported(ckpt, tmp_path / "export")
    pipe = (SiTPipeline.from_pretrained(tmp_path / "export", torch_dtype=dtype) if how == "torch_dtype"
            else SiTPipeline.from_pretrained(tmp_path / "export").to(dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.dtype == dtype and pipe.vae.dtype == dtype
    kwargs = dict(class_labels=[1, 7], num_inference_steps=4, generator=3)
    ref = ref_pipe(**kwargs, output_type="pt").images
    half = pipe(**kwargs, output_type="pt").images
    assert half.dtype == torch.float32 and half.shape == ref.shape
    precision = PRECISION_OF_DTYPE[dtype]
    err = (half - ref).abs().max().item()
    assert 0 < err < PIXEL_ATOL[precision], err
    images = pipe(**kwargs, output_type="uint8").images
    assert images.dtype == np.uint8 and images.shape[0] == 2


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_export_in_half_precision_samples(tmp_path, dtype):
    from sit_vit5.export import main as export_main

    ckpt = pipeline_checkpoint(tmp_path / "run", 1, "none")
    ref = exported(ckpt, tmp_path / "fp32").__call__([2, 5], num_inference_steps=4, generator=0,
                                                    output_type="pt").images
    assert export_main([ckpt, str(tmp_path / dtype), "--dtype", dtype]) == 0
    config = json.loads((tmp_path / dtype / "transformer" / "config.json").read_text())
    assert config["_class_name"] in ("SiT", "ViT5")
    for torch_dtype in (None, PRECISIONS[dtype]):  # diffusers loads in float32 unless told otherwise
        pipe = SiTPipeline.from_pretrained(tmp_path / dtype, torch_dtype=torch_dtype)
        pipe.set_progress_bar_config(disable=True)
        assert pipe.transformer.dtype == (torch_dtype or torch.float32)
        half = pipe([2, 5], num_inference_steps=4, generator=0, output_type="pt").images
        assert 0 < (half - ref).abs().max().item() < PIXEL_ATOL[dtype]
    size = sum(f.stat().st_size for f in (tmp_path / dtype / "transformer").glob("*.safetensors"))
    full = sum(f.stat().st_size for f in (tmp_path / "fp32" / "transformer").glob("*.safetensors"))
    assert size < 0.6 * full  # half the bytes (plus the header)


@pytest.mark.parametrize("vae_dtype", ["bfloat16", "float16"])
def test_cache_latents_vae_dtype(tmp_path, vae_dir, vae_dtype):
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "img" / cls / f"{i}.png")
    means = {}
    for d in ("float32", vae_dtype):
        out = tmp_path / d
        cache_latents_module.main(["--data-dir", str(tmp_path / "img"), "--out", str(out), "--vae", str(vae_dir),
                                   "--image-size", "16", "--num-workers", "0", "--dtype", "float32",
                                   "--vae-dtype", d])
        manifest = json.loads((out / "manifest.json").read_text())
        means[d] = np.concatenate([np.load(out / s["mean"]) for s in manifest["shards"]])
    assert means[vae_dtype].dtype == np.float32
    scale = np.abs(means["float32"]).max()
    err = np.abs(means[vae_dtype] - means["float32"]).max() / scale
    assert 0 < err < (3e-2 if vae_dtype == "bfloat16" else 5e-3), err
