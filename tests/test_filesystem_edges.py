"""Issue 54, the filesystem edges: symlink loops in an image folder, two runs in one out_dir,
duplicated YAML keys, and the inputs that ended in a raw traceback (one stderr line, status 2)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest

import sample
import sit_vit5.cli.sample as sample_cli
from sit_vit5.export import main as export_main
from sit_vit5.image_data import ImageFolderDataset, list_image_folder
from tests.helpers import (
    TRAIN_ARGV,
    make_image_folder,
    one_error_line,
    one_sample_error,
    run_train,
)
from tests.test_sampling_cli import our_checkpoint

# ----------------------------------------------------------------------------- symlink loops


def _listing(root: Path) -> tuple[list[str], list[str]]:
    """(files, warning messages) of ``list_image_folder(root)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files, _, _ = list_image_folder(root)
    return files, [str(w.message) for w in caught]


def test_two_self_links_are_skipped_not_walked_forever(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 3, "b": 2})
    os.symlink(".", root / "a" / "x")  # was: os.walk follows x/y/x/y/... 2^40 paths (a hang)
    os.symlink(".", root / "a" / "y")
    files, messages = _listing(root)
    assert files == ["a/0.png", "a/1.png", "a/2.png", "b/0.png", "b/1.png"]
    assert len(messages) == 2 and "a/x" in messages[0] and "a/y" in messages[1]
    assert all("already listed" in m for m in messages)


def test_one_self_link_does_not_duplicate_the_images(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 3})
    os.symlink(".", root / "a" / "self")  # was: 3 images counted 41 times (123 items)
    with pytest.warns(UserWarning, match="a/self"):
        dataset = ImageFolderDataset(root, 8)
    assert len(dataset) == 3


def test_links_to_the_root_or_another_class_are_skipped(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 2, "b": 1})
    os.symlink("..", root / "a" / "up")  # a loop through the root: b's images would join a
    os.symlink("../b", root / "a" / "b-again")
    files, messages = _listing(root)
    assert files == ["a/0.png", "a/1.png", "b/0.png"] and len(messages) == 2


def test_a_linked_folder_is_still_followed_once(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 1})
    extra = make_image_folder(tmp_path / "elsewhere", {"more": 2}) / "more"
    os.symlink(extra, root / "a" / "more")  # an ordinary link (no loop): followed as before
    os.symlink(extra, root / "a" / "more2")  # a second way into the same folder: once
    files, messages = _listing(root)
    assert files == ["a/0.png", "a/more/0.png", "a/more/1.png"]
    assert len(messages) == 1 and "a/more2" in messages[0]


# ----------------------------------------------------------------------------- YAML duplicate keys


def test_a_duplicated_section_is_refused_with_both_lines(tmp_path):
    from sit_vit5.config import ConfigError, configs_dir, load_config

    text = (configs_dir() / "demo.yaml").read_text()
    first = 1 + text.splitlines().index("train:")
    path = tmp_path / "dup.yaml"
    path.write_text(text + "train:\n  steps: 30\n")  # was: the first train: section silently lost
    last = len(path.read_text().splitlines()) - 1
    with pytest.raises(ConfigError, match=f"duplicate key 'train' on lines {first} and {last}"):
        load_config(path)


