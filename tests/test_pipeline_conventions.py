"""SiTPipeline as a diffusers user expects it (issue 23): DiT-objective exports sample as sample.py
does, the execution device, per-step progress, output types, generator lists, label names,
validated arguments, step-wise schedulers (ours, and diffusers' flow matching swapped in) and
diffusers' generic DiffusionPipeline.from_pretrained."""

from __future__ import annotations

import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler

import sit_vit5.hub
import sit_vit5.pipeline
from sit_vit5 import SiTPipeline
from sit_vit5.config import load_config
from sit_vit5.export import main as export_main
from sit_vit5.models import create_model
from sit_vit5.pipeline import SiTScheduler, diffusers_scheduler
from sit_vit5.training import save_checkpoint
from sit_vit5.transport.rng import sample_seed
from sit_vit5.utils.errors import SettingError
from tests.helpers import assert_names, naming
from tests.test_pipeline import TINY, checkpoint, exported, grid_images

LABELS = [3, 1, 4, 1, 5]
ROOT = Path(__file__).resolve().parents[1]


def tiny_checkpoint(root, config: str, arch: dict, *overrides: str, edit=None) -> str:
    """A tiny pixel-space checkpoint of ``config`` (random weights); ``edit(cfg)`` changes the
    config the checkpoint records."""
    keys = [f"model.{k}={v}" for k, v in {"name": "ViT5-S/2", "in_channels": 1, **arch}.items()]
    cfg = load_config(config, [*keys, "vae.name=none", "sample.num_steps=10", *overrides])
    if edit is not None:
        edit(cfg)
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", in_channels=1, **arch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    state = {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": cfg,
             "step": 3}
    return str(save_checkpoint(state, root / "checkpoints", step=3))


def ddpm_checkpoint(root, edit=None) -> str:
    """The DiT-objective demo's (configs/demo-dit.yaml: cosine schedule, learned variance)."""
    return tiny_checkpoint(root, "configs/demo-dit.yaml", {**TINY, "learn_sigma": True}, edit=edit)


@pytest.fixture(scope="module")
def sit(tmp_path_factory):
    """(checkpoint, pipeline) of a tiny SiT-objective pixel model sampled with ODE Euler."""
    root = tmp_path_factory.mktemp("sit")
    ckpt = checkpoint(root / "run", 1, "none", "sample.method=ode", "sample.sampling_method=euler",
                      "sample.num_steps=8")
    return ckpt, exported(ckpt, root / "export")


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    """(checkpoint, pipeline) of a tiny DiT-objective (ddpm) pixel model."""
    root = tmp_path_factory.mktemp("dit")
    ckpt = ddpm_checkpoint(root / "run")
    return ckpt, exported(ckpt, root / "export")


def with_sampler(pipe: SiTPipeline, **sampler) -> SiTScheduler:
    """The pipeline's SiTScheduler with some sampler settings replaced."""
    return SiTScheduler.from_config(pipe.scheduler.config,
                                    sampler={**pipe.scheduler.config.sampler, **sampler})


def seeded_noise(shape, seed: int, count: int) -> tuple[torch.Tensor, list[torch.Generator]]:
    """sample.py's noise of samples 0..count-1 of ``seed`` and the generators that drew it."""
    gens = [torch.Generator().manual_seed(sample_seed(seed, i)) for i in range(count)]
    return torch.stack([torch.randn(shape, generator=g) for g in gens]), gens


# ----------------------------------------------------------------------------- item 3


def test_dit_objective_export_records_its_sampler_and_samples_like_sample_py(dit, tmp_path):
    ckpt, pipe = dit
    scheduler = pipe.scheduler.config
    assert scheduler.transport["objective"] == "ddpm" and scheduler.sampler["method"] == "ddpm"
    expected = grid_images(ckpt, tmp_path / "grid", LABELS, seed=7)
    images = pipe(LABELS, generator=7, output_type="uint8").images
    assert np.array_equal(images[..., 0], np.stack(expected))
    ddim = grid_images(ckpt, tmp_path / "ddim", LABELS, 7, "--method", "ddim", "--num-steps", "20")
    ours, pipe.scheduler = pipe.scheduler, with_sampler(pipe, method="ddim", num_steps=20)
    try:
        images = pipe(LABELS, generator=7, output_type="uint8").images
    finally:
        pipe.scheduler = ours
    assert np.array_equal(images[..., 0], np.stack(ddim))
    assert not np.array_equal(np.stack(ddim), np.stack(expected))


