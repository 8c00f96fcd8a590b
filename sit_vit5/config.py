"""Experiment configs: the defaults, deep-merged with a YAML file, then with dotted CLI overrides.

    cfg = load_config("configs/demo.yaml", ["train.steps=100", "model.name=SiT-S/2"])

Sections are closed (an unknown key is an error naming it and the valid keys) except ``model``,
whose extra keys are ``create_model`` overrides. Values are safe YAML, ``1e-4`` read as a float.
Defaults: the SiT/DiT ImageNet-256 recipe (docs/DESIGN.md §5).
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from .latent_norm import LatentNorm
from .names import (
    DDPM_DEFAULTS,
    INTERPOLATIONS,
    MAX_SEED,
    MEANFLOW_DEFAULTS,
    MEANFLOW_TANGENTS,
    MODEL_KEYS,
    MODEL_NAMES,
    PRECISIONS,
    SD_VAE_SCALING_FACTOR,
)
from .sample_spec import SampleSpec, check_cfg_scale, config_defaults
from .utils.atomic_files import unwritable_dir_reason
from .utils.errors import ConfigError, SettingError

# The model and objective checks import torch (seconds): they run last, so that a bad key, type,
# range or path is reported before torch loads.


class Range(NamedTuple):
    """Valid values of a numeric key: ``low``/``high`` bounds (None = unbounded), inclusive unless
    ``*_open``; ``integer`` for counts; ``nullable`` when None ("off" or "derived") is allowed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    nullable: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        fmt = "d" if self.integer else "g"  # integer bounds in full (2**64 - 1, not 1.84467e+19)
        lo = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:{fmt}}"
        hi = "" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:{fmt}}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        return f"{kind}{' ' + bounds if bounds else ''}{' (or null)' if self.nullable else ''}"

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


_COUNT, _COUNT0 = Range(1, integer=True), Range(0, integer=True)
_POSITIVE = Range(0, low_open=True)
#: seeds: what torch.manual_seed takes (it overflows beyond 64 bits)
SEED_RANGE = Range(0, MAX_SEED, integer=True)


class Key(NamedTuple):
    """A numeric config key: its default and its valid :class:`Range` (outside it a run trains
    garbage or crashes later)."""

    default: Any
    valid: Range


Config = dict[str, dict[str, Any]]
_MF = MEANFLOW_DEFAULTS  # MeanFlow's official ImageNet setting (names.py)

