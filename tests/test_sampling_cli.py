"""sample.py end to end: grid and bulk from our training checkpoints (pixel and VAE-latent) and official ones."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sample
from sit_vit5.cli.sample_flags import FLAGS
from sit_vit5.config import load_config
from sit_vit5.models import create_model, load_model
from sit_vit5.objective import create_objective
from sit_vit5.sampling import SampleSpec
from sit_vit5.training import checkpoint as ck
from sit_vit5.training import save_checkpoint, train
from sit_vit5.training.grids import grid_images
from tests.helpers import TRAIN_ARGV, assert_names, load_sample_cli, load_train_cli, one_sample_error

TINY = dict(depth=1, hidden_size=32, num_heads=2, input_size=8, num_classes=10, learn_sigma=False)




def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model




def our_checkpoint(root, in_channels: int, vae: str = "none", seed: int = 0) -> str:
    """A training checkpoint as the training loop writes it (sidecar + latest.json), config in ``args``."""
    overrides = [f"model.{k}={v}" for k, v in {"name": "SiT-S/2", "in_channels": in_channels, **TINY}.items()]
    cfg = load_config("configs/demo.yaml", overrides + [f"vae.name={vae}"])
    torch.manual_seed(seed)  # the same weights whichever tests ran before
    model = perturbed(create_model("SiT-S/2", in_channels=in_channels, **TINY))
    state = {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": cfg, "step": 7}
    return str(save_checkpoint(state, root / "checkpoints", step=7))


@pytest.fixture(scope="module")
def pixel_ckpt(tmp_path_factory):
    return our_checkpoint(tmp_path_factory.mktemp("pixel_run"), in_channels=1)


@pytest.fixture(scope="module")
def latent_ckpt(tmp_path_factory, vae_dir):
    return our_checkpoint(tmp_path_factory.mktemp("latent_run"), in_channels=4, vae=str(vae_dir))


def grid_side(n: int, side: int, nrow: int | None = None) -> tuple[int, int]:
    """torchvision make_grid size after save_grid's nearest upscaling of tiny images to >= 64 px."""
    factor = max(1, math.ceil(64 / side))
    side, pad = side * factor, max(2, factor // 2)
    cols = min(nrow or math.ceil(math.sqrt(n)), n)
    rows = math.ceil(n / cols)
    return cols * (side + pad) + pad, rows * (side + pad) + pad


def test_grid_writes_grid_and_single_images(pixel_ckpt, tmp_path, capsys):
    out = tmp_path / "grid"
    argv = ["grid", "--ckpt", pixel_ckpt, "--classes", "1", "2", "3", "--num-steps", "3", "--out", str(out),
            "--no-progress"]
    assert sample.main(argv) == 0
    printed = capsys.readouterr().out
    assert "labels: [1, 2, 3]" in printed and "NFE per image: 2" in printed and "images/s" in printed
    assert "[ours (ema), step 7]" in printed and "sampling_method=euler" in printed  # checkpoint's sample section
    with Image.open(out / "grid.png") as im:
        assert im.size == grid_side(3, 8)
    for i in range(3):
        with Image.open(out / f"{i:06d}.png") as im:
            assert im.size == (8, 8) and im.mode == "L"


def test_grid_image_i_is_bulk_sample_i(pixel_ckpt, tmp_path, capsys):
    flags = ["--ckpt", pixel_ckpt, "--seed", "3", "--method", "sde", "--num-steps", "3", "--no-progress"]
    assert sample.main(["grid", *flags, "--num-images", "4", "--out", str(tmp_path / "g")]) == 0
    printed = capsys.readouterr().out
    assert "sampling_method=Euler" in printed  # the checkpoint's ODE method is not carried over to the SDE
    assert sample.main(["bulk", *flags, "--num-samples", "4", "--out", str(tmp_path / "b")]) == 0
    with np.load(tmp_path / "b" / "samples_4x8x8x3.npz") as f:
        images, labels = f["arr_0"], f["arr_1"]
    assert f"labels: {labels.tolist()}" in printed
    for i in range(4):
        with Image.open(tmp_path / "g" / f"{i:06d}.png") as im:
            assert np.array_equal(np.asarray(im), images[i, ..., 0])


def test_bulk_latent_model_decodes_and_resumes(latent_ckpt, tmp_path, capsys):
    argv = ["bulk", "--ckpt", latent_ckpt, "--num-samples", "3", "--batch-size", "2", "--num-steps", "2",
            "--png", "--out", str(tmp_path), "--no-progress", "--cfg-scale", "2", "--cfg-channels", "3"]
    assert sample.main(argv) == 0
    assert "generated 3, skipped 0" in capsys.readouterr().out
    with np.load(tmp_path / "samples_3x16x16x3.npz") as f:
        images = f["arr_0"]
    assert images.shape == (3, 16, 16, 3) and images.dtype == np.uint8
    with Image.open(tmp_path / "images" / "000002.png") as im:
        assert im.mode == "RGB" and np.array_equal(np.asarray(im), images[2])
    assert sample.main(argv) == 0
    assert "generated 0, skipped 3" in capsys.readouterr().out
    assert sample.main([*argv, "--seed", "1"]) == 2
    assert "global_seed: 0" in capsys.readouterr().err


def test_official_bare_state_dict_needs_model_flag(tmp_path, vae_dir, capsys):
    torch.manual_seed(0)
    model = create_model("SiT-S/2", input_size=8, in_channels=4, learn_sigma=True, num_classes=10)
    path = tmp_path / "SiT-S-2-8.pt"
    torch.save(perturbed(model).state_dict(), path)
    out = tmp_path / "grid"
    argv = ["grid", "--ckpt", str(path), "--vae", str(vae_dir), "--num-images", "2", "--method", "ode",
            "--sampling-method", "heun2", "--num-steps", "2", "--out", str(out), "--no-progress"]
    assert sample.main(argv) == 2
    assert "--model" in capsys.readouterr().err
    assert sample.main([*argv, "--model", "SiT-S/2"]) == 0
    printed = capsys.readouterr().out
    assert "[official]" in printed and "16x16" in printed and "NFE per image: 2" in printed
    with Image.open(out / "000001.png") as im:
        assert im.size == (16, 16) and im.mode == "RGB"


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--model", "SiT-B/2"], ("'SiT-S/2'", "'SiT-B/2'", "0000007.pt")),
        (["--path-type", "GVP"], ("--path-type", "GVP", "path_type=Linear")),
        (["--vae", "stabilityai/sd-vae-ft-ema"], ("--vae", "stabilityai/sd-vae-ft-ema",
                                                  "vae.name=none")),
        (["--classes", "3", "10"], ("--classes", "[10]", "[0, 10)")),
        (["--sampling-method", "rk45"], ("--sampling-method rk45", "'dopri5'", "'unipc'")),
        (["--image-size", "7"], ("--image-size", "7", "2")),
        (["--cfg-scale", "2", "--cfg-channels", "3"], ("cfg_channels=3", "1")),
    ],
)
def test_bad_flags_exit_2_naming_them(pixel_ckpt, tmp_path, capsys, extra, names):
    argv = ["grid", "--ckpt", pixel_ckpt, "--num-steps", "2", "--out", str(tmp_path), "--no-progress", *extra]
    assert sample.main(argv) == 2
    assert_names(one_sample_error(capsys, "grid"), *names)


