"""Faults a hostile user (or a busy cluster) produces: each must end in a clear refusal, never a silent wrong
result or a raw traceback. CLI cases call the command's ``main(argv)`` with the exact argument list a user
types (``python train.py optim.ema_decay=2 ...`` is ``main(["optim.ema_decay=2", ...])``) and check: exit
status 2, exactly one stderr line, and the culprit (key and value, or file) named in it."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sit_vit5 import io as sio
from sit_vit5.errors import DEBUG_ENV, one_line
from sit_vit5.runtime import TINY_MODEL_PARAMS, choose_cpu_threads, free_cores
from sit_vit5.training import checkpoint as ck

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.name=ViT5-S/2", "model.depth=2", "model.hidden_size=32", "model.num_heads=2",
        "model.learn_sigma=false", "data.kind=digits", "data.image_size=8", "data.num_workers=0",
        "vae.name=none", "optim.lr=1e-3",
        "optim.ema_decay=0.9", "train.tensorboard=false", "train.sample_every=0", "train.log_every=2",
        "train.milestone_every=0", "data.global_batch_size=16"]


def load_cli():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def one_error_line(capsys) -> str:
    """The single stderr line of a refused command (asserting there is exactly one, starting
    'error: ' or 'python -m fid: error: ')."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error: ", "python -m fid: error: "))]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


def run_train(argv, capsys) -> tuple[int, str]:
    status = load_cli().main([str(a) for a in argv])
    return status, one_error_line(capsys) if status else ""


# ----------------------------------------------------------------------------- config values


@pytest.mark.parametrize("override, named", [
    ("optim.ema_decay=2", "optim.ema_decay=2"),  # used to train to exit 0 with EMA weights ~5e25
    ("optim.ema_decay=1", "optim.ema_decay=1"),  # an EMA that never moves
    ("optim.lr=-1", "optim.lr=-1"),
    ("optim.lr=0", "optim.lr=0"),
    ("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5]"),
    ("optim.grad_clip=-1", "optim.grad_clip=-1"),
    ("optim.warmup_steps=-5", "optim.warmup_steps=-5"),
    ("sample.num_steps=1", "sample.num_steps=1"),
    ("train.sample_every=-1", "train.sample_every=-1"),
    ("train.steps=0", "train.steps=0"),
    ("data.num_workers=-1", "data.num_workers=-1"),
    ("optim.lr=.nan", "optim.lr=nan"),
    ("model.depth=abc", "model.depth='abc'"),  # was a TypeError traceback from range()
    ("model.learn_sigma=3", "model.learn_sigma=3"),
    ("model.norm=batchnorm", "model.norm='batchnorm'"),
    ("model.class_dropout_prob=1.5", "model.class_dropout_prob=1.5"),
    ("model.hidden_size=66", "model.hidden_size=66 is not divisible by model.num_heads=4"),
    ("model.hidden_size=100", "head dim 25"),  # divisible, but 2-D RoPE needs head_dim % 4 == 0
])
def test_bad_config_values_are_one_line_errors(tmp_path, capsys, override, named):
    status, line = run_train([f"train.out_dir={tmp_path / 'run'}", "train.steps=2", override], capsys)
    assert status == 2 and named in line
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_valid_edges_are_accepted():
    from sit_vit5.config import load_config, validate_architecture

    cfg = load_config(None, ["optim.ema_decay=0", "optim.betas=[0,0.999]", "sample.num_steps=2",
                             "train.sample_every=0", "optim.grad_clip=null", "model.layer_scale_init=null"])
    validate_architecture(cfg["model"])
    assert cfg["optim"]["ema_decay"] == 0 and cfg["sample"]["num_steps"] == 2


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    from sit_vit5.config import ConfigError

    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError, match="optim.lr=-1"):
        load_cli().main([f"train.out_dir={tmp_path}", "optim.lr=-1"])


# ----------------------------------------------------------------------------- data


def write_image_folder(root: Path, bad: str | None = None) -> None:
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    if bad:
        (root / bad).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")