#: Every key of every section with its default; numeric keys as a :class:`Key` with their range.
SCHEMA: dict[str, dict[str, Any]] = {
    "model": {
        "name": "SiT-XL/2",  # registry: {SiT,ViT5,DiT}-{S,B,L,XL}/{2,4,8} (DiT-*: SiT + ddpm)
        "input_size": None,  # latent (or pixel) side; None = taken from the data
        "in_channels": None,  # None = taken from the data (4 for SD-VAE latents)
        "num_classes": None,  # None = the dataset's class count (the model adds the CFG null class)
        # any other create_model override may be added (depth, hidden_size, learn_sigma, switches)
    },
    "transport": {
        "objective": "sit",  # sit (SiT's transport: 5 keys below) | ddpm (DiT's diffusion)
        #   | meanflow (MeanFlow's average velocity, 1-step sampling; its keys at the end)
        "path_type": "Linear",  # sit: Linear | GVP | VP
        "prediction": "velocity",  # sit: velocity | score | noise
        "loss_weight": None,  # sit: None | velocity | likelihood (score/noise predictions only)
        # sit: None = the transport's default for this path/prediction (each eps)
        "train_eps": Key(None, Range(0, 0.5, high_open=True, nullable=True)),
        "sample_eps": Key(None, Range(0, 0.5, high_open=True, nullable=True)),
        # ddpm: steps T; the model sees integer t in 0..T-1 (T-1 = noise)
        "diffusion_steps": DDPM_DEFAULTS["diffusion_steps"],
        # ddpm: linear (DiT: betas 1e-4..0.02, x 1000/T) | cosine
        "noise_schedule": DDPM_DEFAULTS["noise_schedule"],
        # ddpm: learned (DiT: IDDPM range, loss MSE(eps) + VLB; needs model.learn_sigma=true)
        #   | fixed_large (beta_t) | fixed_small (posterior var.): MSE(eps), learn_sigma=false
        "ddpm_variance": DDPM_DEFAULTS["ddpm_variance"],
        # meanflow (needs model.interval_embed=true): the official ImageNet setting (names.py);
        # (t, r) logit-normal in MeanFlow's convention, r != t for meanflow_ratio of the pairs,
        # weight (error + c)^-p, target guidance omega / kappa with the objective's label dropout
        "meanflow_time_mean": Key(_MF["meanflow_time_mean"], Range(-10, 10)),
        "meanflow_time_std": Key(_MF["meanflow_time_std"], Range(0, 10, low_open=True)),
        # the second draw's own mean / std (null: the first's); the pair is ordered either way
        "meanflow_r_mean": Key(_MF["meanflow_r_mean"], Range(-10, 10, nullable=True)),
        "meanflow_r_std": Key(_MF["meanflow_r_std"], Range(0, 10, low_open=True, nullable=True)),
        "meanflow_ratio": Key(_MF["meanflow_ratio"], Range(0, 1)),
        "meanflow_norm_p": Key(_MF["meanflow_norm_p"], Range(0, 2)),
        # c = 0 divides 0 by 0 at a perfect fit
        "meanflow_norm_c": Key(_MF["meanflow_norm_c"], Range(0, low_open=True)),
        "meanflow_omega": Key(_MF["meanflow_omega"], Range(0, low_open=True)),
        "meanflow_kappa": Key(_MF["meanflow_kappa"], Range(0, 1, high_open=True)),
        "meanflow_class_dropout": Key(_MF["meanflow_class_dropout"], Range(0, 1, high_open=True)),
        # the JVP's dz/dt: conditional (MeanFlow) | predicted (the model's own velocity, as iMF)
        "meanflow_tangent": _MF["meanflow_tangent"],
    },
    "data": {
        "kind": "imagefolder",  # digits | imagefolder | latents (training.data.DATASETS)
        "root": None,  # class-subfolder image dir (imagefolder) or latent cache dir (latents)
        "image_root": None,  # latents + REPA: the ImageFolder the cache was made from
        "image_size": Key(256, _COUNT),  # pixel side after the ADM center crop (digits: 8)
        "random_flip": True,  # horizontal flip, p = 1/2 per (seed, epoch, item)
        "skip_bad": False,  # imagefolder: skip unreadable images with a warning instead of failing
        # imagefolder: a shorter image side is refused (skipped with skip_bad)
        "min_image_side": Key(8, _COUNT0),
        "split": "all",  # digits only: all | train | test
        "resize_mode": "bilinear",  # digits only, when image_size != 8: bilinear | bicubic
        # images per optimizer step, all processes and micro-batches
        "global_batch_size": Key(256, _COUNT),
        "num_workers": Key(4, _COUNT0),  # DataLoader workers per process
    },
    "vae": {
        "name": "stabilityai/sd-vae-ft-ema",  # none (pixel space) | hub id | local diffusers dir
        # latents = (posterior − shift_factor) × scaling_factor: each a number or one per channel
        "scaling_factor": SD_VAE_SCALING_FACTOR,  # SD-VAE's; SD3 1.5305, FLUX 0.3611
        "shift_factor": None,  # None = 0 (SD-VAE); SD3 0.0609, FLUX 0.1159
        # cache = per-channel mean / std of the latent cache's posterior means (VA-VAE): fills
        # scaling_factor = 1 / std and shift_factor = mean per channel when the run starts
        "latent_stats": None,
    },
    "optim": {
        "lr": Key(1e-4, _POSITIVE),  # AdamW learning rate (constant after warmup)
        "betas": [0.9, 0.999],  # AdamW betas
        "weight_decay": Key(0.0, Range(0)),  # AdamW decoupled weight decay
        "eps": Key(1e-8, Range(0)),  # AdamW epsilon
        "warmup_steps": Key(0, _COUNT0),  # linear warmup from lr/warmup_steps to lr; 0 = none
        # max global grad norm; None = no clipping (the norm is still logged)
        "grad_clip": Key(None, Range(0, low_open=True, nullable=True)),
        # EMA of the weights, updated after every optimizer step, kept in fp32
        "ema_decay": Key(0.9999, Range(0, 1, high_open=True)),
    },
    "train": {
        "steps": Key(400_000, _COUNT),  # optimizer steps in total (SiT scaling curves: 400K)
        # seeds model init, data order, augmentation and the noise of every micro-batch
        "seed": Key(0, SEED_RANGE),
        "precision": "fp32",  # fp32 | bf16 | fp16 (autocast; the weights, EMA etc. stay fp32)
        "compile": False,  # torch.compile the model (inductor)
        "grad_checkpointing": False,  # recompute blocks in backward to save memory
        "grad_accum": Key(1, _COUNT),  # micro-batches per optimizer step on each process
        "distributed": "ddp",  # ddp | fsdp (FSDP2: weights, grads, AdamW sharded per block)
        "cpu": False,  # force the CPU even when a GPU is present
        # torch CPU threads; None = from the model size and the free cores
        "cpu_threads": Key(None, Range(1, integer=True, nullable=True)),
        "out_dir": "runs/default",  # run directory: config.yaml, checkpoints/, samples/, metrics.*
        "log_every": Key(100, _COUNT),  # steps between metric rows (JSONL/CSV/TensorBoard)
        # steps between checkpoints (one is always written at the end)
        "ckpt_every": Key(50_000, _COUNT),
        # regular checkpoints on the ckpt_every schedule kept (milestones are never deleted; a
        # stop's off-schedule checkpoint is deleted once a newer one is written)
        "keep_last": Key(3, _COUNT),
        "milestone_every": Key(100_000, _COUNT0),  # steps between milestone checkpoints; 0 = none
        # steps between EMA sample grids (one at the end); 0 = none
        "sample_every": Key(10_000, _COUNT0),
        "tensorboard": None,  # events in out_dir/tb: None = when installed; true (warns if not)
        "wandb": False,  # Weights & Biases, one run across resumes (warns if not installed)
        "wandb_project": "sit-vit5",  # wandb project name
    },
    # Sample grids during training, and sample.py's defaults for this run's checkpoints. Sampler
    # keys: every SampleSpec field (sample.py grid --help); None = the SampleSpec default.
    "sample": {
        **config_defaults(),
        "method": "ode",  # sit: ode | sde; ddpm: ddpm (DiT) | ddim (eta 0); meanflow: meanflow
        "sampling_method": "euler",  # cheap fixed step; ode: euler | heun2 | dopri5 ...; sde: Euler
        "num_steps": 50,  # time-grid points (fixed-step ODE: num_steps - 1); ddpm/ddim: steps
        "num_images": Key(16, _COUNT),  # images in the grid
        "classes": None,  # class of each image; None = 0, 1, 2, ... repeated over the classes
        # global seed of the grid: image i is sample i of sample.py with this seed
        "seed": Key(0, SEED_RANGE),
        # images per grid row; None = ceil(sqrt(num_images))
        "nrow": Key(None, Range(1, integer=True, nullable=True)),
    },
    # REPA (Yu et al. 2025), off by default: block `depth`'s hidden state is projected onto a frozen
    # encoder's patch features; loss += coeff x mean negative cosine similarity (training/repa.py).
    "repa": {
        "encoder": None,  # None = off | digits | timm:NAME | hub:REPO:ENTRY | a local timm folder
        "weights": None,  # a local state-dict file for a timm:NAME architecture (no download)
        # align the output of this block (1-based; REPA: 8 of SiT-XL/2's 28)
        "depth": Key(8, _COUNT),
        "projector_dim": Key(2048, _COUNT),  # hidden width of the projector (REPA: 2048)
        "coeff": Key(0.5, Range(0)),  # lambda: loss = diffusion + coeff x alignment (REPA: 0.5)
        # encoder input side; None = its patch x the model's grid (DINOv2: 224)
        "resolution": Key(None, Range(1, integer=True, nullable=True)),
        "mean": None,  # per-channel normalisation of [0, 1] images; None = the encoder's (ImageNet)
        "std": None,  # likewise; the digits encoder takes the [-1, 1] images unchanged
        "interpolation": "bicubic",  # resize to repa.resolution (REPA: bicubic)
    },
}