def test_a_duplicated_key_inside_a_section_is_refused(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 3\n  log_every: 1\n  steps: 4\n")  # was: steps=4, silently
    status, line = run_train(["--config", path], capsys)
    assert status == 2 and str(path) in line and "duplicate key 'steps' on lines 2 and 4" in line


def test_yaml_stays_safe_and_merges_still_override(tmp_path):
    from sit_vit5.config import ConfigError, _load_yaml

    assert _load_yaml("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n") == {
        "a": {"b": 1, "c": 2}, "d": {"b": 3, "c": 2}}
    with pytest.raises(Exception, match="could not determine a constructor"):
        _load_yaml("!!python/object/apply:os.system ['true']")
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- one run per out_dir

HOLD = ("import sys, time; from sit_vit5.utils.run_files import hold_run_dir; "
        "held = hold_run_dir(sys.argv[1]); held.__enter__(); print('held', flush=True); time.sleep(120)")


def _holder(run_dir: Path):
    """A process holding ``run_dir`` as a living run's rank 0 does (until killed)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_living_runs_folder_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "D"
    holder = _holder(run_dir)
    try:
        status, line = run_train([*TRAIN_ARGV, f"train.out_dir={run_dir}", "train.steps=2"], capsys)
        # was: both ran, config.yaml of one and checkpoints of the other
        assert status == 2 and f"train.out_dir={str(run_dir)!r} is in use" in line
        assert f"pid {holder.pid}" in line
        assert sorted(p.name for p in run_dir.iterdir()) == [".train.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_resume_after_the_holder_died(tmp_path, capsys):
    run_dir = tmp_path / "D"
    argv = [*TRAIN_ARGV, f"train.out_dir={run_dir}", "train.ckpt_every=2"]
    assert run_train([*argv, "train.steps=2"], capsys) == (0, "")
    holder = _holder(run_dir)
    holder.kill()  # SIGKILL: no cleanup ran, the kernel dropped the lock
    holder.wait()
    assert run_train([*argv, "train.steps=4", "--resume", "latest"], capsys) == (0, "")
    assert (run_dir / "checkpoints" / "0000004.pt").is_file()


def test_only_rank_0_holds_the_folder(tmp_path, monkeypatch):
    from sit_vit5.utils.launcher import launcher_rank
    from sit_vit5.utils.run_files import hold_run_dir

    assert launcher_rank({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == 1
    assert launcher_rank({}) == 0
    holder = _holder(tmp_path / "D")
    try:
        with hold_run_dir(tmp_path / "D", main=False) as lock:  # another rank: no wait, no lock
            assert lock is None
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_fresh_run_leaves_no_folder(tmp_path, capsys):
    run_dir = tmp_path / "new" / "D"
    status, line = run_train([*TRAIN_ARGV, f"train.out_dir={run_dir}", "data.kind=imagefolder",
                              f"data.root={tmp_path / 'missing'}"], capsys)
    assert status == 2 and "missing" in line and not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- the raw tracebacks

FAST = ["--num-steps", "3", "--no-progress", "--batch-size", "2", "--num-images", "2"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A tiny pixel-space SiT checkpoint in ``<run>/checkpoints/`` (sidecar, latest.json)."""
    return our_checkpoint(tmp_path_factory.mktemp("run"), in_channels=1)


def test_an_image_size_off_the_patch_grid_is_refused_before_the_run_folder(tmp_path, capsys):
    run_dir = tmp_path / "E"
    status, line = run_train([*TRAIN_ARGV, "data.image_size=9", f"train.out_dir={run_dir}"],
                             capsys)
    # was: ValueError from the patch embed, status 1 (= non-finite loss), a run folder left
    assert status == 2 and "data.image_size=9" in line and "patch size 2" in line
    assert not run_dir.exists()


@pytest.mark.parametrize("key", ["train.seed", "sample.seed"])
def test_seeds_must_fit_64_bits(key, capsys):
    from sit_vit5.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"{key}=1180591620717411303424; must be an integer >= 0 "
                                          "and <= 18446744073709551615"):
        load_config(None, [f"{key}={2**70}"])  # was: overflow in torch.manual_seed
    assert load_config(None, [f"{key}={2**64 - 1}"])[key.split(".")[0]]["seed"] == 2**64 - 1