def test_bad_files_exit_2(pixel_ckpt, latent_ckpt, tmp_path, capsys):
    assert sample.main(["grid", "--ckpt", str(tmp_path / "missing.pt"), "--out", str(tmp_path)]) == 2
    assert "missing.pt" in capsys.readouterr().err
    assert sample.main(["grid", "--ckpt", latent_ckpt, "--vae", "none", "--out", str(tmp_path)]) == 2
    assert "needs a decoder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse rejects the value itself
        sample.main(["grid", "--ckpt", pixel_ckpt, "--cfg-channels", "0"])
    assert exit_info.value.code == 2
    tampered = tmp_path / "tampered.pt"
    data = bytearray(Path(pixel_ckpt).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data
    tampered.write_bytes(bytes(data))
    (tmp_path / "tampered.pt.sha256").write_text(Path(pixel_ckpt + ".sha256").read_text())
    assert sample.main(["grid", "--ckpt", str(tampered), "--out", str(tmp_path)]) == 2
    assert "SHA-256 mismatch" in capsys.readouterr().err


def test_published_protocol_flags(capsys):
    parser = sample.build_parser()
    args = parser.parse_args(["bulk", "--ckpt", "SiT-XL-2-256.pt", "--model", "SiT-XL/2", "--image-size", "256",
                              "--method", "sde", "--sampling-method", "Euler", "--diffusion-form", "sigma",
                              "--num-steps", "250", "--cfg-scale", "1.5", "--cfg-channels", "3", "--out", "x"])
    spec = sample.resolve_spec(args, {})  # an official checkpoint has no sample section
    assert spec == SampleSpec(method="sde", sampling_method="Euler", diffusion_form="sigma", num_steps=250,
                              cfg_scale=1.5, cfg_channels=3, last_step="Mean", last_step_size=0.04)
    with pytest.raises(SystemExit):
        parser.parse_args(["bulk", "--help"])
    assert "FID 2.06" in capsys.readouterr().out


def test_sampler_flags_default_to_the_spec():
    """Every sampler flag defaults to None, so SampleSpec is the only place holding the defaults."""
    args = sample.build_parser().parse_args(["grid", "--ckpt", "x.pt"])
    assert all(getattr(args, key) is None for key in SampleSpec.keys())
    assert sample.resolve_spec(args, {}) == SampleSpec()


def test_flag_table_names_exactly_the_spec_fields():
    """sample_flags.FLAGS holds the argparse side of each spec field: one entry per field, no more."""
    assert list(FLAGS) == list(SampleSpec.keys())


def test_training_grid_is_sample_py_grid(tmp_path):
    """The training loop's grid goes through the same pipeline: its images equal sample.py's images of
    the final checkpoint for the same seed and classes."""
    overrides = ["model.name=SiT-S/2", "model.depth=1", "model.hidden_size=32", "model.num_heads=2",
                 "data.global_batch_size=16", "train.steps=2", "train.ckpt_every=2", "train.sample_every=2",
                 "train.tensorboard=false", f"train.out_dir={tmp_path / 'run'}", "sample.num_images=4",
                 "sample.num_steps=3", "sample.method=sde", "sample.sampling_method=Euler",
                 "sample.cfg_scale=1.5", "sample.seed=5"]
    result = train(load_config("configs/demo.yaml", overrides))
    out = tmp_path / "grid"
    argv = ["grid", "--ckpt", str(result.checkpoint), "--classes", "0", "1", "2", "3", "--seed", "5",
            "--nrow", "10", "--out", str(out), "--no-progress"]  # demo.yaml: sample.nrow=10
    assert sample.main(argv) == 0
    cfg = result.config
    loaded = load_model(result.checkpoint)
    images = grid_images(loaded.model, create_objective(cfg["transport"]), cfg, torch.device("cpu"))
    for i in range(4):
        with Image.open(out / f"{i:06d}.png") as im:
            assert np.array_equal(np.asarray(im), (images[i, 0] * 255).round().to(torch.uint8).numpy())
    with Image.open(out / "grid.png") as a, Image.open(result.sample_grid) as b:
        assert np.array_equal(np.asarray(a.convert("L")), np.asarray(b.convert("L")))


# ------------------------------------------------------------------------ refusals on a damaged run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny trained run (2 steps) whose checkpoint the sampling tests copy and damage."""
    run = tmp_path_factory.mktemp("sampling_run") / "run"
    argv = [*TRAIN_ARGV, f"train.out_dir={run}", "train.steps=2", "train.ckpt_every=2"]
    assert load_train_cli().main(argv) == 0
    return run / "checkpoints" / "0000002.pt"


def nan_ema_checkpoint(trained_run: Path, tmp_path: Path) -> Path:
    """The run's checkpoint with one NaN in its EMA, re-saved properly (valid digests: the damage
    happened in training, not on disk)."""
    state = ck.read_checkpoint(trained_run)
    state["ema"]["final_layer.linear.weight"][0, 0] = float("nan")
    return ck.save_checkpoint(state, tmp_path / "nan", 2)


@pytest.mark.parametrize("command", ["bulk", "grid"])
def test_nan_ema_stops_sampling_naming_the_checkpoint(trained_run, tmp_path, capsys, command):
    """Used to exit 0 with all-black images (and FID 1703 on them)."""
    path = nan_ema_checkpoint(trained_run, tmp_path)
    out = tmp_path / "samples"
    extra = ["--num-samples", "6"] if command == "bulk" else ["--num-images", "6"]
    argv = [command, "--ckpt", str(path), "--out", str(out), "--num-steps", "3",
            "--batch-size", "3", "--method", "ode", "--sampling-method", "euler", "--no-progress",
            *extra]
    assert load_sample_cli().main(argv) == 2
    line = one_sample_error(capsys, command)
    assert f"checkpoint {path}" in line and "non-finite" in line and "samples 0..2" in line
    assert not list(out.rglob("*.npz")) and not list(out.rglob("*.png"))  # nothing written


def test_finite_pipeline_is_unaffected(trained_run, tmp_path):
    """The isfinite check passes on a healthy checkpoint (the same command exits 0)."""
    argv = ["bulk", "--ckpt", str(trained_run), "--out", str(tmp_path / "ok"),
            "--num-samples", "3", "--num-steps", "3", "--batch-size", "3", "--method", "ode",
            "--sampling-method", "euler", "--no-progress"]
    assert load_sample_cli().main(argv) == 0


def test_negative_cfg_scale_needs_the_flag(trained_run, tmp_path, capsys):
    argv = ["grid", "--ckpt", str(trained_run), "--out", str(tmp_path / "g"), "--num-images", "2",
            "--num-steps", "3", "--method", "ode", "--sampling-method", "euler", "--no-progress",
            "--cfg-scale", "-1"]
    cli = load_sample_cli()
    assert cli.main(argv) == 2
    assert "--allow-negative-cfg" in one_sample_error(capsys, "grid")
    assert cli.main([*argv, "--allow-negative-cfg"]) == 0
    assert "cfg_scale=-1.0 < 0" in capsys.readouterr().err  # still warned about


def test_bulk_resume_with_nothing_to_do_says_so(trained_run, tmp_path, capsys):
    argv = ["bulk", "--ckpt", str(trained_run), "--out", str(tmp_path / "b"),
            "--num-samples", "3", "--num-steps", "3", "--batch-size", "3", "--method", "ode",
            "--sampling-method", "euler", "--no-progress"]
    cli = load_sample_cli()
    assert cli.main(argv) == 0 and cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    second = [line for line in out if "generated 0" in line]
    assert len(second) == 1 and "nothing to do" in second[0] and "None" not in second[0]
    assert "0.00 images/s" not in second[0]
