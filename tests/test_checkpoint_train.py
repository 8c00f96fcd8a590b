"""Training checkpoints: weights_only round trip, SHA-256 sidecar, atomic writes, rotation, RNG, compatibility."""

import errno
import json
import random

import numpy as np
import pytest
import torch

from sit_vit5.config import load_config
from sit_vit5.training import checkpoint as ck
from sit_vit5.utils import atomic_files, checksums
from tests.helpers import TRAIN_ARGV, assert_states_equal, load_train_cli, naming, run_train


def make_state(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "ema": model.state_dict(), "opt": opt.state_dict(),
            "args": load_config(), "step": step, "epoch": 0, "batch_in_epoch": step, "rng": ck.rng_state(),
            "versions": ck.package_versions(), "model_name": "SiT-XL/2"}


def test_round_trip_with_weights_only(tmp_path):
    state = make_state(5)
    path = ck.save_checkpoint(state, tmp_path, 5)
    assert path.name == "0000005.pt"
    assert_states_equal(ck.read_checkpoint(path), state)
    assert_states_equal(torch.load(path, weights_only=True), state)  # plain torch.load works too
    digest, name = (tmp_path / "0000005.pt.sha256").read_text().split()
    assert name == "0000005.pt" and digest == ck.sha256_file(path)  # `sha256sum -c` format
    assert json.loads((tmp_path / ck.LATEST).read_text()) == {"file": "0000005.pt", "step": 5}


def test_corrupt_file_is_refused(tmp_path):
    path = ck.save_checkpoint(make_state(1), tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="corrupt"):
        ck.read_checkpoint(path)


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    good = make_state(1)
    ck.save_checkpoint(good, tmp_path, 1)

    def crash_mid_write(obj, f):
        f.write(b"PK\x03\x04" + b"\0" * 1000)  # the first bytes of a zip, then the disk "fills up"
        raise OSError("No space left on device")

    monkeypatch.setattr(ck.torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="No space"):
        ck.save_checkpoint(make_state(2), tmp_path, 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000001.pt", "0000001.pt.sha256", "latest.json"]
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "0000001.pt"
    assert_states_equal(ck.read_checkpoint(ck.resolve_resume("latest", tmp_path)), good)


def test_killed_writer_leftovers_are_never_latest(tmp_path):
    """A SIGKILL can leave a temporary file, or a renamed file whose sidecar was not written yet."""
    ck.save_checkpoint(make_state(1), tmp_path, 1)
    (tmp_path / ".tmp-999-0000002.pt").write_bytes(b"PK\x03\x04 half")
    (tmp_path / "0000003.pt").write_bytes(b"PK\x03\x04 renamed but no sidecar")
    assert ck.latest_checkpoint(tmp_path).name == "0000001.pt"
    (tmp_path / ck.LATEST).unlink()  # even without the pointer, only complete files count
    assert ck.latest_checkpoint(tmp_path).name == "0000001.pt"
    (tmp_path / ck.LATEST).write_text("{ truncated")
    assert ck.latest_checkpoint(tmp_path).name == "0000001.pt"
    ck.save_checkpoint(make_state(4), tmp_path, 4)  # the next save clears the stale temporary file
    assert not list(tmp_path.glob(".tmp-*"))


def test_keep_last_and_milestones(tmp_path):
    state = make_state(0)
    for step in range(1, 7):
        ck.save_checkpoint(state, tmp_path, step, milestone=step % 2 == 0, keep_last=2)
    names = sorted(p.name for p in tmp_path.glob("*.pt"))
    # regular 1, 3, 5: newest 2 checkpoints overall kept (5 and milestone 6), milestones never deleted
    assert names == ["0000002-milestone.pt", "0000004-milestone.pt", "0000005.pt", "0000006-milestone.pt"]
    assert ck.latest_checkpoint(tmp_path).name == "0000006-milestone.pt"
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == sorted(n + ".sha256" for n in names)
    ck.save_checkpoint(state, tmp_path, 7, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("0*[0-9].pt")) == ["0000005.pt", "0000007.pt"]


def test_a_stops_checkpoint_off_the_schedule_costs_no_scheduled_one(tmp_path):
    """Pre-empted at step 7 of a run that saves every 5 and keeps 3: the stop's checkpoint is kept
    until a newer one exists, then deleted without pushing a scheduled one out (it did before:
    resuming lost step 5, which the digits study evaluates)."""
    state = make_state(0)
    for step in (5, 7):
        ck.save_checkpoint(state, tmp_path, step, keep_last=3, every=5)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["0000005.pt", "0000007.pt"]
    for step in (10, 15):
        ck.save_checkpoint(state, tmp_path, step, keep_last=3, every=5)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["0000005.pt", "0000010.pt",
                                                             "0000015.pt"]
    ck.save_checkpoint(state, tmp_path, 17, keep_last=3, every=5)  # a final step off the schedule
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["0000010.pt", "0000015.pt",
                                                             "0000017.pt"]
    assert ck.latest_checkpoint(tmp_path).name == "0000017.pt"
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == [
        "0000010.pt.sha256", "0000015.pt.sha256", "0000017.pt.sha256"]


def test_rng_state_round_trip():
    state = ck.rng_state()
    first = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])  # noqa: NPY002
    ck.set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])  # noqa: NPY002
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_resume_restores_the_global_rng_states_it_saved(tmp_path):
    """The loop reseeds torch from the step every step, so a lost restore would pass every other resume
    test: build() itself must leave python, NumPy and torch where the checkpoint left them."""
    from sit_vit5.training import read_checkpoint, train
    from sit_vit5.training.build import build

    argv = [*TRAIN_ARGV, f"train.out_dir={tmp_path / 'run'}", "train.ckpt_every=2"]
    result = train(load_config(None, [*argv, "train.steps=2"]))
    saved = read_checkpoint(result.checkpoint)["rng"]
    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # noqa: NPY002
    run = build(load_config(None, [*argv, "train.steps=4"]), "latest")
    try:
        assert_states_equal(ck.rng_state(), saved)
    finally:
        run.logger.close()