#: The defaults alone: the config every file and override is merged into.
DEFAULTS: Config = {
    section: {key: v.default if isinstance(v, Key) else v for key, v in keys.items()}
    for section, keys in SCHEMA.items()}
#: Numeric keys with a valid range, by dotted name.
RANGES: dict[str, Range] = {f"{section}.{key}": v.valid for section, keys in SCHEMA.items()
                            for key, v in keys.items() if isinstance(v, Key)}

#: Sections whose extra keys are allowed (validated elsewhere) rather than errors.
OPEN_SECTIONS = ("model",)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float (YAML 1.1, hence PyYAML, wants ``1.0e-4``)
    and refuses a key given twice in one mapping, at any depth (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            merge = key_node.tag == "tag:yaml.org,2002:merge"
            if merge or not isinstance(key_node, yaml.ScalarNode):
                continue  # "<<" merges may be overridden; unhashable keys: SafeLoader says why
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} on lines {first[key]} and {line}: keep "
                    "one", key_node.start_mark)
            first[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def _type_ok(default: Any, value: Any) -> bool:
    """Values keep the default's type (ints may stand for floats); a None default takes anything."""
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


#: keys that also take a list (one value per latent channel)
PER_CHANNEL_KEYS = ("vae.scaling_factor", "vae.shift_factor")
LATENT_STATS = (None, "cache")


def merge(base: Config, update: dict[str, Any], source: str) -> Config:
    """A copy of ``base`` with ``update`` (section → key) merged in; ``source`` names the file or
    "command line" in errors. Unknown sections/keys and type changes raise ConfigError."""
    out = copy.deepcopy(base)
    if not isinstance(update, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(update).__name__}")
    for section, values in update.items():
        if section not in out:
            raise ConfigError(f"{source}: unknown section {section!r}; "
                              f"valid sections: {', '.join(out)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping, got {values!r}")
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if key not in out[section] and section not in OPEN_SECTIONS:
                raise ConfigError(f"{source}: unknown key {dotted!r}; valid keys of {section!r}: "
                                  f"{', '.join(out[section])}")
            per_channel = dotted in PER_CHANNEL_KEYS and isinstance(value, list)
            if key in DEFAULTS[section] and not per_channel and not _type_ok(
                    DEFAULTS[section][key], value):
                expected = type(DEFAULTS[section][key]).__name__
                raise ConfigError(f"{source}: {dotted}={value!r} ({type(value).__name__}); "
                                  f"expected {expected}")
            out[section][key] = value
    return out


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """``["train.steps=100", "optim.lr=3e-4"]`` → ``{"train": {"steps": 100}, "optim": ...}``."""
    nested: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name or "." in name:
            raise ConfigError(f"override {item!r} is not of the form section.key=value "
                              "(e.g. train.steps=100)")
        try:
            value = _load_yaml(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({err})") from err
        nested.setdefault(section, {})[name] = value
    return nested


BETA_RANGE = Range(0, 1, high_open=True)  # each of optim.betas

#: ``model`` keys with a range beyond their type (types: the model constructors' defaults).
MODEL_RANGES: dict[str, Range] = {
    "input_size": Range(1, integer=True, nullable=True),
    "in_channels": Range(1, integer=True, nullable=True),
    "num_classes": Range(1, integer=True, nullable=True),
    "patch_size": _COUNT,
    "hidden_size": _COUNT,
    "depth": _COUNT,
    "num_heads": _COUNT,
    "mlp_ratio": _POSITIVE,
    "class_dropout_prob": Range(0, 1, high_open=True),
    "num_registers": _COUNT0,
    "rope_theta": _POSITIVE,
    "register_rope_theta": Range(0, low_open=True, nullable=True),
    "layer_scale_init": Range(0, low_open=True, nullable=True),
}


def model_key_types() -> dict[str, tuple[type, bool]]:
    """``model`` key → (type, nullable), from the defaults of SiT and the SiT / ViT-5 switches
    (nullable when any defaults to None, or when it is derived from the data)."""
    from .models.registry import DATA_DERIVED_KEYS
    from .models.sit import SiT
    from .models.switches import SIT_SWITCHES
    from .models.vit5 import VIT5_SWITCHES

    defaults: dict[str, list[Any]] = {}
    for name, param in inspect.signature(SiT.__init__).parameters.items():
        if param.default is not inspect.Parameter.empty:
            defaults.setdefault(name, []).append(param.default)
    for switches in (SIT_SWITCHES, VIT5_SWITCHES):
        for name, value in switches.items():
            defaults.setdefault(name, []).append(value)
    types = {}
    for name, values in defaults.items():
        given = [v for v in values if v is not None]
        nullable = len(given) < len(values) or name in DATA_DERIVED_KEYS
        types[name] = (type(given[0]) if given else object, nullable)
    return types


def validate_model_section(cfg: Config) -> None:
    """Check the ``model`` keys' names, types, ranges and choices (ConfigError naming
    ``model.<key>=<value>``). Sizes that do not fit together: ``validate_architecture``."""
    from .models.layers import resolve_layer_scale_init
    from .models.switches import check_switches

    m = cfg["model"]
    check_model_keys(m)  # also run by validate_settings; here for direct callers

    # keys that also take a name for a number, and the model's resolver of those names
    named = {"layer_scale_init": resolve_layer_scale_init}
    types = model_key_types()
    for key, value in m.items():
        if key == "name" or key not in types:
            continue
        expected, nullable = types[key]
        if value is None and nullable:
            continue
        if isinstance(value, str) and key in named:  # resolved, then checked as the number
            try:
                value = named[key](value)
            except ValueError as err:
                raise ConfigError(f"model.{err}") from None
        if expected is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, expected)
        if not ok:
            raise ConfigError(f"model.{key}={value!r} ({type(value).__name__}); "
                              f"expected {expected.__name__}{' or null' if nullable else ''}")
        if key in MODEL_RANGES and not MODEL_RANGES[key].holds(value):
            raise ConfigError(f"model.{key}={value!r}; must be {MODEL_RANGES[key].describe()}")
    # the choices: the model's own check (sizes that fit together: validate_architecture)
    check_switches(m, prefix="model.")


def validate_architecture(m: dict[str, Any]) -> None:
    """Raise ConfigError when a (type-checked) ``model`` section cannot build a model: the
    model's own :func:`~sit_vit5.models.switches.check_architecture` on the name's sizes with the
    overrides."""
    from .models.registry import _NAME, SIZES
    from .models.switches import check_architecture

    _, hidden, heads = SIZES[_NAME.match(m["name"])["size"]]  # the name's sizes, then overrides
    check_architecture(m.get("hidden_size", hidden), m.get("num_heads", heads), _switches_of(m),
                       prefix="model.")


def _switches_of(cfg_model: dict[str, Any]) -> dict[str, Any]:
    """The switches ``cfg_model`` builds with: its backbone's defaults, then the overrides."""
    from .models.switches import SIT_SWITCHES
    from .models.vit5 import VIT5_SWITCHES

    base = VIT5_SWITCHES if cfg_model["name"].startswith("ViT5") else SIT_SWITCHES
    return {k: cfg_model.get(k, v) for k, v in base.items()}


def validate(cfg: Config) -> None:
    """:func:`validate_settings`, then :func:`validate_models` (ConfigError naming the key)."""
    validate_settings(cfg)
    validate_models(cfg)


def check_model_keys(model: dict[str, Any]) -> None:
    """The ``model`` section names only known keys and a registered model (``names``: no torch)."""
    unknown = sorted(set(model) - set(MODEL_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join('model.' + k for k in unknown)}; "
                          f"valid keys of 'model': {', '.join(MODEL_KEYS)}")
    if model["name"] not in MODEL_NAMES:
        raise ConfigError(f"model.name={model['name']!r} is not registered; "
                          f"valid: {', '.join(MODEL_NAMES)}")


def validate_settings(cfg: Config) -> None:
    """The checks that import nothing heavy: model keys and name, choices, ``RANGES``, the repa and
    sample sections (ConfigError naming the dotted key and its value)."""
    check_model_keys(cfg["model"])
    choices = {("train", "precision"): tuple(PRECISIONS), ("train", "distributed"): ("ddp", "fsdp"),
               ("transport", "meanflow_tangent"): MEANFLOW_TANGENTS}
    for (section, key), valid in choices.items():
        if cfg[section][key] not in valid:
            raise ConfigError(f"{section}.{key}={cfg[section][key]!r}; valid: {', '.join(valid)}")
    if cfg["train"]["precision"] == "fp16" and cfg["train"]["distributed"] == "fsdp":
        raise ConfigError("train.precision=fp16 with train.distributed=fsdp: fp16 needs a loss "
                          "scaler that FSDP2's sharded gradients do not support here; "
                          "use train.precision=bf16")
    for dotted, valid_range in RANGES.items():
        section, _, key = dotted.partition(".")
        value = cfg[section][key]
        if not valid_range.holds(value):
            what = "a positive integer" if valid_range == _COUNT else valid_range.describe()
            raise ConfigError(f"{dotted}={value!r}; must be {what}")
    if cfg["train"]["tensorboard"] not in (None, True, False):
        raise ConfigError(f"train.tensorboard={cfg['train']['tensorboard']!r}; "
                          "valid: true, false, null (= when installed)")
    betas = cfg["optim"]["betas"]
    if not isinstance(betas, list | tuple) or len(betas) != 2:  # null passes the type check
        raise ConfigError(f"optim.betas={betas!r}; expected two numbers")
    if not all(BETA_RANGE.holds(b) for b in betas):
        raise ConfigError(f"optim.betas={betas!r}; each must be {BETA_RANGE.describe()}")
    validate_repa(cfg)
    LatentNorm.from_section(cfg["vae"])
    if cfg["vae"]["latent_stats"] not in LATENT_STATS:
        raise ConfigError(f"vae.latent_stats={cfg['vae']['latent_stats']!r}; valid: null, cache")
    if cfg["vae"]["latent_stats"] == "cache" and cfg["data"]["kind"] != "latents":
        raise ConfigError("vae.latent_stats=cache needs data.kind=latents: the statistics come "
                          "from the latent cache (python -m sit_vit5.cache_latents)")
    try:  # the sampler keys: the spec checks its fields; a negative CFG only by sample.py's flag
        check_cfg_scale(SampleSpec.resolve(cfg["sample"]).cfg_scale)
    except SettingError as err:
        raise ConfigError(f"sample.{err}") from None


def validate_models(cfg: Config) -> None:
    """The model section, and the objective against model and sampler (imports torch: seconds)."""
    from .objective import check_objective

    validate_model_section(cfg)
    # objective vs model (learn_sigma, DiT-* names) and sampler (sample.method)
    check_objective(cfg["transport"], learn_sigma=cfg["model"].get("learn_sigma", True),
                    model_name=cfg["model"]["name"], sample_method=cfg["sample"]["method"],
                    interval_embed=cfg["model"].get("interval_embed", False))


def validate_repa(cfg: Config) -> None:
    """The ``repa`` section's values (the encoder is checked when a run is built); raises
    ConfigError naming the key."""
    r = cfg["repa"]
    for key in ("encoder", "weights"):
        if r[key] is not None and (not isinstance(r[key], str) or not r[key].strip()):
            raise ConfigError(f"repa.{key}={r[key]!r}; expected a name or path (or null)")
    if r["weights"] is not None and not str(r["encoder"] or "").startswith("timm:"):
        raise ConfigError(f"repa.weights={r['weights']!r} loads into a timm architecture: set "
                          "repa.encoder=timm:ARCH")
    for key in ("mean", "std"):
        value = r[key]
        ok = value is None or (isinstance(value, (list, tuple)) and len(value) in (1, 3) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value))
        if not ok or (key == "std" and value is not None and min(value) <= 0):
            positive = " > 0" if key == "std" else ""
            raise ConfigError(f"repa.{key}={value!r}; expected 1 or 3 numbers{positive} (or null = "
                              "the encoder's)")
    if (r["mean"] is None) != (r["std"] is None):
        raise ConfigError("repa.mean and repa.std go together: set both or neither")
    if r["interpolation"] not in INTERPOLATIONS:
        raise ConfigError(f"repa.interpolation={r['interpolation']!r}; valid: "
                          f"{', '.join(INTERPOLATIONS)}")
    kind, image_root = cfg["data"]["kind"], cfg["data"]["image_root"]
    if r["encoder"] is not None and kind == "latents" and image_root is None:
        raise ConfigError("repa.encoder needs the images of each batch, which a latent cache "
                          "does not hold: set data.image_root to the ImageFolder the cache was "
                          "made from (the loader reads each latent's image beside it), train from "
                          "data.kind=imagefolder (the VAE encodes on the fly), "
                          "or set repa.encoder=null")
    if image_root is not None and kind != "latents":
        raise ConfigError(f"data.image_root={image_root!r} is read only with data.kind=latents "
                          f"(images beside cached latents, for REPA); data.kind={kind!r} reads "
                          "data.root")


