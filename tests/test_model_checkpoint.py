"""Loading weights: bare state dicts and {model, ema, opt, args} files, safetensors, clear mismatch errors."""

from __future__ import annotations

import argparse

import pytest
import torch

from sit_vit5.models import CheckpointError, create_model, load_checkpoint
from sit_vit5.utils.checksums import sha256_file, sidecar
from tests.helpers import assert_names, naming
from tests.test_models import TINY, inputs, randomize


@pytest.fixture
def trained():
    return randomize(create_model("SiT-S/2", **TINY, learn_sigma=True))


def _same_function(a, b) -> bool:
    x, t, y = inputs()
    return torch.equal(a.eval()(x, t, y), b.eval()(x, t, y))


def test_bare_ema_state_dict_round_trip(tmp_path, trained):
    path = tmp_path / "SiT-XL-2-256.pt"
    torch.save(trained.state_dict(), path)
    fresh = load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=True))
    assert _same_function(fresh, trained)


def test_training_layout_with_namespace_args_loads_ema_by_default(tmp_path, trained):
    other = randomize(create_model("SiT-S/2", **TINY, learn_sigma=True), seed=7)
    ckpt = {
        "model": {f"module.{k}": v for k, v in other.state_dict().items()},  # DDP-wrapped keys
        "ema": trained.state_dict(),
        "opt": torch.optim.AdamW(other.parameters()).state_dict(),
        "args": argparse.Namespace(model="SiT-S/2", image_size=64),  # as the official train.py saves it
    }
    path = tmp_path / "0100000.pt"
    torch.save(ckpt, path)
    assert _same_function(load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=True)), trained)
    raw = load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=True), which="model")
    assert _same_function(raw, other)


def test_safetensors_and_sidecar_checksum(tmp_path, trained):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(path))
    sidecar(path).write_text(sha256_file(path) + "  w.safetensors\n")
    assert _same_function(load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=True)), trained)
    sidecar(path).write_text("0" * 64 + "\n")
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=True))


def test_learn_sigma_mismatch_is_explained(tmp_path, trained):
    path = tmp_path / "sigma.pt"
    torch.save(trained.state_dict(), path)
    with pytest.raises(CheckpointError, match="learn_sigma=True") as err:
        load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=False))
    assert "final_layer.linear.weight" in str(err.value) and str(path) in str(err.value)


def test_input_size_mismatch_is_explained(tmp_path, trained):
    path = tmp_path / "size.pt"
    torch.save(trained.state_dict(), path)
    with pytest.raises(CheckpointError, match="input_size=8"):
        load_checkpoint(path, create_model("SiT-S/2", **{**TINY, "input_size": 16}, learn_sigma=True))


def test_missing_and_unexpected_keys_are_listed(tmp_path, trained):
    path = tmp_path / "keys.pt"
    torch.save(trained.state_dict(), path)
    with pytest.raises(CheckpointError) as err:  # a SiT file into a ViT-5 model
        load_checkpoint(path, create_model("ViT5-S/2", **TINY, learn_sigma=True))
    lines = str(err.value).splitlines()  # each listed key on the line of its kind
    assert any("missing" in line and "register_tokens" in line for line in lines), lines
    assert any("unexpected" in line and "blocks.0.attn.qkv.bias" in line for line in lines), lines


def test_unreadable_and_pickled_code_are_refused(tmp_path):
    model = create_model("SiT-S/2", **TINY)
    with pytest.raises(CheckpointError, match=naming("nope.pt")):
        load_checkpoint(tmp_path / "nope.pt", model)
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"x": torch.zeros(1)}, "hook": print}, evil)  # a global that weights_only refuses
    with pytest.raises(CheckpointError, match="weights-only"):
        load_checkpoint(evil, model)


# ----------------------------------------------------------------------------- shape-mismatch hints


@pytest.mark.parametrize("change, expected", [
    (dict(hidden_size=128), ("hidden_size=128", "64")),
    (dict(depth=3), ("depth=3", "2")),
    (dict(learn_sigma=False), ("learn_sigma=False",)),
    (dict(input_size=16), ("input_size=16",)),
    (dict(in_channels=3), ("in_channels=3", "4")),
])
def test_shape_mismatch_hints_fire_only_when_true(tmp_path, change, expected):
    """A bare state dict (as the released SiT file) of another architecture: exactly the right hint.
    (A hidden-size mismatch used to be explained as learn_sigma: the missing bias defaulted to
    0 == 2 * 0.)"""
    path = tmp_path / "bare.pt"
    torch.save(create_model("SiT-S/2", **{**TINY, **change}).state_dict(), path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, create_model("SiT-S/2", **TINY))
    hints = [line.strip() for line in str(err.value).splitlines() if "hint:" in line]
    assert len(hints) == 1, hints
    assert_names(hints[0], *expected)


def test_a_folders_digest_is_its_sha256sum_listings_and_moves_with_any_file(tmp_path):
    import hashlib

    from sit_vit5.utils.checksums import checkpoint_sha256, sha256_tree

    folder = tmp_path / "dit"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    (folder / "transformer" / "w.bin").write_bytes(b"\x00\x01" * 100)
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {name}\n" for name, p in (
        ("model_index.json", folder / "model_index.json"),
        ("transformer/w.bin", folder / "transformer" / "w.bin")))
    digest = sha256_tree(folder)
    assert digest == hashlib.sha256(listing.encode()).hexdigest() == checkpoint_sha256(folder)
    (folder / "transformer" / "w.bin").write_bytes(b"\x00\x02" * 100)
    changed = sha256_tree(folder)
    (folder / "transformer" / "w.bin").rename(folder / "transformer" / "v.bin")
    renamed = sha256_tree(folder)
    (folder / "extra.txt").write_text("x")
    assert len({digest, changed, renamed, sha256_tree(folder)}) == 4


def test_a_files_digest_is_its_checked_sidecars_else_its_own(tmp_path):
    from sit_vit5.utils.checksums import checkpoint_sha256

    path = tmp_path / "w.pt"
    path.write_bytes(b"weights")
    assert checkpoint_sha256(path) == sha256_file(path)
    sidecar(path).write_text("AB" * 32 + "  w.pt\n")  # loading refuses a file that does not match it
    assert checkpoint_sha256(path) == "ab" * 32
