"""Hub-native models (save_pretrained / from_pretrained) and official weights by name, offline."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch
from safetensors.torch import load_file

from sit_vit5.models import SiT, ViT5, create_model, load_checkpoint
from sit_vit5.models.checkpoint_files import CheckpointError
from sit_vit5.models.official import (
    OFFICIAL_WEIGHTS,
    SIT_REPO,
    WeightsUnavailableError,
    official_weights,
    resolve_checkpoint,
)
from tests.helpers import naming
from tests.hub_cache import add_folder_to_hub_cache, add_to_hub_cache
from tests.test_models import TINY, inputs, randomize

# DiT/SiT parameter names an official checkpoint carries (docs/DESIGN.md §3)
DIT_KEYS = {"x_embedder.proj.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight",
            "y_embedder.embedding_table.weight", "pos_embed", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.bias",
            "blocks.0.adaLN_modulation.1.weight", "final_layer.linear.weight", "final_layer.adaLN_modulation.1.bias"}


def _same_outputs(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    x, t, y = inputs()
    with torch.no_grad():
        return torch.equal(a.eval()(x, t, y), b.eval()(x, t, y))


@pytest.mark.parametrize(("name", "cls", "switches"), [
    ("SiT-S/2", SiT, {}),
    ("ViT5-S/2", ViT5, {}),
    ("ViT5-S/2", ViT5, dict(layer_scale_init=None, num_registers=0, qk_norm=False, mlp="swiglu")),
])
def test_save_pretrained_from_pretrained_round_trip_is_exact(tmp_path, name, cls, switches):
    model = randomize(create_model(name, **TINY, learn_sigma=True, **switches))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    loaded = cls.from_pretrained(tmp_path)
    assert type(loaded) is cls and not loaded.training
    assert loaded.switches == model.switches  # the ablation switches survive, not the class defaults
    assert _same_outputs(loaded, model)
    if model.switches["pos_embed"] == "fixed":
        assert not loaded.pos_embed.requires_grad  # SiT's frozen table stays frozen


def test_config_json_records_the_resolved_architecture(tmp_path):
    model = create_model("ViT5-S/2", **TINY, layer_scale_init=None)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["_class_name"] == "ViT5"
    assert config["depth"] == 2 and config["hidden_size"] == 64 and config["num_classes"] == 10
    assert config["layer_scale_init"] is None and config["num_registers"] == 4  # override + ViT-5 default
    assert "grad_checkpointing" not in config  # a runtime choice, not architecture


def test_safetensors_keeps_dit_key_names_and_official_files_still_load_strictly(tmp_path):
    model = randomize(create_model("SiT-S/2", **TINY, learn_sigma=True))
    model.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "diffusion_pytorch_model.safetensors"))
    assert keys == set(model.state_dict()) and DIT_KEYS <= keys
    bare = tmp_path / "SiT-XL-2-256.pt"  # the released layout: a bare EMA state dict
    torch.save(model.state_dict(), bare)
    assert _same_outputs(load_checkpoint(bare, create_model("SiT-S/2", **TINY, learn_sigma=True)), model)


def test_from_pretrained_by_repo_id_through_the_hub_cache(tmp_path, monkeypatch):
    model = randomize(create_model("ViT5-S/2", **TINY))
    model.save_pretrained(tmp_path / "export")
    add_folder_to_hub_cache(tmp_path / "cache", "someone/tiny-vit5", tmp_path / "export")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = ViT5.from_pretrained("someone/tiny-vit5", cache_dir=tmp_path / "cache", local_files_only=True)
    assert _same_outputs(loaded, model)


def test_from_pretrained_refuses_a_folder_written_for_another_class(tmp_path):
    """A diffusers DiT folder used to give a randomly initialised SiT with warnings only."""
    from diffusers import DiTTransformer2DModel

    DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, num_layers=1,
                          sample_size=8).save_pretrained(tmp_path / "dit")
    create_model("SiT-S/2", **TINY).save_pretrained(tmp_path / "sit")
    create_model("ViT5-S/2", **TINY).save_pretrained(tmp_path / "vit5")
    dit = "DiTTransformer2DModel"
    for cls, folder, found in ((SiT, "dit", dit), (ViT5, "dit", dit), (SiT, "vit5", "ViT5"),
                               (ViT5, "sit", "SiT")):
        with pytest.raises(CheckpointError) as err:
            cls.from_pretrained(tmp_path / folder)
        message = str(err.value)
        assert "\n" not in message and f"class {found!r}, expected {cls.__name__!r}" in message
    with pytest.raises(CheckpointError, match="load_model"):  # where a DiT folder does load
        SiT.from_pretrained(tmp_path / "dit")


def _damaged(tmp_path, change_weights=None, change_config=None):
    from safetensors.torch import save_file

    folder = tmp_path / "damaged"
    randomize(create_model("SiT-S/2", **TINY)).save_pretrained(folder)
    if change_weights:
        weights = load_file(folder / "diffusion_pytorch_model.safetensors")
        change_weights(weights)
        save_file(weights, folder / "diffusion_pytorch_model.safetensors")
    if change_config:
        config = json.loads((folder / "config.json").read_text())
        change_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("weights", "config", "message"), [
    (lambda w: w.pop("blocks.1.attn.qkv.weight"), None, r"missing keys \['blocks.1.attn.qkv.w"),
    (lambda w: w.update(extra=torch.zeros(2)), None, r"unexpected keys \['extra'\]"),
    (lambda w: w.update({"blocks.0.attn.qkv.bias": torch.zeros(5)}), None, naming("blocks.0.attn.qkv.bias", "[5]")),
    (None, lambda c: c.update(qk_norm_eps=1e-6), r"key\(s\) \['qk_norm_eps'\]"),
])
def test_from_pretrained_refuses_weights_or_keys_that_do_not_fit(tmp_path, weights, config,
                                                                 message):
    folder = _damaged(tmp_path, weights, config)
    with pytest.raises(CheckpointError, match=message) as err:
        SiT.from_pretrained(folder)
    assert "\n" not in str(err.value)  # one line


# ----------------------------------------------------------------------------- official weights by
# name


def _tiny_official_bytes() -> tuple[bytes, torch.nn.Module]:
    model = randomize(create_model("SiT-S/2", **TINY, learn_sigma=True))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue(), model


def test_official_name_resolves_from_the_hub_cache_and_loads(tmp_path):
    content, model = _tiny_official_bytes()  # stands in for the 2.7 GB file: same layout, tiny shapes
    add_to_hub_cache(tmp_path, SIT_REPO, "SiT-XL-2-256.pt", content)
    lines = []
    path, entry = resolve_checkpoint("SiT-XL-2-256.pt", cache_dir=tmp_path, offline=True, log=lines.append)
    assert entry is OFFICIAL_WEIGHTS["SiT-XL-2-256.pt"] and entry.model == "SiT-XL/2"
    assert path.read_bytes() == content
    assert len(lines) == 1 and SIT_REPO in lines[0] and "licence" in lines[0] and "LFS record" in lines[0]
    assert _same_outputs(load_checkpoint(path, create_model("SiT-S/2", **TINY, learn_sigma=True)), model)
    alias, _ = resolve_checkpoint("SiT-XL-2-256x256.pt", cache_dir=tmp_path, offline=True, log=lines.append)
    assert alias == path  # SiT's old download.py name


def test_tampered_cached_file_is_refused_before_loading(tmp_path):
    content, _ = _tiny_official_bytes()
    link = add_to_hub_cache(tmp_path, SIT_REPO, "SiT-XL-2-256.pt", content)
    blob = link.resolve()
    blob.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))  # one flipped bit
    with pytest.raises(CheckpointError, match=naming("SiT-XL-2-256.pt", "SHA-256")):
        resolve_checkpoint("SiT-XL-2-256.pt", cache_dir=tmp_path, offline=True, log=print)


def test_pinned_sha256_is_checked(tmp_path, monkeypatch):
    content, _ = _tiny_official_bytes()
    add_to_hub_cache(tmp_path, SIT_REPO, "SiT-B-2-256.pt", content)
    entry = OFFICIAL_WEIGHTS["SiT-B-2-256.pt"]
    good = hashlib.sha256(content).hexdigest()
    monkeypatch.setitem(OFFICIAL_WEIGHTS, "SiT-B-2-256.pt", type(entry)(**{**vars(entry), "sha256": good}))
    lines = []
    resolve_checkpoint("SiT-B-2-256.pt", cache_dir=tmp_path, offline=True, log=lines.append)
    assert "pinned digest" in lines[0]
    monkeypatch.setitem(OFFICIAL_WEIGHTS, "SiT-B-2-256.pt", type(entry)(**{**vars(entry), "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=naming("SiT-B-2-256.pt", "0" * 64)):
        resolve_checkpoint("SiT-B-2-256.pt", cache_dir=tmp_path, offline=True, log=lines.append)


def test_offline_without_cache_is_one_line_naming_repo_file_and_command(tmp_path):
    with pytest.raises(WeightsUnavailableError) as err:
        resolve_checkpoint("SiT-XL-2-256.pt", cache_dir=tmp_path, offline=True)
    message = str(err.value)
    assert "\n" not in message
    assert SIT_REPO in message and "SiT-XL-2-256.pt" in message
    assert f"hf download {SIT_REPO} SiT-XL-2-256.pt" in message


def test_dit_files_come_from_dits_host_offline_error_and_sidecar_check(tmp_path):
    with pytest.raises(WeightsUnavailableError, match=r"wget -P .* https://dl\.fbaipublicfiles\.com/DiT/"):
        resolve_checkpoint("DiT-XL-2-256x256.pt", cache_dir=tmp_path, offline=True)
    assert official_weights("DiT-XL-2-256x256.pt").objective == "ddpm"  # never read as a SiT velocity model
    content, _ = _tiny_official_bytes()
    (tmp_path / "DiT-XL-2-256x256.pt").write_bytes(content)
    (tmp_path / "DiT-XL-2-256x256.pt.sha256").write_text(hashlib.sha256(b"other").hexdigest() + "\n")
    with pytest.raises(CheckpointError, match="corrupt or was altered"):
        resolve_checkpoint("DiT-XL-2-256x256.pt", cache_dir=tmp_path, offline=True, log=print)


def test_local_paths_win_and_unknown_names_list_the_official_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SiT-XL-2-256.pt").write_bytes(b"local")
    path, entry = resolve_checkpoint("SiT-XL-2-256.pt", offline=True)
    assert entry is None and path.read_bytes() == b"local"
    with pytest.raises(CheckpointError, match="SiT-XL-2-256.pt"):
        resolve_checkpoint("no-such.pt", offline=True)