def test_resume_spec_resolution(tmp_path):
    with pytest.raises(ck.CheckpointError, match=naming("--resume latest", tmp_path)):
        ck.resolve_resume("latest", tmp_path)
    with pytest.raises(ck.CheckpointError, match="neither"):
        ck.resolve_resume(str(tmp_path / "missing.pt"), tmp_path)
    path = ck.save_checkpoint(make_state(3), tmp_path / ck.CKPT_DIR, 3)
    assert ck.resolve_resume("latest", tmp_path) == path  # run dir → its checkpoints/
    assert ck.resolve_resume(str(tmp_path), "elsewhere") == path
    assert ck.resolve_resume(str(path), "elsewhere") == path


def test_compatibility_names_the_differing_keys():
    saved = load_config(None, ["model.depth=4"])
    checkpoint = {"args": saved}
    ck.check_compatible(checkpoint, load_config(None, ["model.depth=4", "train.steps=9", "optim.lr=3e-4",
                                                       "model.grad_checkpointing=true"]), "x.pt")
    with pytest.raises(ck.IncompatibleCheckpointError) as err:
        ck.check_compatible(checkpoint, load_config(None, ["model.depth=6", "model.name=ViT5-XL/2",
                                                           "transport.path_type=GVP"]), "x.pt")
    message = str(err.value)
    assert "model.depth: 4 (checkpoint) != 6" in message and "model.name" in message
    assert "transport.path_type" in message and "train.steps" not in message
    with pytest.raises(ck.IncompatibleCheckpointError, match=naming("bare.pt", "'args'")):
        ck.check_compatible({"model": {}}, saved, "bare.pt")


# ----------------------------------------------------------------------------- damage


def small_state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    return {"model": model.state_dict(), "ema": model.state_dict(), "opt": {},
            "args": {"train": {"seed": 0}}, "step": step, "epoch": 0, "batch_in_epoch": step,
            "rng": ck.rng_state(), "versions": {}, "model_name": "x"}


def test_payload_digest_is_independent_of_the_pickle(tmp_path):
    state = small_state(1)
    digest = checksums.payload_sha256(state)
    torch.save(state, tmp_path / "a.pt")
    assert checksums.payload_sha256(torch.load(tmp_path / "a.pt", weights_only=True)) == digest
    state["model"]["weight"][0, 0] += 1e-7  # any change of a value changes the digest
    assert checksums.payload_sha256(state) != digest


def test_byte_flips_without_sidecar_are_never_silent(tmp_path):
    """A .pt copied on its own (no .sha256) with one flipped bit: refused, or (padding, zip metadata
    that the reader ignores) loaded with exactly the saved content. Never loaded with different
    content."""
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
        same = checksums.payload_sha256(loaded) == checksums.payload_sha256(state)
        assert same, f"silent change at byte {offset}"
        assert loaded.keys() == state.keys()
    # most bytes are tensor data or pickle: those flips must be refused
    assert refused > len(offsets) // 2


def test_flipped_tensor_byte_is_refused_by_resume(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TRAIN_ARGV, f"train.out_dir={run}", "train.steps=2", "train.ckpt_every=2"]
    assert load_train_cli().main(argv) == 0
    path = run / "checkpoints" / "0000002.pt"
    ck.sidecar(path).unlink()
    state = torch.load(path, weights_only=True)
    # a value changed, the pickle re-written around it
    state["ema"]["blocks.0.attn.qkv.weight"][0, 0] *= -1
    torch.save(state, path)
    capsys.readouterr()
    argv = [*TRAIN_ARGV, f"train.out_dir={run}", "train.steps=4", "--resume", "latest"]
    status, line = run_train(argv, capsys)
    assert status == 2 and str(path) in line and "corrupt" in line


def test_disk_full_during_a_checkpoint(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing the second checkpoint: one line naming both files; the first stays
    latest."""
    run = tmp_path / "run"
    writes = {"n": 0}
    real_write = atomic_files._HashingWriter.write

    def failing_write(self, data):
        if self.file.name.endswith("0000004.pt"):
            writes["n"] += 1
            if writes["n"] > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(atomic_files._HashingWriter, "write", failing_write)
    argv = [*TRAIN_ARGV, f"train.out_dir={run}", "train.steps=6", "train.ckpt_every=2"]
    status, line = run_train(argv, capsys)
    ckpts = run / "checkpoints"
    assert status == 2
    assert line == (f"error: no space left on device writing {ckpts / '0000004.pt'}; the previous "
                    f"checkpoint {ckpts / '0000002.pt'} is intact")
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["0000002.pt", "0000002.pt.sha256", "latest.json"]
    assert json.loads((ckpts / "latest.json").read_text())["file"] == "0000002.pt"
    ck.read_checkpoint(ckpts / "0000002.pt")  # still verifies


def test_orphan_sidecar_is_swept(tmp_path):
    """A kill between deleting a rotated checkpoint and its sidecar leaves a .sha256 alone: the next
    save removes it."""
    ck.save_checkpoint(small_state(1), tmp_path, 1)
    (tmp_path / "0000001.pt").unlink()
    ck.save_checkpoint(small_state(2), tmp_path, 2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["0000002.pt", "0000002.pt.sha256", "latest.json"]
