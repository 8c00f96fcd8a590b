"""Experiments: ImageNet configs smoke-train, protocols parse, the report tables and the ImageNet runner work
(the digits study's sweep: results/digits/tests/test_digits_study.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from sit_vit5.config import load_config
from sit_vit5.experiments import imagenet, report
from sit_vit5.experiments.__main__ import main as experiments_main
from sit_vit5.utils.checksums import sha256_file

REPO = Path(__file__).resolve().parents[1]
# the REPA files (*-repa.yaml, REPA's recipe in fp16, a torch.hub encoder): tests/test_repa.py
IMAGENET_CONFIGS = sorted(p for p in (REPO / "configs" / "imagenet").glob("*.yaml")
                          if not p.stem.endswith("-repa"))
PROTOCOLS = sorted((REPO / "configs" / "eval").glob("*.yaml"))
TINY_MODEL = ["model.depth=1", "model.hidden_size=32", "model.num_heads=2", "model.input_size=null",
              "model.in_channels=null", "model.num_classes=null"]


@pytest.fixture(scope="module")
def tiny_imagenet(tmp_path_factory, vae_dir) -> tuple[Path, Path]:
    """Two classes of 20x24 RGB images, and the tiny AutoencoderKL (factor 2, 4 latent channels)."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    for cls in ("n01440764", "n01443537"):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / "train" / cls / f"{i}.png")
    return root / "train", vae_dir


def test_imagenet_configs_differ_only_in_the_backbone():
    assert len([p for p in IMAGENET_CONFIGS if not p.stem.startswith("dit-")]) == 8  # the SiT / ViT5 pairs
    for size in ("s", "b", "l", "xl"):
        sit = load_config(REPO / "configs" / "imagenet" / f"sit-{size}-2.yaml")
        vit5 = load_config(REPO / "configs" / "imagenet" / f"vit5-{size}-2.yaml")
        assert sit["model"]["name"].startswith("SiT-") and vit5["model"]["name"].startswith("ViT5-")
        for section in sit:
            a, b = dict(sit[section]), dict(vit5[section])
            if section == "model":
                a.pop("name"), b.pop("name")
                a.pop("layer_scale_init", None), b.pop("layer_scale_init")
            if section == "train":
                a.pop("out_dir"), b.pop("out_dir")
            assert a == b, section
        assert sit["optim"]["lr"] == 1e-4 and sit["optim"]["ema_decay"] == 0.9999  # the SiT recipe (docs/DESIGN.md §5)
        assert sit["data"]["global_batch_size"] == 256 and sit["vae"]["scaling_factor"] == 0.18215


def test_published_configs_train_in_the_published_precision_and_pin_layer_scale():
    """SiT and DiT trained in fp32: the configs that claim a published number default to it (bf16 is an
    option); every ViT5 file spells out gamma0 instead of taking the code default."""
    from sit_vit5.models.vit5 import LAYER_SCALE_INITS

    assert len(IMAGENET_CONFIGS) == 12
    for path in IMAGENET_CONFIGS:
        raw = yaml.safe_load(path.read_text())
        assert raw["train"]["precision"] == "fp32", path.name
        if path.stem.startswith("vit5-"):
            assert raw["model"]["layer_scale_init"] == LAYER_SCALE_INITS["generative"], path.name
            assert "generative setting" in path.read_text(), path.name
        else:
            assert "layer_scale_init" not in raw["model"], path.name


def test_dit_configs_are_the_sit_recipe_with_dits_objective():
    assert len([p for p in IMAGENET_CONFIGS if p.stem.startswith("dit-")]) == 4
    for size in ("s", "b", "l", "xl"):
        sit = load_config(REPO / "configs" / "imagenet" / f"sit-{size}-2.yaml")
        dit = load_config(REPO / "configs" / "imagenet" / f"dit-{size}-2.yaml")
        assert dit["model"]["name"] == sit["model"]["name"].replace("SiT-", "DiT-")
        assert dit["transport"]["objective"] == "ddpm" and dit["model"]["learn_sigma"] is True
        assert (dit["sample"]["method"], dit["sample"]["num_steps"]) == ("ddpm", 250)
        for section in ("data", "vae", "optim"):  # DiT's recipe = SiT's (AdamW 1e-4, batch 256, EMA 0.9999)
            assert dit[section] == sit[section], section
        assert {k: v for k, v in dit["model"].items() if k != "name"} == \
            {k: v for k, v in sit["model"].items() if k != "name"}


@pytest.mark.slow
@pytest.mark.parametrize("config", IMAGENET_CONFIGS, ids=lambda p: p.stem)
def test_imagenet_config_two_step_smoke_run(config, tiny_imagenet, tmp_path):
    from sit_vit5.training import train

    images, vae = tiny_imagenet
    cfg = load_config(config, [*TINY_MODEL, f"data.root={images}", "data.image_size=16", f"vae.name={vae}",
                               "data.global_batch_size=4", "data.num_workers=0", "train.steps=2",
                               "train.precision=fp32", "train.sample_every=0", "train.log_every=1",
                               "train.ckpt_every=2", f"train.out_dir={tmp_path / 'run'}", "train.tensorboard=false"])
    result = train(cfg)
    assert result.step == 2 and result.checkpoint.is_file()
    assert len(result.losses) == 2 and all(np.isfinite(result.losses))
    resolved = result.config  # train() resolves a copy; the request stays as given
    assert resolved["model"]["input_size"] == 8 and resolved["model"]["in_channels"] == 4  # tiny-VAE latents