@pytest.mark.parametrize("kind", ["missing", "empty", "unset"])
def test_bad_data_root_is_a_one_line_error(tmp_path, capsys, kind):
    root = tmp_path / "data"
    if kind == "empty":
        root.mkdir()
    argv = [*TINY, "data.kind=imagefolder", "data.image_size=8", f"train.out_dir={tmp_path / 'run'}",
            "train.steps=2"]
    if kind != "unset":
        argv.append(f"data.root={root}")
    status, line = run_train(argv, capsys)
    assert status == 2 and ("data.root" in line if kind == "unset" else str(root) in line)


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_jpeg_without_skip_bad_names_the_file(tmp_path, capsys, workers):
    root = tmp_path / "data"
    write_image_folder(root, bad="a/broken.jpg")
    argv = [*TINY, "data.kind=imagefolder", "data.image_size=8", f"data.root={root}", f"data.num_workers={workers}",
            f"train.out_dir={tmp_path / 'run'}", "train.steps=4"]
    status, line = run_train(argv, capsys)
    assert status == 2 and "broken.jpg" in line and "data.skip_bad=true" in line


def test_unwritable_out_dir_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # works for root too, unlike chmod
    status, line = run_train([*TINY, f"train.out_dir={blocker / 'run'}", "train.steps=2"], capsys)
    assert status == 2 and "train.out_dir" in line and str(blocker) in line


# ----------------------------------------------------------------------------- fid inputs


def fid_main(argv, capsys) -> tuple[int, str]:
    from fid.__main__ import main

    status = main([str(a) for a in argv])
    return status, one_error_line(capsys) if status else ""


def digits_images(n=12) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8, 1), dtype=np.uint8)


@pytest.mark.parametrize("labels, named", [
    (np.arange(12) + 5, "outside [0, 10)"),  # used to print accuracy 0.0 and exit 0
    (np.full(12, -1), "outside [0, 10)"),
    (np.array([str(i % 10) for i in range(12)]), "integer class ids"),
    (np.arange(12) % 10 + 0.5, "integer class ids"),
    (np.arange(5), "5 labels for 12 images"),
])
def test_fid_digits_label_checks(tmp_path, capsys, labels, named):
    path = tmp_path / "samples.npz"
    np.savez(path, arr_0=digits_images(), labels=labels)
    status, line = fid_main([path, "digits"], capsys)
    assert status == 2 and named in line and f"{path}[labels]" in line


def test_fid_valid_labels_pass_the_check(tmp_path):
    from fid.__main__ import read_labels

    path = tmp_path / "samples.npz"
    np.savez(path, arr_0=digits_images(), labels=(np.arange(12) % 10).astype(np.float32))
    np.testing.assert_array_equal(read_labels(path, 12), np.arange(12) % 10)


def test_fid_zero_image_npz(tmp_path, capsys):
    path = tmp_path / "empty.npz"
    np.savez(path, arr_0=np.zeros((0, 8, 8, 3), np.uint8))
    for reference in ("digits", path):
        status, line = fid_main([path, reference, "--no-json"], capsys)
        assert status == 2 and f"{path}[arr_0]" in line and "no images" in line


@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_fid_object_array_is_named_and_never_unpickled(tmp_path, capsys, suffix):
    path = tmp_path / f"objects{suffix}"
    array = np.array([{"a": 1}, None], dtype=object)
    np.savez(path, arr_0=array) if suffix == ".npz" else np.save(path, array)
    status, line = fid_main([path, "digits", "--no-json"], capsys)
    assert status == 2 and str(path) in line and "dtype object" in line