def test_an_unavailable_device_is_one_line(ckpt, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --device cuda is available")
    status = sample.main(["grid", "--ckpt", ckpt, "--device", "cuda", "--out", str(tmp_path), *FAST])
    line = one_sample_error(capsys, "grid")  # was: 48 lines ending "Found no NVIDIA driver"
    assert status == 2 and "--device cuda" in line and "no CUDA GPU" in line
    assert sample.main(["grid", "--ckpt", ckpt, "--device", "nonsense", *FAST]) == 2
    assert "--device nonsense" in one_sample_error(capsys, "grid")


@pytest.mark.parametrize("flag", ["--atol", "--rtol"])
def test_adaptive_tolerances_must_be_positive(flag, ckpt, tmp_path, capsys):
    argv = ["grid", "--ckpt", ckpt, "--sampling-method", "dopri5", flag, "0", "--out", str(tmp_path),
            *FAST]
    assert sample.main(argv) == 2  # was: torchdiffeq's "underflow in dt" traceback
    assert f"{flag} 0.0: must be > 0" in one_sample_error(capsys, "grid")


def test_a_negative_seed_is_refused_before_the_model_loads(ckpt, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(sample_cli, "load_model", no_load)
    for seed in ("-1", str(2**70)):
        assert sample.main(["grid", "--ckpt", ckpt, "--seed", seed, *FAST]) == 2
        assert f"--seed {seed}: must be an integer in [0, " in one_sample_error(capsys, "grid")


def _full_disk(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_during_export_names_the_folder_and_leaves_nothing(ckpt, tmp_path, capsys,
                                                                        monkeypatch):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _full_disk)
    out = tmp_path / "exp"
    assert export_main([ckpt, str(out)]) == 2  # was: a SafetensorError traceback
    line = one_error_line(capsys)
    assert str(out) in line and "no space left on device" in line
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_during_bulk_names_the_file(ckpt, tmp_path, capsys, monkeypatch):
    from sit_vit5.sampling import bulk

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bulk.json, "dump", full)  # the claim file's write
    out = tmp_path / "bulk"
    status = sample.main(["bulk", "--ckpt", ckpt, "--num-samples", "2", "--out", str(out), *FAST[:-2]])
    line = one_sample_error(capsys, "bulk")  # was: "[Errno 28] No space left on device", no path
    assert status == 2 and "No space left on device" in line and str(out / "parts") in line
    assert not [p for p in (out / "parts").iterdir()]


def test_a_full_disk_in_an_atomic_write_names_the_file(tmp_path):
    from sit_vit5.utils.atomic_files import atomic_write

    def write(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left on device") as caught:
        atomic_write(tmp_path / "a.npz", write)
    assert caught.value.filename == str(tmp_path / "a.npz") and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- smaller things


def test_a_partial_id2label_is_refused(ckpt, tmp_path, capsys):
    names = tmp_path / "names.txt"
    names.write_text("zero\none\ntwo\n")  # the model has 10 classes
    assert export_main([ckpt, str(tmp_path / "exp"), "--id2label", str(names)]) == 2
    line = one_error_line(capsys)
    assert "id2label names 3 classes but the model has 10" in line and "3, 4, 5" in line
    assert not (tmp_path / "exp").exists()


def test_export_onto_an_empty_file_says_it_is_a_file(ckpt, tmp_path, capsys):
    target = tmp_path / "exp"
    target.touch()
    assert export_main([ckpt, str(target)]) == 2
    line = one_error_line(capsys)  # was: "exists and is not empty"
    assert f"{target} exists and is a file, not a folder" in line


def test_a_text_file_as_checkpoint_is_named_not_a_checkpoint(tmp_path, capsys):
    notes = tmp_path / "notes.pt"
    notes.write_text("hello world\n")
    assert sample.main(["grid", "--ckpt", str(notes), "--model", "SiT-S/2", *FAST]) == 2
    line = one_sample_error(capsys, "grid")  # was: "... weights-only checkpoint (101)"
    assert f"{notes}: not a checkpoint" in line and "b'hello wo'" in line


def test_a_code_running_pickle_is_refused_without_torchs_advice(tmp_path, capsys):
    import torch

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, evil)
    assert sample.main(["grid", "--ckpt", str(evil), "--model", "SiT-S/2", *FAST]) == 2
    line = one_sample_error(capsys, "grid")
    assert "would run code" in line and "print" in line and "weights_only=False" not in line
    assert "ran" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- sample.py takes ours


def _grid(ckpt, out: Path, capsys, *flags: str) -> tuple[list, str]:
    """(the grid's images as arrays, stdout) of ``sample.py grid --ckpt ckpt``."""
    import numpy as np
    from PIL import Image

    argv = ["grid", "--ckpt", str(ckpt), "--classes", "0", "1", "--seed", "3", "--out", str(out),
            *FAST[:-2], *flags]
    assert sample.main(argv) == 0, capsys.readouterr().err
    return [np.asarray(Image.open(out / f"{i:06d}.png")) for i in range(2)], capsys.readouterr().out


def test_an_export_folder_samples_as_its_checkpoint(ckpt, tmp_path, capsys):
    assert export_main([ckpt, str(tmp_path / "exp")]) == 0
    capsys.readouterr()
    want, _ = _grid(ckpt, tmp_path / "a", capsys)
    got, out = _grid(tmp_path / "exp", tmp_path / "b", capsys)  # was: "not a diffusers DiT folder"
    assert all((w == g).all() for w, g in zip(want, got)) and "[export]" in out


def test_a_run_folder_samples_its_newest_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    older = our_checkpoint(run, in_channels=1)
    newest = Path(older).with_name("0000009.pt")
    os.replace(our_checkpoint(tmp_path / "other", in_channels=1, seed=1), newest)
    os.replace(f"{Path(tmp_path / 'other' / 'checkpoints' / '0000007.pt')}.sha256",
               f"{newest}.sha256")
    (run / "checkpoints" / "latest.json").write_text('{"file": "0000009.pt", "step": 9}\n')
    want, _ = _grid(newest, tmp_path / "a", capsys)
    got, out = _grid(run, tmp_path / "b", capsys)  # was: refused, while export takes a run folder
    assert all((w == g).all() for w, g in zip(want, got)) and str(newest) in out


def test_a_shrunk_safetensors_samples_from_its_config_json(tmp_path, capsys):
    import torch

    from sit_vit5.models import create_model
    from tests.test_sampling_cli import TINY, perturbed

    torch.manual_seed(0)
    model = perturbed(create_model("SiT-S/2", in_channels=1, **TINY))  # depth 1, width 32
    model.save_pretrained(tmp_path / "shrunk")
    weights = tmp_path / "shrunk" / "diffusion_pytorch_model.safetensors"
    # was: the sizes of SiT-S/2 (depth 12, width 384) and a shape mismatch; no flag for depth
    _, out = _grid(weights, tmp_path / "a", capsys)
    assert "SiT/2 (depth 1, hidden 32, heads 2) [pretrained]" in out


def test_a_folder_without_checkpoints_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert sample.main(["grid", "--ckpt", str(tmp_path / "empty"), *FAST]) == 2
    line = one_sample_error(capsys, "grid")
    assert f"--ckpt {tmp_path / 'empty'}: a folder without checkpoints" in line


# ----------------------------------------------------------------------------- the two contracts


def test_forward_returns_dits_2c_channels_and_the_readme_says_so():
    import torch

    from sit_vit5.models import SiT, create_model
    from tests.helpers import ROOT

    torch.manual_seed(0)
    model = create_model("SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8,
                         in_channels=4, num_classes=10).eval()  # learn_sigma=True: as official
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([1, 2])
    out = model(x, t, y)
    assert out.shape == (2, 8, 8, 8)  # DiT's contract: prediction, then the variance half
    # official SiT's forward is out[:, :C]: what the transport reads
    assert torch.equal(model(x, t, y)[:, :4], out.chunk(2, dim=1)[0])
    readme = " ".join((ROOT / "README.md").read_text().split())
    # was: "give the official outputs", nothing about the shape SiT's code expects
    assert "returns DiT's full output, 2C channels" in readme and "model(x, t, y)[:, :C]" in readme
    assert "model(x, t, y)[:, :C]" in " ".join(SiT.__doc__.split())


def test_the_first_log_line_names_the_size_overrides():
    from sit_vit5.config import load_config
    from sit_vit5.training.build import model_label

    demo = load_config("configs/demo.yaml", check_models=False)["model"]
    # was: "ViT5-S/2 (0.33M parameters)", while the README lists ViT5-S/2 at 32.96M
    assert model_label(demo) == "ViT5-S/2 with depth=4, hidden_size=64, num_heads=4"
    assert model_label({"name": "SiT-XL/2", "depth": 28}) == "SiT-XL/2"


def test_the_lock_is_released_while_forked_workers_live_on(tmp_path):
    import multiprocessing
    import time

    from sit_vit5.utils.run_files import hold_run_dir

    fork = multiprocessing.get_context("fork")
    with hold_run_dir(tmp_path / "D"):
        worker = fork.Process(target=time.sleep, args=(30,))  # a DataLoader worker's fork
        worker.start()
    try:
        with hold_run_dir(tmp_path / "D") as lock:  # the next train() call in this process
            assert lock is not None
    finally:
        worker.kill()
        worker.join()
