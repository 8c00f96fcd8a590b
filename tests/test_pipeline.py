"""SiTPipeline and the exporter: a diffusers pipeline that reproduces ``sample.py grid`` pixel for
pixel."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from sit_vit5 import SiTPipeline
from sit_vit5.config import load_config
from sit_vit5.export import main as export_main
from sit_vit5.images import to_uint8
from sit_vit5.models import create_model
from sit_vit5.training import save_checkpoint
from tests.helpers import naming
from tests.hub_cache import add_folder_to_hub_cache

TINY = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, num_classes=10, learn_sigma=False)


def checkpoint(root, in_channels: int, vae: str = "none", *sample_overrides: str) -> str:
    """A training checkpoint as the loop writes it (random weights; the config's sample section
    included)."""
    overrides = [f"model.{k}={v}" for k, v in {"name": "ViT5-S/2", "in_channels": in_channels, **TINY}.items()]
    cfg = load_config("configs/demo.yaml", [*overrides, f"vae.name={vae}", "sample.num_steps=4",
                                            *sample_overrides])
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", in_channels=in_channels, **TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    state = {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": cfg, "step": 3}
    return str(save_checkpoint(state, root / "checkpoints", step=3))


def grid_images(ckpt: str, out, labels: list[int], seed: int, *flags: str) -> list[np.ndarray]:
    argv = ["grid", "--ckpt", ckpt, "--classes", *map(str, labels), "--seed", str(seed), "--out", str(out),
            "--no-progress", *flags]
    assert sample.main(argv) == 0
    return [np.asarray(Image.open(out / f"{i:06d}.png")) for i in range(len(labels))]


def exported(ckpt: str, out) -> SiTPipeline:
    assert export_main([ckpt, str(out)]) == 0
    pipe = SiTPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("sampler", [("sample.method=ode", "sample.sampling_method=euler"),
                                     ("sample.method=sde", "sample.sampling_method=Euler")])
def test_pixel_space_pipeline_equals_sample_py_grid(tmp_path, sampler):
    ckpt = checkpoint(tmp_path / "run", 1, "none", *sampler)
    labels = [3, 1, 4, 1, 5]
    pipe = exported(ckpt, tmp_path / "export")
    assert pipe.vae is None
    expected = grid_images(ckpt, tmp_path / "grid", labels, seed=7)
    images = pipe(labels, generator=7).images  # the checkpoint's sampler defaults, as sample.py uses them
    assert all(np.array_equal(np.asarray(im), ex) for im, ex in zip(images, expected, strict=True))
    tuned = grid_images(ckpt, tmp_path / "tuned", labels, 7, "--num-steps", "6", "--cfg-scale", "2.5")
    images = pipe(labels, num_inference_steps=6, guidance_scale=2.5, generator=7,
                  output_type="uint8").images  # sample.py's pixels ("np" is diffusers' float)
    assert images.dtype == np.uint8 and np.array_equal(images[..., 0], np.stack(tuned))
    assert not np.array_equal(np.stack(tuned), np.stack(expected))  # the overrides did change something


def test_latent_pipeline_with_tiny_autoencoder_equals_sample_py_grid(tmp_path, vae_dir):
    ckpt = checkpoint(tmp_path / "run", 4, str(vae_dir), "sample.method=ode", "sample.sampling_method=heun2")
    labels = [0, 9, 2]
    pipe = exported(ckpt, tmp_path / "export")
    assert pipe.vae is not None and pipe.vae.config.scaling_factor == pytest.approx(0.18215)
    scheduler = json.loads((tmp_path / "export" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["vae"]["name"] == str(vae_dir) and scheduler["sampler"]["sampling_method"] == "heun2"
    expected = grid_images(ckpt, tmp_path / "grid", labels, 11, "--cfg-scale", "1.5")
    pil = pipe(labels, guidance_scale=1.5, generator=11).images
    assert [im.size for im in pil] == [(16, 16)] * 3 and pil[0].mode == "RGB"
    assert all(np.array_equal(np.asarray(im), ex) for im, ex in zip(pil, expected, strict=True))
    seen = []  # sampled frozen, as sample.py's model (torch's matmul path depends on it), then left trainable
    hook = pipe.transformer.register_forward_hook(
        lambda m, i, o: seen.append(any(p.requires_grad for p in m.parameters())))
    pixels = pipe(labels, guidance_scale=1.5, generator=11, output_type="uint8").images
    hook.remove()
    assert pixels.shape == (3, 16, 16, 3) and np.array_equal(pixels, np.stack(expected))
    assert seen and not any(seen) and all(p.requires_grad for p in pipe.transformer.parameters())
    floats = pipe(labels, guidance_scale=1.5, generator=11, output_type="pt").images  # diffusers'
    assert floats.shape == (3, 3, 16, 16) and 0 <= floats.min() and floats.max() <= 1
    # the same samples: [0, 1] floats back on sample.py's [-1, 1] -> uint8 map, up to rounding
    assert np.abs(to_uint8(floats * 2 - 1).astype(int) - np.stack(expected)).max() <= 1


def test_pipeline_save_and_load_like_any_diffusers_pipeline(tmp_path, vae_dir):
    ckpt = checkpoint(tmp_path / "run", 4, str(vae_dir))
    pipe = exported(ckpt, tmp_path / "export")
    before = pipe([5, 6], generator=torch.Generator().manual_seed(0), output_type="np").images
    pipe.save_pretrained(tmp_path / "copy")
    index = json.loads((tmp_path / "copy" / "model_index.json").read_text())
    # [loader file, class]: diffusers' generic DiffusionPipeline.from_pretrained finds the class
    assert index["_class_name"] == ["pipeline", "SiTPipeline"]
    assert {"transformer", "vae", "scheduler"} <= set(index)
    again = SiTPipeline.from_pretrained(tmp_path / "copy")
    again.set_progress_bar_config(disable=True)
    after = again([5, 6], generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np.array_equal(before, after)
    third = again([5, 6], generator=torch.Generator().manual_seed(1), output_type="np").images
    assert not np.array_equal(before, third)  # the generator does choose the noise


def test_export_refuses_a_non_empty_folder_and_dit_files(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "run", 1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("x")
    assert export_main([ckpt, str(tmp_path / "taken")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert export_main([str(tmp_path / "run"), str(tmp_path / "from_run_dir")]) == 0  # a run dir: newest ckpt
    assert (tmp_path / "from_run_dir" / "transformer" / "config.json").is_file()
    assert not list(tmp_path.glob(".from_run_dir.tmp-*"))  # staging folder renamed away


def test_generator_argument_rules(tmp_path):
    pipe = exported(checkpoint(tmp_path / "run", 1), tmp_path / "export")
    with pytest.raises(ValueError, match=naming("generator", "3", "2")):  # a list: one generator per image
        pipe([1, 2], generator=[torch.Generator(), torch.Generator(), torch.Generator()])
    with pytest.raises(ValueError, match="output_type"):
        pipe([1], generator=0, output_type="latent")


def test_pipeline_loads_by_repo_id_from_the_hub_cache(tmp_path, monkeypatch):
    pipe = exported(checkpoint(tmp_path / "run", 1), tmp_path / "export")
    add_folder_to_hub_cache(tmp_path / "hub", "someone/tiny-sit-pipeline", tmp_path / "export")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = SiTPipeline.from_pretrained("someone/tiny-sit-pipeline", cache_dir=tmp_path / "hub",
                                      local_files_only=True)
    hub.set_progress_bar_config(disable=True)
    local = pipe([2, 7], generator=4, output_type="np").images
    assert np.array_equal(hub([2, 7], generator=4, output_type="np").images, local)


def test_the_readme_import_loads_an_export_in_a_fresh_process(tmp_path):
    """``from sit_vit5 import SiTPipeline`` then ``from_pretrained``, nothing else imported first: the
    folder names its module (sit_vit5.pipeline) and diffusers refuses modules not yet imported."""
    import os
    import subprocess
    import sys

    from sit_vit5.export import export
    from tests.test_sampling_cli import our_checkpoint

    folder = export(our_checkpoint(tmp_path, in_channels=1), tmp_path / "exported")
    code = ("from sit_vit5 import SiTPipeline; "
            f"p = SiTPipeline.from_pretrained({str(folder)!r}); "
            "print(p([1, 2], num_inference_steps=3, generator=0, output_type='uint8').images.shape)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0 and "(2, 8, 8, 1)" in run.stdout, run.stderr[-2000:]