def test_fid_corrupt_image_in_folder_is_named(tmp_path, capsys):
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, image in enumerate(digits_images(3)):
        Image.fromarray(image[..., 0]).save(folder / f"{i}.png")
    (folder / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    status, line = fid_main([folder, "digits", "--no-json"], capsys)
    assert status == 2 and str(folder / "3.png") in line


def test_fid_unwritable_out_is_refused_before_the_work(tmp_path, capsys):
    path = tmp_path / "samples.npz"
    np.savez(path, arr_0=digits_images())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, line = fid_main([path, "digits", "--out", blocker / "m.json"], capsys)
    assert status == 2 and "--out" in line and str(blocker) in line


# ----------------------------------------------------------------------------- checkpoints


def small_state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    return {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": {"train": {"seed": 0}},
            "step": step, "epoch": 0, "batch_in_epoch": step, "rng": ck.rng_state(), "versions": {},
            "model_name": "x"}


def test_payload_digest_is_independent_of_the_pickle(tmp_path):
    state = small_state(1)
    digest = sio.payload_sha256(state)
    torch.save(state, tmp_path / "a.pt")
    assert sio.payload_sha256(torch.load(tmp_path / "a.pt", weights_only=True)) == digest
    state["model"]["weight"][0, 0] += 1e-7  # any change of a value changes the digest
    assert sio.payload_sha256(state) != digest


def test_byte_flips_without_sidecar_are_never_silent(tmp_path):
    """A .pt copied on its own (no .sha256) with one flipped bit: refused, or (padding, zip metadata that
    the reader ignores) loaded with exactly the saved content. Never loaded with different content."""
    state = small_state(3)
    path = ck.save_checkpoint(state, tmp_path, 3)
    ck.sidecar(path).unlink()
    original = path.read_bytes()
    offsets = random.Random(0).sample(range(len(original)), 300)
    refused = 0
    for offset in offsets:
        data = bytearray(original)
        data[offset] ^= 1 << (offset % 8)
        path.write_bytes(bytes(data))
        try:
            loaded = ck.read_checkpoint(path)
        except ck.CheckpointError:
            refused += 1
            continue
        assert sio.payload_sha256(loaded) == sio.payload_sha256(state), f"silent change at byte {offset}"
        assert loaded.keys() == state.keys()
    assert refused > len(offsets) // 2  # most bytes are tensor data or pickle: those flips must be refused


def test_flipped_tensor_byte_is_refused_by_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert load_cli().main([*TINY, f"train.out_dir={run}", "train.steps=2", "train.ckpt_every=2"]) == 0
    path = run / "checkpoints" / "0000002.pt"
    ck.sidecar(path).unlink()
    state = torch.load(path, weights_only=True)
    state["ema"]["blocks.0.attn.qkv.weight"][0, 0] *= -1  # a value changed, the pickle re-written around it
    torch.save(state, path)
    capsys.readouterr()
    status, line = run_train([*TINY, f"train.out_dir={run}", "train.steps=4", "--resume", "latest"], capsys)
    assert status == 2 and str(path) in line and "corrupt" in line


def test_disk_full_during_a_checkpoint(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing the second checkpoint: one line naming both files; the first stays latest."""
    run = tmp_path / "run"
    writes = {"n": 0}
    real_write = sio._HashingWriter.write

    def failing_write(self, data):
        if self.file.name.endswith("0000004.pt"):
            writes["n"] += 1
            if writes["n"] > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(sio._HashingWriter, "write", failing_write)
    status, line = run_train([*TINY, f"train.out_dir={run}", "train.steps=6", "train.ckpt_every=2"], capsys)
    ckpts = run / "checkpoints"
    assert status == 2
    assert line == (f"error: no space left on device writing {ckpts / '0000004.pt'}; the previous checkpoint "
                    f"{ckpts / '0000002.pt'} is intact")
    assert sorted(p.name for p in ckpts.iterdir()) == ["0000002.pt", "0000002.pt.sha256", "latest.json"]
    assert json.loads((ckpts / "latest.json").read_text())["file"] == "0000002.pt"
    ck.read_checkpoint(ckpts / "0000002.pt")  # still verifies


def test_orphan_sidecar_is_swept(tmp_path):
    """A kill between deleting a rotated checkpoint and its sidecar leaves a .sha256 alone: the next save
    removes it."""
    ck.save_checkpoint(small_state(1), tmp_path, 1)
    (tmp_path / "0000001.pt").unlink()
    ck.save_checkpoint(small_state(2), tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000002.pt", "0000002.pt.sha256", "latest.json"]


# ----------------------------------------------------------------------------- messages and threads


def test_one_line_unwraps_dataloader_worker_messages():
    wrapped = RuntimeError("Caught UnreadableImageError in DataLoader worker process 0.\nOriginal Traceback "
                           "(most recent call last):\n  File \"x.py\", line 1\nsit_vit5.data.UnreadableImageError: "
                           "cannot read image /d/a.jpg: OSError: broken")
    assert one_line(wrapped) == "cannot read image /d/a.jpg: OSError: broken"
    assert one_line(ValueError("a\n  b")) == "a b"


def test_cpu_thread_choice():
    assert choose_cpu_threads(10**9, requested=3, environ={"OMP_NUM_THREADS": "2"}) == (3, "train.cpu_threads")
    assert choose_cpu_threads(10**9, environ={"OMP_NUM_THREADS": "2"})[0] == 2
    assert choose_cpu_threads(TINY_MODEL_PARAMS - 1, load=0.0, environ={})[0] == 1
    big = choose_cpu_threads(TINY_MODEL_PARAMS, load=0.0, environ={})[0]
    assert big == free_cores(0.0) >= 1
    assert free_cores(load=1e6) == 1  # never more than the free cores, never zero


# ----------------------------------------------------------------------------- model checkpoint hints

HINT_MODEL = dict(input_size=8, in_channels=4, num_classes=10, depth=2, hidden_size=64, num_heads=4)


@pytest.mark.parametrize("change, expected", [
    (dict(hidden_size=128), "hidden size differs: the checkpoint has hidden_size=128, the model 64"),
    (dict(depth=3), "depth differs: the checkpoint has depth=3, the model 2"),
    (dict(learn_sigma=False), "half the output channels: build the model with learn_sigma=False"),
    (dict(input_size=16), "the checkpoint was trained with input_size=16"),
    (dict(in_channels=3), "the checkpoint has in_channels=3, the model 4"),
])
def test_shape_mismatch_hints_fire_only_when_true(tmp_path, change, expected):
    """A bare state dict (as the released SiT file) of another architecture: exactly the right hint.
    (A hidden-size mismatch used to be explained as learn_sigma: the missing bias defaulted to 0 == 2 * 0.)"""
    from sit_vit5.models import CheckpointError, create_model, load_checkpoint

    path = tmp_path / "bare.pt"
    torch.save(create_model("SiT-S/2", **{**HINT_MODEL, **change}).state_dict(), path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, create_model("SiT-S/2", **HINT_MODEL))
    hints = [line.strip() for line in str(err.value).splitlines() if "hint:" in line]
    assert len(hints) == 1 and expected in hints[0], hints


# ----------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny trained run (2 steps) whose checkpoint the sampling tests copy and damage."""
    run = tmp_path_factory.mktemp("sampling_run") / "run"
    assert load_cli().main([*TINY, f"train.out_dir={run}", "train.steps=2", "train.ckpt_every=2"]) == 0
    return run / "checkpoints" / "0000002.pt"


def load_sample_cli():
    spec = importlib.util.spec_from_file_location("sample_cli", ROOT / "sample.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def one_sample_error(capsys, command: str) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"sample.py {command}: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


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
    argv = [command, "--ckpt", str(path), "--out", str(out), "--num-steps", "3", "--batch-size", "3",
            "--method", "ode", "--sampling-method", "euler", "--no-progress", *extra]
    assert load_sample_cli().main(argv) == 2
    line = one_sample_error(capsys, command)
    assert f"checkpoint {path}" in line and "non-finite" in line and "samples 0..2" in line
    assert not list(out.rglob("*.npz")) and not list(out.rglob("*.png"))  # nothing written


def test_finite_pipeline_is_unaffected(trained_run, tmp_path):
    """The isfinite check passes on a healthy checkpoint (the same command exits 0)."""
    argv = ["bulk", "--ckpt", str(trained_run), "--out", str(tmp_path / "ok"), "--num-samples", "3",
            "--num-steps", "3", "--batch-size", "3", "--method", "ode", "--sampling-method", "euler",
            "--no-progress"]
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
    argv = ["bulk", "--ckpt", str(trained_run), "--out", str(tmp_path / "b"), "--num-samples", "3",
            "--num-steps", "3", "--batch-size", "3", "--method", "ode", "--sampling-method", "euler",
            "--no-progress"]
    cli = load_sample_cli()
    assert cli.main(argv) == 0 and cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    second = [line for line in out if "generated 0" in line]
    assert len(second) == 1 and "nothing to do" in second[0] and "None" not in second[0]
    assert "0.00 images/s" not in second[0]


def test_part_names_say_which_indices_they_hold():
    from sit_vit5.sampling import _part_name

    assert _part_name(np.arange(0, 32)) == "0000000-0000031.npz"
    assert _part_name(np.arange(48, 384, 8)) == "0000048-0000376-step8.npz"  # one of 8 processes
    odd = _part_name(np.array([48, 50, 383]))
    assert odd.startswith("0000048-0000383-3-") and odd != _part_name(np.array([48, 51, 383]))


def test_truncated_part_is_removed_and_remade(tmp_path):
    """A part cut short after it was written (disk trouble, a copy): removed and regenerated once,
    not warned about forever; the merged samples equal an undamaged run's."""
    from sit_vit5.models import create_model
    from sit_vit5.sampling import SampleSpec, SamplingPipeline, sample_bulk
    from sit_vit5.transport import create_transport

    torch.manual_seed(0)
    model = create_model("SiT-S/2", input_size=8, in_channels=1, num_classes=10, depth=1, hidden_size=32,
                         num_heads=2, learn_sigma=False)

    def pipe():
        return SamplingPipeline(model, create_transport(), SampleSpec(method="ode", sampling_method="euler",
                                                                      num_steps=3), (1, 8, 8), 10)

    reference = sample_bulk(pipe(), 6, tmp_path / "ref", batch_size=3, progress=False).npz
    run = tmp_path / "run"
    sample_bulk(pipe(), 6, run, batch_size=3, progress=False)
    part = run / "parts" / "0000003-0000005.npz"
    part.write_bytes(part.read_bytes()[:100])
    with pytest.warns(UserWarning, match="removed unreadable part"):
        result = sample_bulk(pipe(), 6, run, batch_size=3, progress=False)
    assert result.generated == 3 and result.skipped == 3
    with np.load(result.npz) as a, np.load(reference) as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the third run has nothing to warn about
        assert sample_bulk(pipe(), 6, run, batch_size=3, progress=False).generated == 0


# ----------------------------------------------------------------------------- pre-emption


def train_command(run: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *TINY, f"train.out_dir={run}", f"train.steps={steps}",
            "train.ckpt_every=1000", "train.log_every=10", *extra]


def compared(state: dict) -> dict:
    """What a resume must reproduce bit for bit (args holds out_dir and steps, which differ)."""
    return {k: state[k] for k in ("model", "ema", "opt", "step", "epoch", "batch_in_epoch", "rng")}


@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow),
                                  pytest.param("SIGUSR1", marks=pytest.mark.slow)])