def test_export_refuses_a_sampler_that_cannot_sample_its_objective(tmp_path, capsys):
    # a sit sampler recorded for a ddpm model (load_config refuses it: written around it)
    ckpt = ddpm_checkpoint(tmp_path / "run", edit=lambda cfg: cfg["sample"].update(method="ode"))
    assert export_main([ckpt, str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'ode'" in err and "ddpm" in err
    assert not (tmp_path / "export").exists()


# ----------------------------------------------------------------------------- item 4


def test_noise_and_model_follow_the_execution_device(sit, monkeypatch):
    _, pipe = sit
    expected = pipe([2, 7], generator=3, output_type="uint8").images
    # model CPU offload: .device says where the weights rest, _execution_device where they run
    monkeypatch.setattr(SiTPipeline, "device", property(lambda self: torch.device("meta")))
    monkeypatch.setattr(SiTPipeline, "_execution_device",
                        property(lambda self: torch.device("cpu")))
    assert np.array_equal(pipe([2, 7], generator=3, output_type="uint8").images, expected)


def test_progress_bar_ticks_once_per_step_of_every_batch(sit, monkeypatch):
    _, pipe = sit
    bars = []
    real = pipe.progress_bar

    def record(iterable=None, total=None):
        bars.append(real(iterable=iterable, total=total))
        return bars[-1]

    monkeypatch.setattr(pipe, "progress_bar", record)
    pipe.set_progress_bar_config(file=io.StringIO())  # enabled (a disabled bar does not count)
    try:
        pipe(LABELS, generator=0, batch_size=2)  # 3 batches x 7 Euler steps (8 grid points)
    finally:
        pipe.set_progress_bar_config(disable=True)
    assert len(bars) == 1 and (bars[0].total, bars[0].n) == (21, 21)


def test_output_types_are_diffusers_floats_and_uint8_is_sample_pys(sit, tmp_path):
    ckpt, pipe = sit
    expected = np.stack(grid_images(ckpt, tmp_path / "grid", LABELS, seed=5))
    out = {kind: pipe(LABELS, generator=5, output_type=kind).images
           for kind in ("np", "pt", "uint8", "pil")}
    assert out["np"].dtype == np.float32 and out["np"].shape == (5, 8, 8, 1)
    assert 0.0 <= out["np"].min() and out["np"].max() <= 1.0
    assert out["pt"].dtype == torch.float32 and out["pt"].shape == (5, 1, 8, 8)
    assert 0.0 <= float(out["pt"].min()) and float(out["pt"].max()) <= 1.0
    assert np.array_equal(out["pt"].permute(0, 2, 3, 1).numpy(), out["np"])
    assert out["uint8"].dtype == np.uint8 and np.array_equal(out["uint8"][..., 0], expected)
    assert all(np.array_equal(np.asarray(im), ex) for im, ex in zip(out["pil"], expected,
                                                                      strict=True))
    assert np.abs(out["np"][..., 0] * 255 - expected).max() <= 1.0  # the same images


def test_a_list_of_generators_gives_image_i_from_generator_i(sit):
    _, pipe = sit
    seeded = pipe(LABELS, generator=7, output_type="uint8").images
    gens = [torch.Generator().manual_seed(sample_seed(7, i)) for i in range(len(LABELS))]
    assert np.array_equal(pipe(LABELS, generator=gens, output_type="uint8").images, seeded)
    alone = pipe(LABELS[3:4], generator=[torch.Generator().manual_seed(sample_seed(7, 3))],
                 output_type="uint8").images
    assert np.array_equal(alone[0], seeded[3])  # the image depends on its own generator only


def test_imagenet_sized_exports_carry_label_names(tmp_path):
    # a 1000-class tiny model: ImageNet's class count (its label table is its only large part)
    ckpt = tiny_checkpoint(tmp_path / "run", "configs/demo.yaml", {**TINY, "num_classes": 1000})
    pipe = exported(ckpt, tmp_path / "export")
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert len(index["id2label"]) == 1000 and index["id2label"]["207"] == "golden retriever"
    assert pipe.get_label_ids(["golden retriever", "otter"]) == [207, 360]
    assert pipe.get_label_ids("tench") == [0] and pipe.labels["otter"] == 360
    named = pipe(["golden retriever", "otter"], generator=1, output_type="uint8").images
    assert np.array_equal(named, pipe([207, 360], generator=1, output_type="uint8").images)
    with pytest.raises(ValueError, match=naming("class_labels", "'cat'", "'Egyptian cat'")) as err:
        pipe(["cat"])
    assert "\n" not in str(err.value)


def test_label_names_given_to_the_exporter_are_stored(sit, tmp_path):
    ckpt, _ = sit
    names = tmp_path / "digits.txt"
    names.write_text("".join(f"digit {i}, {i}\n" for i in range(10)))
    assert export_main([ckpt, str(tmp_path / "export"), "--id2label", str(names)]) == 0
    pipe = SiTPipeline.from_pretrained(tmp_path / "export")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.id2label[3] == "digit 3, 3" and pipe.get_label_ids(["digit 3", "7"]) == [3, 7]
    assert np.array_equal(pipe(["digit 3", 1], generator=2, output_type="uint8").images,
                          pipe([3, 1], generator=2, output_type="uint8").images)


@pytest.mark.parametrize("kwargs, error, names", [
    ({"class_labels": []}, ValueError, ("class_labels", "empty")),
    ({"class_labels": ["cat"]}, ValueError, ("class_labels", "'cat'", "id2label")),
    ({"class_labels": [1.7]}, TypeError, ("class_labels", "1.7", "float")),
    ({"class_labels": torch.tensor([1.0])}, TypeError, ("class_labels", "torch.float32")),
    ({"class_labels": [True]}, TypeError, ("class_labels", "True", "bool")),
    ({"class_labels": [10]}, ValueError, ("class_labels", "10", "0..9")),
    ({"class_labels": None}, TypeError, ("class_labels", "None", "NoneType")),
    ({"class_labels": [1], "generator": True}, TypeError, ("generator", "True", "bool")),
    ({"class_labels": [1], "generator": -1}, TypeError, ("generator", "-1", "int")),
    ({"class_labels": [1], "generator": [1]}, TypeError, ("generator", "torch.Generator", "1")),
    ({"class_labels": [1], "output_type": "latent"}, ValueError, ("output_type='latent'",)),
])
def test_bad_arguments_are_one_line_errors_naming_the_value(sit, kwargs, error, names):
    _, pipe = sit
    with pytest.raises(error) as info:
        pipe(**kwargs)
    assert "\n" not in str(info.value)
    assert_names(str(info.value), *names)


# ----------------------------------------------------------------------------- item 5


def test_flow_match_euler_swapped_in_gives_our_euler_images(sit):
    _, pipe = sit
    ours = pipe.scheduler
    for cfg in (1.0, 2.5):
        expected = pipe(LABELS, generator=7, guidance_scale=cfg, output_type="pt").images
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(ours.config)
        swapped = pipe(LABELS, generator=7, guidance_scale=cfg, output_type="pt").images
        pipe.scheduler = FlowMatchEulerDiscreteScheduler()  # a fresh one: the pipeline's settings
        fresh = pipe(LABELS, generator=7, guidance_scale=cfg, output_type="pt").images
        pipe.scheduler = ours
        assert (swapped - expected).abs().max() < 1e-5 and (fresh - expected).abs().max() < 1e-5
        assert (expected - 0.5).abs().max() > 0.1  # not a blank image


def test_a_saved_pipeline_keeps_a_swapped_scheduler_and_the_settings(sit, tmp_path):
    _, pipe = sit
    ours = pipe.scheduler
    expected = pipe(LABELS, generator=4, output_type="pt").images
    pipe.scheduler = FlowMatchEulerDiscreteScheduler()
    try:
        pipe.save_pretrained(tmp_path / "flow")
    finally:
        pipe.scheduler = ours
    again = SiTPipeline.from_pretrained(tmp_path / "flow")
    again.set_progress_bar_config(disable=True)
    assert isinstance(again.scheduler, FlowMatchEulerDiscreteScheduler)
    assert again.scheduler.config.transport["path_type"] == "Linear"
    assert (again(LABELS, generator=4, output_type="pt").images - expected).abs().max() < 1e-5


def test_our_scheduler_steps_reproduce_the_whole_trajectory_samplers(sit, dit):
    for pipe, method in ((sit[1], "ode"), (dit[1], "ddpm"), (dit[1], "ddim")):
        scheduler = with_sampler(pipe, method=method)
        pipe.scheduler, ours = scheduler, pipe.scheduler
        try:
            sampler = pipe.sampling_pipeline()
            z, gens = seeded_noise(sampler.latent_shape, 7, len(LABELS))
            y = torch.tensor(LABELS)
            expected = sampler.sample_fn(z, sampler.model_fn, generator=gens, y=y)[-1]
            _, gens = seeded_noise(sampler.latent_shape, 7, len(LABELS))
            scheduler.set_timesteps()
            x = z
            for t in scheduler.timesteps:  # the user's loop; DDPM's noise: one generator per image
                out = pipe.transformer(x, t.expand(len(x)), y)
                x = scheduler.step(out, t, x, generator=gens).prev_sample
        finally:
            pipe.scheduler = ours
        assert len(scheduler.timesteps) == (7 if method == "ode" else 10)
        assert torch.equal(x, expected), method


def test_diffusers_ddpm_and_ddim_schedulers_are_our_steps_up_to_rounding(dit):
    _, pipe = dit
    y = torch.tensor(LABELS)
    diffusion = pipe.scheduler.objective().diffusion
    for method, tolerance in (("ddpm", 1e-3), ("ddim", 2e-5)):
        sampler = SiTScheduler.from_config(pipe.scheduler.config,
                                           sampler={"method": method, "num_steps": 10})
        inner = diffusers_scheduler(diffusion, method, 10, pixel_space=True)
        sampler.set_timesteps()
        assert inner.timesteps.tolist() == sampler.timesteps.tolist()
        z, gens = seeded_noise((1, 8, 8), 7, len(LABELS))
        _, inner_gens = seeded_noise((1, 8, 8), 7, len(LABELS))
        ours, theirs = z, z
        for t in sampler.timesteps:
            ours = sampler.step(pipe.transformer(ours, t.expand(5), y), t, ours,
                                generator=gens).prev_sample
            out = pipe.transformer(theirs, t.expand(5), y)
            if method == "ddim":
                theirs = inner.step(out[:, :1], t, theirs, eta=0.0, use_clipped_model_output=True)
            else:
                theirs = inner.step(out, t, theirs, generator=inner_gens)
            theirs = theirs.prev_sample
        assert (ours - theirs).abs().max() < tolerance, method
    with pytest.raises(ValueError, match="stride 34.*stride 33"):
        diffusers_scheduler(diffusion, "ddim", 30, pixel_space=True)


def test_schedulers_that_cannot_sample_the_objective_are_refused(sit, dit):
    sit_pipe, dit_pipe = sit[1], dit[1]
    for pipe, scheduler, needle in (
        (dit_pipe, FlowMatchEulerDiscreteScheduler(), "FlowMatchEulerDiscreteScheduler"),
        (sit_pipe, DDIMScheduler(), "DDIMScheduler"),
    ):
        ours, pipe.scheduler = pipe.scheduler, scheduler
        try:
            with pytest.raises(SettingError) as err:
                pipe([1])
            assert (err.value.key, err.value.value) == ("scheduler", needle)
        finally:
            pipe.scheduler = ours
    with pytest.raises(SettingError) as err:
        with_sampler(sit_pipe, method="sde", sampling_method="Euler").set_timesteps()
    assert err.value.key == "method" and "sde" in str(err.value)


def test_a_diffusers_ddpm_scheduler_runs_a_dit_objective_model(dit):
    _, pipe = dit
    ours = pipe.scheduler
    pipe.scheduler = DDPMScheduler(beta_schedule="squaredcos_cap_v2", variance_type="learned_range")
    try:
        images = pipe(LABELS, generator=[torch.Generator().manual_seed(i) for i in range(5)],
                      num_inference_steps=10, output_type="np").images
    finally:
        pipe.scheduler = ours
    assert images.shape == (5, 8, 8, 1) and np.isfinite(images).all() and images.std() > 0.05


# ----------------------------------------------------------------------------- item 6


def test_diffusers_generic_loader_runs_an_export_where_sit_vit5_is_installed(sit, tmp_path):
    ckpt, pipe = sit
    assert export_main([ckpt, str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "pipeline.py").is_file()
    np.save(tmp_path / "expected.npy", pipe([2, 7], generator=4, output_type="uint8").images)
    script = f"""
import sys, numpy as np
from diffusers import DiffusionPipeline
folder = {str(tmp_path / "export")!r}
try:
    DiffusionPipeline.from_pretrained(folder)
except ValueError as err:
    assert "trust_remote_code=True" in str(err), err
assert "sit_vit5" not in sys.modules  # nothing imported our package before diffusers did
pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
assert type(pipe).__name__ == "SiTPipeline", type(pipe)
pipe.set_progress_bar_config(disable=True)
images = pipe([2, 7], generator=4, output_type="uint8").images
assert np.array_equal(images, np.load({str(tmp_path / "expected.npy")!r}))
print("ok")
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # this checkout's sit_vit5
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


#: the loader file exports wrote before sit_vit5.pipeline became sit_vit5.hub (frozen: such folders
#: are out there, whatever LOADER_SOURCE says now)
PRE_HUB_LOADER = '''try:
    from sit_vit5.pipeline import SiTPipeline  # noqa: F401
except ImportError as err:
    raise ImportError("this pipeline folder needs the sit-vit5 package installed") from err
'''
#: every public name sit_vit5.pipeline had before the split
PRE_HUB_NAMES = ["IMAGENET_CLASSES", "LOADER_FILE", "LOADER_SOURCE", "OUTPUT_TYPES", "SETTINGS",
                 "SiTPipeline", "SiTScheduler", "diffusers_scheduler",
                 "imagenet_id2label", "read_id2label", "scheduler_from"]


def test_folders_exported_before_the_hub_split_still_load(sit, tmp_path):
    """Their pipeline.py imports sit_vit5.pipeline and their model_index.json names the scheduler
    ["sit_vit5.pipeline", "SiTScheduler"]; new exports still write both."""
    for name in PRE_HUB_NAMES:
        assert getattr(sit_vit5.pipeline, name) is getattr(sit_vit5.hub, name), name
    ckpt, pipe = sit
    folder = tmp_path / "export"
    assert export_main([ckpt, str(folder)]) == 0
    index = json.loads((folder / "model_index.json").read_text())
    assert index["scheduler"] == ["sit_vit5.pipeline", "SiTScheduler"]
    assert "from sit_vit5.pipeline import SiTPipeline" in (folder / "pipeline.py").read_text()
    (folder / "pipeline.py").write_text(PRE_HUB_LOADER)
    assert runpy.run_path(str(folder / "pipeline.py"))["SiTPipeline"] is SiTPipeline
    again = SiTPipeline.from_pretrained(folder)
    again.set_progress_bar_config(disable=True)
    assert type(again.scheduler) is SiTScheduler
    expected = pipe([2, 7], generator=4, output_type="uint8").images
    assert np.array_equal(again([2, 7], generator=4, output_type="uint8").images, expected)
