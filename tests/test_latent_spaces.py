"""Other latent spaces: a FLUX-like 16-channel ×8 VAE with a shift, a VA-VAE-like 32-channel ×16 VAE
normalised by the cache's per-channel statistics; cache → train → sample → export → pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import AutoencoderKL
from PIL import Image

import sit_vit5.cache_latents as cache_latents
from sit_vit5 import SiTPipeline
from sit_vit5.export import main as export_main
from sit_vit5.image_data import ImageFolderDataset
from sit_vit5.latent_cache import LatentCacheDataset
from sit_vit5.latent_norm import LatentNorm
from sit_vit5.training.checkpoint import latest_checkpoint
from sit_vit5.utils.errors import ConfigError
from tests.helpers import (
    assert_names,
    load_sample_cli,
    make_image_folder,
    one_error_line,
    one_sample_error,
    run_train,
)

SIDE = 32  # image side in pixels
FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159  # FLUX.1's VAE config values


def _vae(path, channels: int, blocks: int, **config) -> str:
    """A random tiny AutoencoderKL with ``channels`` latent channels, downsampling 2**(blocks-1)."""
    torch.manual_seed(channels)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * blocks,
                  up_block_types=("UpDecoderBlock2D",) * blocks, block_out_channels=(8,) * blocks,
                  latent_channels=channels, norm_num_groups=8, sample_size=SIDE,
                  **config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def spaces(tmp_path_factory):
    """Images (two classes) and the two autoencoders: {"images", "flux", "vavae", "sd"}."""
    root = tmp_path_factory.mktemp("spaces")
    return {"images": make_image_folder(root / "images", {"a": 3, "b": 3}),
            "flux": _vae(root / "flux", 16, 4, scaling_factor=FLUX_SCALE, shift_factor=FLUX_SHIFT),
            "vavae": _vae(root / "vavae", 32, 5, scaling_factor=1.0),
            "sd": _vae(root / "sd", 4, 2)}


FLUX_FLAGS = ("--scaling-factor", str(FLUX_SCALE), "--shift-factor", str(FLUX_SHIFT))


@pytest.fixture(scope="module")
def caches(spaces, tmp_path_factory):
    """Latent caches of the images: {"flux": with FLUX's normalisation, "vavae": unscaled}."""
    root = tmp_path_factory.mktemp("caches")
    _cache(spaces, spaces["flux"], root / "flux", *FLUX_FLAGS)
    _cache(spaces, spaces["vavae"], root / "vavae", "--scaling-factor", "1")
    return {"flux": root / "flux", "vavae": root / "vavae"}


def _cache(spaces, vae: str, out, *flags: str) -> None:
    assert cache_latents.main(["--data-dir", str(spaces["images"]), "--out", str(out), "--vae", vae,
                               "--image-size", str(SIDE), "--batch-size", "4", "--dtype",
                               "float32", "--num-workers", "0", *flags]) == 0


def _train(tmp_path, cache, vae: str, *extra: str) -> list[str]:
    """train.py's argv for 2 steps of a tiny ViT-5 on the cache (the 2-step run of the issue)."""
    return ["--config", "configs/demo.yaml", f"train.out_dir={tmp_path / 'run'}", "model.depth=1",
            "model.name=ViT5-S/2", "model.hidden_size=32", "model.num_heads=2",
            "model.learn_sigma=false", "data.kind=latents", f"data.root={cache}",
            f"data.image_size={SIDE}", "data.num_workers=0", "data.global_batch_size=4",
            f"vae.name={vae}", "train.steps=2", "train.sample_every=0", "train.log_every=1",
            "train.tensorboard=false", "train.milestone_every=0", "sample.num_steps=4", *extra]


def _grid(ckpt, out, labels) -> np.ndarray:
    argv = ["grid", "--ckpt", str(ckpt), "--classes", *map(str, labels), "--seed", "3", "--out",
            str(out), "--no-progress"]
    assert load_sample_cli().main(argv) == 0
    return np.stack([np.asarray(Image.open(out / f"{i:06d}.png")) for i in range(len(labels))])


def _posterior_means(spaces, vae: str) -> torch.Tensor:
    """Every image's and its mirror's posterior mean straight from diffusers: [2N, C, h, w]."""
    model = AutoencoderKL.from_pretrained(vae).eval()
    images = ImageFolderDataset(spaces["images"], SIDE, random_flip=False)
    x = torch.stack([images.read(i) for i in range(len(images))])
    with torch.no_grad():
        return torch.cat([model.encode(v).latent_dist.mean for v in (x, x.flip(-1))]).double()


def _round_trip(tmp_path, ckpt) -> tuple[np.ndarray, SiTPipeline]:
    """sample.py's grid and the exported pipeline's images of the same labels and seed."""
    labels = [0, 1, 1]
    expected = _grid(ckpt, tmp_path / "grid", labels)
    assert export_main([str(ckpt), str(tmp_path / "export")]) == 0
    pipe = SiTPipeline.from_pretrained(tmp_path / "export")
    pipe.set_progress_bar_config(disable=True)
    pixels = pipe(labels, generator=3, output_type="uint8").images
    assert pixels.shape == expected.shape == (3, SIDE, SIDE, 3)
    assert np.array_equal(pixels, expected)  # pixel for pixel
    return expected, pipe


def test_flux_like_16_channel_vae_with_a_shift_end_to_end(tmp_path, spaces, caches, capsys):
    cache = caches["flux"]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["latent_shape"] == [16, 4, 4] and manifest["shift_factor"] == FLUX_SHIFT
    means = _posterior_means(spaces, spaces["flux"])  # stored: (mean − shift) · scale
    stored = np.concatenate([np.load(cache / s["mean"]) for s in manifest["shards"]])
    stored = torch.from_numpy(stored).transpose(0, 1).reshape(means.shape)  # flips second
    torch.testing.assert_close(stored.double(), (means - FLUX_SHIFT) * FLUX_SCALE, rtol=1e-5,
                               atol=1e-6)
    status, _ = run_train(_train(tmp_path, cache, spaces["flux"],
                                 f"vae.scaling_factor={FLUX_SCALE}",
                                 f"vae.shift_factor={FLUX_SHIFT}"), capsys)
    assert status == 0
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["vae"]
    assert (saved["scaling_factor"], saved["shift_factor"]) == (FLUX_SCALE, FLUX_SHIFT)
    expected, pipe = _round_trip(tmp_path, ckpt)
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (FLUX_SCALE,
                                                                               FLUX_SHIFT)
    # the decoder really undoes the shift: another shift gives other pixels
    assert load_sample_cli().main(["grid", "--ckpt", str(ckpt), "--classes", "0", "1", "1",
                                   "--seed", "3", "--out", str(tmp_path / "g2"), "--no-progress",
                                   "--vae", spaces["sd"]]) == 2
    assert_names(one_sample_error(capsys, "grid"), "16", "4")  # channels of model and VAE
    assert not (tmp_path / "g2").exists()
    assert expected.std() > 0


def test_vavae_like_32_channel_vae_with_the_cache_statistics(tmp_path, spaces, caches, capsys):
    cache = caches["vavae"]
    stats = json.loads((cache / "manifest.json").read_text())["latent_stats"]
    means = _posterior_means(spaces, spaces["vavae"])  # [2N, 32, 2, 2]
    per_channel = means.transpose(0, 1).reshape(32, -1)
    np.testing.assert_allclose(stats["mean"], per_channel.mean(1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stats["std"], per_channel.std(1, unbiased=False), rtol=1e-5)
    assert stats["values"] == per_channel.shape[1]

    status, _ = run_train(_train(tmp_path, cache, spaces["vavae"], "vae.latent_stats=cache",
                                 "model.patch_size=1"), capsys)
    assert status == 0
    norm = LatentNorm.from_stats(stats["mean"], stats["std"])
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    saved = torch.load(ckpt, weights_only=True)["args"]["vae"]
    assert LatentNorm.from_section(saved) == norm  # exactly, through the checkpoint
    expected, pipe = _round_trip(tmp_path, ckpt)
    scheduler = json.loads((tmp_path / "export" / "scheduler" / "scheduler_config.json").read_text())
    assert LatentNorm.from_section(scheduler["vae"]) == norm  # exactly, through the export
    np.testing.assert_allclose(pipe.vae.config.latents_mean, stats["mean"], rtol=0, atol=0)
    np.testing.assert_allclose(pipe.vae.config.latents_std, stats["std"], rtol=1e-15)

    # the run's latents are standardised: over all images and flips, per channel mean 0 / std 1
    data = LatentCacheDataset(cache, random_flip=False)
    data.normalize_to(norm)
    both = torch.stack([data.moments(i, f)[0] for i in range(len(data)) for f in (0, 1)])
    flat = both.double().transpose(0, 1).reshape(32, -1)
    torch.testing.assert_close(flat.mean(1), torch.zeros(32, dtype=torch.float64), atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(flat.std(1, unbiased=False), torch.ones(32, dtype=torch.float64),
                               atol=1e-4, rtol=0)

    # resuming against a cache written with other statistics: refused, naming the key
    other = tmp_path / "other"  # other images (the statistics do not depend on the stored scale)
    _cache({"images": make_image_folder(tmp_path / "images", {"a": 3, "b": 3}, seed=1)},
           spaces["vavae"], other, "--scaling-factor", "0.5")
    before = sorted((tmp_path / "run" / "checkpoints").iterdir())
    status, line = run_train(_train(tmp_path, other, spaces["vavae"], "vae.latent_stats=cache",
                                    "model.patch_size=1", "train.steps=3") + ["--resume",
                                                                             "latest"], capsys)
    assert status == 2 and "vae.scaling_factor" in line
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == before


def test_latent_norm_round_trips_and_refuses_what_it_cannot_use():
    norm = LatentNorm.from_stats([0.5, -1.0, 2.0], [2.0, 0.25, 1.0])
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(norm.denormalize(norm.normalize(x)), x)
    torch.testing.assert_close(norm.normalize(x)[:, 1], (x[:, 1] + 1.0) * 4.0)  # (x − μ) / σ
    assert LatentNorm.from_section(json.loads(json.dumps(norm.section()))) == norm
    mean, std = torch.randn(3, 4, 4), torch.rand(3, 4, 4)
    flux = LatentNorm(FLUX_SCALE, FLUX_SHIFT)
    gain, offset = flux.affine_to(norm, 3)  # stored one way, read the other
    torch.testing.assert_close(mean * gain + offset, norm.normalize(flux.denormalize(mean)))
    torch.testing.assert_close(std * gain, std / FLUX_SCALE * torch.tensor([0.5, 4.0, 1.0]).view(-1, 1, 1))
    same = flux.affine_to(LatentNorm(FLUX_SCALE, FLUX_SHIFT), 3)
    assert torch.equal(same[0], torch.ones(3, 1, 1)) and torch.equal(same[1], torch.zeros(3, 1, 1))
    sd = torch.randn(2, 4, 3, 3)
    assert torch.equal(LatentNorm().denormalize(sd), sd / 0.18215)  # SD-VAE: bit for bit as before
    for section, key in (({"scaling_factor": [1.0, 0.0]}, "vae.scaling_factor"),
                         ({"scaling_factor": [1.0], "shift_factor": [0.0, 1.0]}, "vae.shift_factor"),
                         ({"shift_factor": "x"}, "vae.shift_factor")):
        with pytest.raises(ConfigError, match=key):
            LatentNorm.from_section(section)
    with pytest.raises(ConfigError, match="3 values, but the latents have 4 channels"):
        norm.check_channels(4)


def test_bad_latent_settings_are_one_line_and_write_nothing(tmp_path, spaces, capsys):
    cache = tmp_path / "cache"
    _cache(spaces, spaces["flux"], cache, *FLUX_FLAGS)
    run = tmp_path / "run"
    # stats of the wrong length
    status, line = run_train(_train(tmp_path, cache, spaces["flux"],
                                    "vae.scaling_factor=[1.0, 2.0, 3.0]"), capsys)
    assert status == 2 and not run.exists()
    assert_names(line, "vae.scaling_factor", "3 values", "16 channels")
    # no shift for a VAE whose config has one: ambiguous
    status, line = run_train(_train(tmp_path, cache, spaces["flux"],
                                    f"vae.scaling_factor={FLUX_SCALE}"), capsys)
    assert status == 2 and not run.exists()
    assert_names(line, "shift_factor", FLUX_SHIFT, "vae.shift_factor")
    # a shift for a VAE whose config has none: ambiguous, refused before anything is written
    other = tmp_path / "sd-cache"
    assert cache_latents.cli(["--data-dir", str(spaces["images"]), "--out", str(other), "--vae",
                              spaces["sd"], "--image-size", str(SIDE), "--num-workers", "0",
                              "--shift-factor", "0.1"]) == 2
    assert_names(one_error_line(capsys), "--shift-factor", "0.1", spaces["sd"])
    assert not other.exists()
    # per-channel values other than the cache's statistics
    status, line = run_train(_train(tmp_path, cache, spaces["flux"], "vae.latent_stats=cache",
                                    f"vae.scaling_factor={[1.0] * 16}"), capsys)
    assert status == 2 and not run.exists()
    assert_names(line, "vae.scaling_factor", str(cache))
    # a cache written without statistics (an older version) says how to add them
    manifest = json.loads((cache / "manifest.json").read_text())
    del manifest["latent_stats"]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    status, line = run_train(_train(tmp_path, cache, spaces["flux"], "vae.latent_stats=cache"),
                             capsys)
    assert status == 2 and not run.exists()
    assert_names(line, "latent_stats", "sit_vit5.cache_latents", str(cache))
    _cache(spaces, spaces["flux"], cache, *FLUX_FLAGS)  # the rerun adds them
    assert "latent_stats" in json.loads((cache / "manifest.json").read_text())


def test_the_latent_space_configs_train_with_tiny_autoencoders_of_their_shape(tmp_path, spaces,
                                                                             caches, capsys):
    """Each ready config, at reduced size, on the tiny autoencoder with its latent channels: its
    vae section and model keys work as written (in_channels checked against the VAE's)."""
    configs = sorted(Path("configs/latents").glob("*.yaml"))
    assert len(configs) >= 2
    by_channels = {16: "flux", 32: "vavae"}
    for config in configs:
        cfg = yaml.safe_load(config.read_text())
        space = by_channels[cfg["model"]["in_channels"]]
        out = tmp_path / config.stem
        argv = ["--config", str(config), f"train.out_dir={out}", "model.depth=1",
                "model.hidden_size=32", "model.num_heads=2", "model.input_size=null",
                f"data.root={caches[space]}", f"data.image_size={SIDE}", "data.num_workers=0",
                "data.global_batch_size=2", f"vae.name={spaces[space]}", "train.steps=1",
                "train.sample_every=0", "train.tensorboard=false", "train.milestone_every=0"]
        status, line = run_train(argv, capsys)
        assert status == 0, (config, line)
        saved = yaml.safe_load((out / "config.yaml").read_text())
        assert saved["model"]["in_channels"] == cfg["model"]["in_channels"]
        assert LatentNorm.from_section(saved["vae"]).channels in (None, saved["model"]["in_channels"])


def test_a_checkpoint_without_the_new_keys_decodes_as_before(tmp_path, vae_dir):
    """A checkpoint written before shift_factor / latent_stats existed: sample.py's pixels are the
    latents of the same samples decoded by hand as DiT / SiT do, vae.decode(z / 0.18215)."""
    from sit_vit5.images import to_uint8
    from sit_vit5.models import load_model
    from sit_vit5.sample_spec import SampleSpec
    from sit_vit5.sampling import SamplingPipeline
    from tests.test_pipeline import checkpoint

    ckpt = checkpoint(tmp_path / "run", 4, str(vae_dir))
    state = torch.load(ckpt, weights_only=True)
    state["args"]["vae"] = {"name": str(vae_dir), "scaling_factor": 0.18215}  # the old section
    del state["payload_sha256"]
    from sit_vit5.training import save_checkpoint

    old = save_checkpoint(state, tmp_path / "old" / "checkpoints", step=3)
    images = _grid(old, tmp_path / "grid", [1, 2])
    loaded = load_model(old)
    pipe = SamplingPipeline.for_model(loaded, SampleSpec.resolve(loaded.sample))  # no decoding
    latents = pipe.generate([0, 1], 3, [1, 2]).pixels
    vae = AutoencoderKL.from_pretrained(vae_dir).eval().requires_grad_(False)
    with torch.no_grad():
        by_hand = to_uint8(vae.decode(latents / 0.18215).sample.float())
    assert np.array_equal(images, by_hand)
