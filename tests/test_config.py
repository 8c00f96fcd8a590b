"""Config: defaults ← YAML ← dotted overrides; unknown keys and wrong types are errors that name the key."""

import copy
import re

import pytest
import yaml

from sit_vit5.config import DEFAULTS, ConfigError, flatten, load_config, parse_overrides, save_config
from tests.helpers import assert_names, naming, run_train


def write_yaml(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_are_the_sit_recipe():
    cfg = load_config()
    assert cfg == DEFAULTS and cfg is not DEFAULTS
    o = cfg["optim"]
    assert (o["lr"], o["betas"], o["weight_decay"], o["ema_decay"]) == (1e-4, [0.9, 0.999], 0.0, 0.9999)
    assert cfg["data"]["global_batch_size"] == 256 and cfg["optim"]["warmup_steps"] == 0


def test_yaml_then_overrides_take_precedence(tmp_path):
    path = write_yaml(tmp_path, {"train": {"steps": 10, "seed": 3}, "model": {"name": "SiT-S/2", "depth": 2}})
    cfg = load_config(path, ["train.steps=20", "optim.betas=[0.9,0.95]", "optim.grad_clip=null",
                             "vae.name=none", "model.hidden_size=64"])
    assert cfg["train"]["steps"] == 20 and cfg["train"]["seed"] == 3  # override > file > default
    assert cfg["optim"]["betas"] == [0.9, 0.95] and cfg["optim"]["grad_clip"] is None
    assert cfg["model"] == {**DEFAULTS["model"], "name": "SiT-S/2", "depth": 2, "hidden_size": 64}
    assert cfg["vae"]["name"] == "none"
    # everything else untouched, and the defaults themselves were not mutated
    changed = {k for k, v in flatten(cfg).items() if flatten(DEFAULTS).get(k, object()) != v}
    assert changed == {"train.steps", "train.seed", "optim.betas", "model.name", "model.depth",
                       "model.hidden_size", "vae.name"}  # grad_clip=null equals its default
    assert DEFAULTS["train"]["steps"] == 400_000


@pytest.mark.parametrize(
    "source, needle",
    [
        ({"train": {"stpes": 1}}, "'train.stpes'"),
        ({"trian": {"steps": 1}}, "'trian'"),
        ({"model": {"dept": 2}}, "model.dept"),
    ],
)
def test_unknown_keys_in_file_are_named(tmp_path, source, needle):
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path, source))
    assert needle in str(err.value)


def test_unknown_key_error_lists_the_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optim.learning_rate=1e-3"])
    message = str(err.value)
    assert "optim.learning_rate" in message and "command line" in message
    for key in DEFAULTS["optim"]:
        assert key in message
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.dept=2"])
    assert "depth" in str(err.value) and "hidden_size" in str(err.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.steps=abc", "train.steps"),
        ("train.compile=1", "train.compile"),  # an int is not a bool
        ("train.precision=fp8", "bf16"),
        ("sample.method=ddim", "sample.method"),
        ("train.grad_accum=0", "train.grad_accum"),
        ("model.name=SiT-XXL/2", "SiT-XL/2"),
        ("trainsteps=3", "section.key=value"),
        ("train.steps", "section.key=value"),
    ],
)
def test_bad_values_are_named(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_float_keys_accept_ints_and_yaml_parsing():
    cfg = load_config(None, ["optim.lr=1", "train.steps=1_000", "sample.classes=[1, 2]"])
    assert cfg["optim"]["lr"] == 1 and cfg["train"]["steps"] == 1000 and cfg["sample"]["classes"] == [1, 2]
    assert parse_overrides(["a.b=x=y"]) == {"a": {"b": "x=y"}}  # split at the first '='


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.depth=3", "optim.grad_clip=1.5", "sample.classes=[3, 1]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert copy.deepcopy(cfg) == cfg


def test_demo_config_is_valid():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    assert cfg["data"]["kind"] == "digits" and cfg["vae"]["name"] == "none"
    assert cfg["model"]["name"].startswith("ViT5")


def test_exponent_floats_without_a_dot(tmp_path):
    """PyYAML reads `1e-4` as a string (YAML 1.1); configs must not silently get lr='1e-4'."""
    path = tmp_path / "e.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  grad_clip: 1e0\n")
    cfg = load_config(path, ["optim.eps=1e-6"])
    assert cfg["optim"]["lr"] == 3e-4 and cfg["optim"]["grad_clip"] == 1.0 and cfg["optim"]["eps"] == 1e-6


# ----------------------------------------------------------------------------- config == build
# validate_architecture asks the models' own rules: a config it accepts builds and runs, one the
# build refuses it refuses too (it used to check register RoPE only with model.rope=true).

TINY_SIT = ["model.name=SiT-S/2", "model.depth=1", "model.input_size=8", "model.in_channels=4",
            "model.num_classes=10"]


