"""Issue 41, a new user's first minute: bad inputs refused before torch loads, no silent numeric
traps (non-finite flags, a CFG scale that blows up, an FID of too few samples, another image size
than training), a truncated checkpoint named as one, and the name copies the fast paths read kept
equal to their sources. (Latencies are measured by bench/cli_startup.py, not here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fid.__main__ as fid_cli
from sit_vit5 import names
from sit_vit5.cli import preflight
from sit_vit5.cli import sample as sample_cli
from sit_vit5.cli import train as train_cli
from sit_vit5.config import load_config
from sit_vit5.guidance import ClassifierFreeGuidance
from sit_vit5.models import create_model
from sit_vit5.training import save_checkpoint
from sit_vit5.utils.run_files import previous_checkpoint, truncation
from tests.helpers import ROOT, TRAIN_ARGV, naming, one_error_line

TINY = dict(depth=1, hidden_size=32, num_heads=2, input_size=8, num_classes=10, learn_sigma=False)


def pixel_checkpoint(ckpt_dir: Path, step: int = 7) -> Path:
    """A tiny pixel-space SiT checkpoint as the training loop writes it (sidecar, latest.json)."""
    overrides = [f"model.{k}={v}" for k, v in {"name": "SiT-S/2", "in_channels": 1, **TINY}.items()]
    cfg = load_config("configs/demo.yaml", [*overrides, "vae.name=none"])
    torch.manual_seed(0)
    model = create_model("SiT-S/2", in_channels=1, **TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    state = {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": cfg, "step": step}
    return save_checkpoint(state, ckpt_dir, step=step)


# --------------------------------------------------------------------- no torch before the error

FAST_CASES = [
    ("train.py", ["train.steps=abc"], "train.steps"),
    ("train.py", ["train.bogus=1"], "train.bogus"),
    ("train.py", ["model.name=SiT-Q/2"], "model.name"),
    ("train.py", ["model.bogus=1"], "model.bogus"),
    ("train.py", ["train.out_dir=/proc/x"], "train.out_dir"),
    ("sample.py", ["grid", "--ckpt", "nope.pt"], "--ckpt nope.pt"),
    ("sample.py", ["grid", "--ckpt", "nope.pt", "--cfg-scale", "nan"], "--cfg-scale"),
    ("sample.py", ["grid", "--ckpt", "nope.pt", "--num-steps", "0"], "--num-steps"),
]


@pytest.mark.parametrize("script, argv, named", FAST_CASES, ids=lambda c: " ".join(c) if isinstance(c, list) else c)
def test_bad_input_is_refused_before_torch_is_imported(script, argv, named):
    """The refusal comes from a process in which torch was never imported (what makes it fast)."""
    probe = (f"import runpy, sys; sys.argv = [{script!r}, *{argv!r}]\n"
             f"try:\n    runpy.run_path({script!r}, run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.stdout.split() == ["NO-TORCH", "2"], (done.stdout, done.stderr)
    assert named in done.stderr and "Traceback" not in done.stderr


def test_fid_refuses_a_missing_file_before_torch_is_imported(tmp_path):
    probe = ("import sys, fid.__main__ as cli\n"
             f"code = cli.main([{str(tmp_path / 'none.npz')!r}, 'digits'])\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["NO-TORCH", "2"], done.stderr
    assert "none.npz" in done.stderr


# --------------------------------------------------------------------- numeric traps


@pytest.mark.parametrize("flag", ["--cfg-scale", "--atol", "--diffusion-norm", "--sample-eps"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_flags_are_refused_at_parse_time(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        sample_cli.main(["grid", "--ckpt", "nope.pt", f"{flag}={value}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "finite" in err


def test_non_finite_config_sampler_values_name_the_key():
    with pytest.raises(ValueError, match=r"sample\.cfg_scale"):
        load_config("demo", ["sample.cfg_scale=.nan"])


def test_a_cfg_scale_that_blows_up_is_an_error_on_the_first_step():
    calls = []

    def model(x, t, y):
        calls.append(len(x))
        return torch.where((y < 10).view(-1, 1, 1, 1), x + 0.5, x)  # cond differs from uncond

    x, t, y = torch.zeros(2, 1, 4, 4), torch.zeros(2), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="cfg_scale=1e\\+30"):
        ClassifierFreeGuidance(model, 1e30, null_class=10)(x, t, y)
    with pytest.raises(ValueError, match="overflows"):
        ClassifierFreeGuidance(model, 1e39, null_class=10)(x, t, y)  # inf in float32
    guided = ClassifierFreeGuidance(model, 4.0, null_class=10)
    assert torch.allclose(guided(x, t, y), torch.full_like(x, 2.0)) and guided.checked
    nan = ClassifierFreeGuidance(lambda x, t, y: x * float("nan"), 1e30, null_class=10)
    assert nan(x, t, y).isnan().all()  # the model's own NaN: left to the sampler's check


def test_sample_cli_names_cfg_scale_when_it_blows_up(tmp_path, capsys):
    ckpt = pixel_checkpoint(tmp_path / "run" / "checkpoints")
    status = sample_cli.main(["grid", "--ckpt", str(ckpt), "--cfg-scale", "1e30", "--num-steps", "3",
                              "--num-images", "2", "--out", str(tmp_path / "g"), "--no-progress"])
    assert status == 2
    assert "--cfg-scale 1e+30" in one_error_line(capsys)
    assert not (tmp_path / "g" / "grid.png").exists()


def test_another_image_size_is_in_the_output_names_and_settings(tmp_path, capsys, monkeypatch):
    ckpt = pixel_checkpoint(tmp_path / "run" / "checkpoints")
    monkeypatch.chdir(tmp_path)
    flags = ["--ckpt", str(ckpt), "--image-size", "16", "--num-steps", "2", "--no-progress"]
    assert sample_cli.main(["grid", *flags, "--num-images", "1"]) == 0
    assert (tmp_path / "samples" / "grid-16px-trained8px" / "grid.png").is_file()
    assert sample_cli.main(["bulk", *flags, "--num-samples", "2"]) == 0
    out = next(p for p in (tmp_path / "samples").glob("*-16px-trained8px") if p.name[:4] != "grid")
    settings = json.loads((out / "settings.json").read_text())
    assert (settings["image_size"], settings["trained_image_size"]) == (16, 8)
    (npz,) = out.glob("samples_2x16x16x3.npz")
    with np.load(npz, allow_pickle=False) as f:  # the npz carries the same record, arr_0 unchanged
        assert json.loads(str(f["settings"])) == settings and f["arr_0"].shape == (2, 16, 16, 3)
    assert "the model was trained at 8" in capsys.readouterr().err  # the one-line warning stays


def digits_npz(path: Path, n: int) -> Path:
    images = np.random.default_rng(0).integers(0, 256, (n, 8, 8, 1), dtype=np.uint8)
    np.savez(path, arr_0=images)
    return path


def test_fid_refuses_fewer_samples_than_the_feature_dimension(tmp_path, capsys):
    path = digits_npz(tmp_path / "two.npz", 2)
    assert fid_cli.main([str(path), "digits"]) == 2
    line = one_error_line(capsys)
    assert "two.npz" in line and "64-d" in line and "--num-samples" in line
    assert not (tmp_path / "two.metrics.json").exists()
    np.savez(tmp_path / "ref.npz", arr_0=np.zeros((30, 8, 8, 3), np.uint8))
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((30, 8, 8, 3), np.uint8))
    assert fid_cli.main([str(tmp_path / "s.npz"), str(tmp_path / "ref.npz"), "--metrics", "fid"]) == 2
    assert "2048-d" in one_error_line(capsys)


def test_fid_notes_a_count_below_the_convention_in_one_line(tmp_path, capsys, monkeypatch):
    import fid.digits

    monkeypatch.setattr(fid.digits, "digits_metrics", lambda images, labels=None, net=None: {"digits_fid": 1.0})
    assert fid_cli.main([str(digits_npz(tmp_path / "s.npz", 100)), "digits", "--no-json"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "1797" in line]
    assert len(notes) == 1 and notes[0].startswith("note: 100 samples")


# --------------------------------------------------------------------- paths and checkpoints


def test_unwritable_out_dir_names_the_key(capsys):
    assert train_cli.main(["train.out_dir=/proc/x"], train_fn=lambda cfg, resume: None) == 2
    line = one_error_line(capsys)
    assert "train.out_dir=/proc/x" in line and "/proc" in line


def test_truncated_checkpoint_is_named_as_one(tmp_path):
    from sit_vit5.models.checkpoint_files import CheckpointError, read_checkpoint

    ckpt = pixel_checkpoint(tmp_path / "checkpoints")
    whole = ckpt.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[: len(whole) // 2])
    assert truncation(ckpt) is None and f"{len(whole) // 2:,} bytes" in truncation(cut)
    with pytest.raises(CheckpointError, match=naming("cut.pt", "bytes")):
        read_checkpoint(cut)  # no sidecar: torch.load fails
    ckpt.write_bytes(whole[:-100])
    with pytest.raises(CheckpointError, match=naming("0000007.pt", "SHA-256")):
        read_checkpoint(ckpt)  # with its sidecar: the digest fails first


def test_resume_latest_onto_a_truncated_newest_names_the_one_before(tmp_path, capsys):
    run = tmp_path / "run"
    older = pixel_checkpoint(run / "checkpoints", step=4)
    newest = pixel_checkpoint(run / "checkpoints", step=7)
    newest.write_bytes(newest.read_bytes()[:1000])
    assert previous_checkpoint(newest) == older
    argv = [*TRAIN_ARGV, f"train.out_dir={run}", "--resume", "latest"]
    assert train_cli.main(argv, train_fn=lambda cfg, resume: pytest.fail("trained")) == 2
    line = one_error_line(capsys)
    assert str(newest) in line and "bytes" in line
    assert f"--resume {older}" in line


def test_sample_ckpt_truncated_is_refused_naming_the_file(tmp_path, capsys):
    ckpt = pixel_checkpoint(tmp_path / "checkpoints")
    ckpt.write_bytes(ckpt.read_bytes()[:500])
    assert sample_cli.main(["grid", "--ckpt", str(ckpt)]) == 2
    line = one_error_line(capsys)
    assert "--ckpt" in line and str(ckpt) in line and "truncated" in line


@pytest.mark.parametrize("torch_version, torchvision_version, bad", [
    ("2.14.1", "0.29.1", False),
    ("2.14.1+cpu", "0.29.1+cpu", False),
    ("2.5.1", "0.20.0", False),
    ("1.13.1", "0.14.1", False),
    ("2.14.1", "0.28.0", True),
    ("2.14.1+cpu", "0.29.1+cu124", True),
])
def test_torch_torchvision_pairs(torch_version, torchvision_version, bad):
    assert (preflight.torch_pair_problem(torch_version, torchvision_version) is not None) == bad


def test_a_mismatched_torchvision_is_one_line_naming_both(monkeypatch, capsys):
    versions = {"torch": "2.14.1+cpu", "torchvision": "0.27.0"}
    monkeypatch.setattr(preflight.metadata, "version", versions.__getitem__)
    assert train_cli.main(TRAIN_ARGV, train_fn=lambda cfg, resume: pytest.fail("trained")) == 2
    line = one_error_line(capsys)
    assert "torch 2.14.1+cpu" in line and "torchvision 0.27.0" in line and "pip install" in line


# --------------------------------------------------------------------- the copies of the names


def test_the_torch_modules_take_their_names_from_the_torch_free_tables():
    """One place per name list: the torch modules import the tables of ``names`` (the same objects),
    and the registries that map a name to code are keyed by exactly those names."""
    from fid import inception, reference
    from fid.evaluate import METRICS
    from sit_vit5 import vae
    from sit_vit5.diffusion import METHODS as DIFFUSION_METHODS
    from sit_vit5.models import registry
    from sit_vit5.models.official import ALIASES, OFFICIAL_WEIGHTS
    from sit_vit5.training import repa
    from sit_vit5.transport import DIFFUSION_FORMS, LAST_STEPS, PATHS, PREDICTIONS, integrators
    from sit_vit5.transport.sampler import METHODS as TRANSPORT_METHODS
    from sit_vit5.utils import precision

    assert names.TRANSPORT_METHODS is TRANSPORT_METHODS and names.DIFFUSION_METHODS is DIFFUSION_METHODS
    assert names.SDE_STEP_NFE is integrators.SDE_STEP_NFE and names.INTERPOLATIONS is repa.INTERPOLATIONS
    assert names.SD_VAE_IDS is vae.SD_VAE_IDS and names.SIZES is registry.SIZES
    assert names.name_objective is registry.name_objective and registry.list_models() == list(names.MODEL_NAMES)
    # registries: name -> code, keyed by the torch-free names in their order
    assert tuple(DIFFUSION_FORMS) == names.DIFFUSION_FORMS and tuple(LAST_STEPS) == names.LAST_STEPS
    assert tuple(PATHS) == names.PATHS and tuple(PREDICTIONS) == names.PREDICTIONS
    assert tuple(precision.PRECISIONS) == names.PRECISIONS and tuple(registry.BACKBONES) == names.BACKBONE_NAMES
    assert names.SD_VAE_SCALING_FACTOR == vae.SD_VAE_NORM.scale
    assert names.OFFICIAL_NAMES == (*OFFICIAL_WEIGHTS, *ALIASES)
    assert names.MODEL_KEYS == ("name", *registry.valid_overrides())  # the constructors' keywords
    assert fid_cli.METRICS is METRICS and fid_cli.PR_IMAGES == reference.PR_IMAGES  # one registry
    assert fid_cli.INCEPTION_SHA256 == inception.INCEPTION_SHA256
    assert (fid_cli.FEATURE_DIMS["fid"], fid_cli.FEATURE_DIMS["sfid"]) == (inception.POOL_DIM,
                                                                           inception.SPATIAL_DIM)