def test_signal_checkpoints_the_step_and_resume_is_bit_identical(tmp_path, name):
    """A real signal to a real `python train.py`: it finishes the step, writes a checkpoint of it,
    exits 3; `--resume latest` then ends exactly where an uninterrupted run ends."""
    steps, run = 400, tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "log.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen(train_command(run, steps), env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while proc.poll() is None and "step 0000010" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()
    proc.send_signal(getattr(signal, name))
    assert proc.wait(timeout=120) == 3, log.read_text()
    ckpt = ck.latest_checkpoint(run / "checkpoints")
    stopped = ck.read_checkpoint(ckpt)["step"]
    assert 10 <= stopped < steps and f"stopped by {name} after step {stopped}" in log.read_text()

    # the uninterrupted run, in this process (train.py without --config = the demo config + overrides):
    # the same states at the pre-emption step and at the end
    from sit_vit5.config import load_config
    from sit_vit5.training import train

    for target, other in ((stopped, ckpt), (steps, None)):
        ref = train(load_config(ROOT / "configs" / "demo.yaml", [*TINY, f"train.out_dir={tmp_path / f'ref{target}'}",
                                       f"train.steps={target}", "train.ckpt_every=1000"]))
        assert ref.preempted is None and ref.step == target
        if other is None:
            done = subprocess.run(train_command(run, steps, "--resume", "latest"), env=env, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            other = ck.latest_checkpoint(run / "checkpoints")
        assert sio.payload_sha256(compared(ck.read_checkpoint(other))) == \
            sio.payload_sha256(compared(ck.read_checkpoint(ref.checkpoint))), target