def test_the_protocols_the_next_test_checks_exist():
    """The parametrized test below is skipped, not failed, when the glob finds nothing."""
    assert {"headline", "headline_dit", "scaling"} <= {p.stem for p in PROTOCOLS}, PROTOCOLS


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.stem)
def test_eval_protocols_parse_into_sample_specs(protocol):
    p = imagenet.load_protocol(protocol)
    spec = imagenet.sample_spec(p["sample"])
    assert p["eval"]["num_samples"] == 50_000 and set(p["eval"]["metrics"]) == {"fid", "sfid", "is", "pr"}
    if protocol.stem == "headline":  # the published SiT protocol
        got = (spec.method, spec.sampling_method, spec.diffusion_form, spec.num_steps)
        assert got == ("sde", "Euler", "sigma", 250)
        assert (spec.cfg_scale, spec.cfg_channels) == (1.5, 3) and p["paper"] == {"SiT-XL/2": 2.06, "ViT5-XL/2": 1.84}
    if protocol.stem == "scaling":
        assert spec.cfg_scale == 1.0 and p["eval"]["steps"] == list(range(50_000, 400_001, 50_000))
    if protocol.stem == "headline_dit":  # the published DiT protocol: 250 DDPM steps, CFG 1.5 on 3 channels
        assert (spec.method, spec.num_steps, spec.cfg_scale, spec.cfg_channels) == ("ddpm", 250, 1.5, 3)
        assert p["paper"] == {"DiT-XL/2": 2.27}


def test_protocol_with_unknown_key_names_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sample: {method: sde, num_stepz: 3}\n")
    with pytest.raises(ValueError, match="sample.num_stepz"):
        imagenet.load_protocol(bad)
    bad.write_text("eval: {label_sampling: balanced}\n")
    with pytest.raises(ValueError, match="(?s)label_sampling.*balanced.*equal"):
        imagenet.load_protocol(bad)
    bad.write_text("eval: {label_sampling: equal}\n")
    assert imagenet.load_protocol(bad)["eval"]["label_sampling"] == "equal"


def test_report_table_and_csv(tmp_path):
    rows = [{"model": "SiT-XL/2", "FID": 2.0612, "step": 7_000_000}, {"model": "ViT5-XL/2", "FID": None}]
    table = report.markdown_table(rows, ["model", "step", "FID"])
    assert table.splitlines()[2] == "| SiT-XL/2 | 7000000 | 2.061 |" and "| ViT5-XL/2 | – | – |" in table
    piped = report.markdown_table([{"mean |γ|": "0.1 | 0.2"}], ["mean |γ|"]).splitlines()
    assert piped[0] == r"| mean \|γ\| |" and piped[2] == r"| 0.1 \| 0.2 |"  # escaped: still one column
    path = report.write_csv(rows, ["model", "FID"], tmp_path / "t.csv")
    assert path.read_text().splitlines() == ["model,FID", "SiT-XL/2,2.0612", "ViT5-XL/2,"]


@pytest.mark.slow
def test_imagenet_runner_end_to_end_with_random_inception(tmp_path):
    from fid.inception import sha256_of
    from sit_vit5.training import train
    from tests.test_fid_inception import _random_inception_state_dict

    cfg = load_config(REPO / "configs" / "digits" / "repro.yaml",
                      ["model.depth=1", "model.hidden_size=32", "model.num_heads=2", "train.steps=2",
                       "train.ckpt_every=1", "train.keep_last=5", "train.sample_every=0",
                       f"train.out_dir={tmp_path / 'run'}"])
    train(cfg)
    weights = tmp_path / "inception.pth"
    torch.save(_random_inception_state_dict(), weights)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "ref.npz", arr_0=rng.integers(0, 256, (12, 8, 8, 3), dtype=np.uint8))
    protocol = tmp_path / "tiny.yaml"
    protocol.write_text("sample: {method: ode, sampling_method: euler, num_steps: 3}\n"
                        f"eval: {{num_samples: 12, reference: {tmp_path / 'ref.npz'}, metrics: [fid, is],"
                        " steps: [1, 2], seed: 0}\npaper: {SiT-S/2: 57.6}\n")
    out = tmp_path / "out"
    argv = ["imagenet", str(tmp_path / "run"), "--protocol", str(protocol), "--out", str(out), "--device", "cpu",
            "--precision", "fp32", "--batch-size", "5", "--fid-batch-size", "6", "--inception-weights",
            str(weights), "--inception-sha256", sha256_of(weights)]
    assert experiments_main(argv) == 0
    rows = (out / "tiny.csv").read_text().splitlines()
    assert rows[0].startswith("model,params (M),GFLOPs,step,FID")
    assert [r.split(",")[3] for r in rows[1:]] == ["1", "2", ""] and rows[-1].startswith("SiT-S/2,,,,57.6")
    assert all(float(r.split(",")[4]) > 0 for r in rows[1:3])
    assert (out / "tiny_fid_vs_step.png").is_file()
    cached = sorted((tmp_path / "run" / "eval" / "tiny").glob("*.json"))
    assert len(cached) == 2 and "fid" in json.loads(cached[0].read_text())
    record = json.loads(cached[-1].read_text())["provenance"]  # how the samples were made, as fid's CLI
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1]
    assert record["checkpoint_sha256"] == sha256_file(ckpt) and record["label_sampling"] == "random"
    assert record["reference_sha256"] == sha256_file(tmp_path / "ref.npz")
    assert record["sampler"] == {"method": "ode", "solver": "euler", "num_steps": 3}
    assert record["nfe_per_image"] == 2 and sum(record["class_histogram"]) == 12


def test_a_saved_figure_is_written_and_released(tmp_path):
    plt = report.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = report.save_figure(fig, tmp_path / "sub" / "fig.png")
    assert Image.open(path).size[0] > 0
    assert fig.number not in plt.get_fignums()  # pyplot no longer holds it (a report makes dozens)