def check_out_dir(cfg: Config) -> None:
    """Raise ConfigError naming ``train.out_dir`` when the run directory cannot be created or
    written (a file in the way, a read-only mount); the check leaves nothing behind."""
    out_dir = cfg["train"]["out_dir"]
    problem = unwritable_dir_reason(out_dir) if isinstance(out_dir, str) and out_dir else "empty"
    if problem:
        raise ConfigError(f"train.out_dir={out_dir}: cannot write there ({problem}); set "
                          "train.out_dir to a folder you can write")


def configs_dir() -> Path:
    """The shipped ``configs/``: ``sit_vit5/configs`` when installed, else the checkout's top-level
    ``configs/``."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def find_config(path: str | os.PathLike) -> Path:
    """``path`` when it exists, else the same relative path in the shipped configs (``configs/`` and
    ``.yaml`` optional: ``configs/demo.yaml``, ``demo``, ``imagenet/sit-xl-2``)."""
    given = Path(path)
    if given.is_file():
        return given
    rel = Path(*given.parts[1:]) if given.parts[:1] == ("configs",) else given
    root = configs_dir()
    for candidate in (root / rel, root / rel.parent / f"{rel.name}.yaml") if rel.name else ():
        if not given.is_absolute() and candidate.is_file():
            return candidate
    shipped = (sorted(p.relative_to(root).as_posix() for p in root.rglob("*.yaml"))
               if root.is_dir() else [])
    raise ConfigError(f"config file {path} does not exist (nor in the shipped configs {root}: "
                      f"{', '.join(shipped) or 'none'})")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                check_models: bool = True) -> Config:
    """Defaults ← YAML file ``path`` (optional, ``find_config``) ← dotted ``overrides``: a new,
    validated dict (``check_models=False``: no :func:`validate_models`, no torch import)."""
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        path = find_config(path)
        with open(path) as f:
            try:
                loaded = _load_yaml(f)
            except yaml.YAMLError as err:  # ParserError, ScannerError, ...: name the file and line
                mark = getattr(err, "problem_mark", None)
                where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                raise ConfigError(f"{path}{where}: not valid YAML "
                                  f"({getattr(err, 'problem', None) or err})") from None
        cfg = merge(cfg, loaded or {}, str(path))
    cfg = merge(cfg, parse_overrides(list(overrides or [])), "command line")
    validate_settings(cfg)
    if check_models:
        validate_models(cfg)
    return cfg


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write ``cfg`` as YAML (sections in the defaults' order, keys as given)."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


def flatten(cfg: Config) -> dict[str, Any]:
    """``{"train": {"steps": 1}}`` → ``{"train.steps": 1}`` (for diffs and loggers)."""
    return {f"{section}.{key}": value
            for section, values in cfg.items() for key, value in values.items()}