def _builds_and_runs(section) -> bool:
    import torch

    from sit_vit5.models import model_from_config

    try:
        model = model_from_config(section)
        model(torch.zeros(1, 4, 8, 8), torch.zeros(1), torch.zeros(1, dtype=torch.long))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("overrides, named", [
    # rope=false: the registers still rotate, on a 2-D grid
    (["model.num_registers=3", "model.register_rope_theta=100.0"], "model.num_registers=3"),
    (["model.rope=true", "model.num_registers=3", "model.register_rope_theta=100.0"],
     "model.num_registers=3"),
    # rope=false: register RoPE needs head_dim % 4 == 0 too
    (["model.hidden_size=100", "model.num_heads=4", "model.num_registers=4",
      "model.register_rope_theta=100.0"], naming("model.hidden_size=100", "25",
                                                   "model.register_rope_theta=null")),
    (["model.hidden_size=100", "model.num_heads=4", "model.rope=true"], naming("model.hidden_size=100", "25")),
])
def test_architecture_the_build_refuses_is_refused_by_the_config(overrides, named):
    from sit_vit5.config import validate_architecture

    cfg = load_config(None, [*TINY_SIT, *overrides])
    assert not _builds_and_runs(cfg["model"])
    with pytest.raises(ConfigError, match=named):
        validate_architecture(cfg["model"])


@pytest.mark.parametrize("overrides", [
    ["model.num_registers=3"],  # no register RoPE: any count
    ["model.num_registers=4", "model.register_rope_theta=100.0"],
    ["model.hidden_size=100", "model.num_heads=4", "model.num_registers=4"],  # nothing rotates
    ["model.name=ViT5-S/2", "model.num_registers=3", "model.register_rope_theta=null"],
    ["model.layer_scale_init=generative"],  # a named LayerScale init builds any backbone
    ["model.layer_scale_init=classification", "model.name=ViT5-S/2"],
])
def test_architecture_the_config_accepts_builds_and_runs(overrides):
    from sit_vit5.config import validate_architecture

    cfg = load_config(None, [*TINY_SIT, *overrides])
    validate_architecture(cfg["model"])
    assert _builds_and_runs(cfg["model"])


def test_named_layer_scale_inits_come_from_the_models():
    from sit_vit5.models.layers import LAYER_SCALE_INITS

    for name in LAYER_SCALE_INITS:
        cfg = load_config(None, [f"model.layer_scale_init={name}"])
        assert cfg["model"]["layer_scale_init"] == name  # kept as written; the model resolves it
    with pytest.raises(ConfigError, match="model.layer_scale_init='lamb'.*classification"):
        load_config(None, ["model.layer_scale_init=lamb"])


# ------------------------------------------------------------------------ refusals through train.py


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
    ("model.hidden_size=66", ("model.hidden_size=66", "model.num_heads=4")),
    # divisible, but 2-D RoPE needs head_dim % 4 == 0
    ("model.hidden_size=100", ("model.hidden_size=100", "model.num_heads=4", "25", "model.rope=false")),
])
def test_bad_config_values_are_one_line_errors(tmp_path, capsys, override, named):
    argv = [f"train.out_dir={tmp_path / 'run'}", "train.steps=2", override]
    status, line = run_train(argv, capsys)
    assert status == 2
    assert_names(line, *(named if isinstance(named, tuple) else (named,)))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_valid_edges_are_accepted():
    from sit_vit5.config import validate_architecture

    cfg = load_config(None, ["optim.ema_decay=0", "optim.betas=[0,0.999]", "sample.num_steps=2",
                             "train.sample_every=0", "optim.grad_clip=null",
                             "model.layer_scale_init=null"])
    validate_architecture(cfg["model"])
    assert cfg["optim"]["ema_decay"] == 0 and cfg["sample"]["num_steps"] == 2


@pytest.mark.parametrize("overrides, named", [
    (["optim.betas=null"], "optim.betas=None"),  # was a TypeError from len(None)
    (["sample.time_shift=abc"], "sample.time_shift='abc'"),  # TypeError from math.isfinite
    (["sample.cfg_channels=abc"], "sample.cfg_channels='abc'"),  # TypeError from '<'
    (["sample.cfg_interval=abc"], "sample.cfg_interval='abc'"),  # ValueError from float('a')
    (["sample.cfg_interval=[0.1]"], "sample.cfg_interval=[0.1]"),  # ValueError from unpacking
    # accepted before, then crashed the run's first sample grid, after the training
    (["sample.method=sde", "sample.sampling_method=Euler", "sample.diffusion_form=bogus"],
     "sample.diffusion_form='bogus'"),
    (["sample.method=sde", "sample.sampling_method=Euler", "sample.last_step=bogus"],
     "sample.last_step='bogus'"),
])
def test_sampler_and_optimizer_values_of_any_type_are_config_errors(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, overrides, check_models=False)


@pytest.mark.parametrize("overrides", [
    ["sample.cfg_interval=[0.2, 0.9]"], ["sample.last_step=None"], ["sample.time_shift=null"],
    ["sample.method=sde", "sample.sampling_method=Euler", "sample.diffusion_form=SBDM"],
])
def test_valid_sampler_values_still_load(overrides):
    load_config(None, overrides, check_models=False)
