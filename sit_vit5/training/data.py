"""The training data from a config: the dataset of the ``data`` section (digits, an image folder or
a latent cache), and what the data decides about the model (input side, channels, classes, the
latent normalisation), checked against what the config says."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from ..config import Config, ConfigError
from ..datasets import DataRootError, DigitsDataset
from ..latent_norm import LatentNorm
from ..models.registry import _NAME
from ..vae import downsampling_factor


def _build_digits(cfg: dict[str, Any]) -> Dataset:
    return DigitsDataset(image_size=cfg.get("image_size", 8), split=cfg.get("split", "all"),
                         random_flip=cfg.get("random_flip", False),
                         resize_mode=cfg.get("resize_mode", "bilinear"), seed=cfg.get("seed", 0))


def _build_imagefolder(cfg: dict[str, Any]) -> Dataset:
    from ..image_data import ImageFolderDataset  # PIL decoding and folder listing: this kind only

    return ImageFolderDataset(_require(cfg, "root"), _require(cfg, "image_size"),
                              random_flip=cfg.get("random_flip", True),
                              skip_bad=cfg.get("skip_bad", False), seed=cfg.get("seed", 0),
                              min_side=cfg.get("min_image_side", 0))


def _build_latents(cfg: dict[str, Any]) -> Dataset:
    from ..latent_cache import MANIFEST_NAME, CacheMismatchError, LatentCacheDataset  # platform

    dataset = LatentCacheDataset(_require(cfg, "root"), random_flip=cfg.get("random_flip", True),
                                 seed=cfg.get("seed", 0), image_root=cfg.get("image_root"))
    if cfg.get("image_size") is not None and int(cfg["image_size"]) != dataset.image_size:
        raise CacheMismatchError(
            f"data.image_size={cfg['image_size']} but the latent cache {cfg['root']} was made from "
            f"{dataset.image_size}px images (its {MANIFEST_NAME}); set data.image_size="
            f"{dataset.image_size} or point data.root at a {cfg['image_size']}px cache")
    return dataset


# kind → builder; each reads only its own keys of the data config
DATASETS: dict[str, Callable[[dict[str, Any]], Dataset]] = {
    "digits": _build_digits,  # image_size (8), split, random_flip (False), resize_mode, seed
    "imagefolder": _build_imagefolder,  # root, image_size, random_flip, skip_bad, min_image_side
    "latents": _build_latents,  # root (the cache dir), random_flip, seed, image_root
}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key == "root" and cfg.get(key) is None:
        raise DataRootError(f"data.root is not set: data.kind={cfg.get('kind', cfg.get('name'))!r} "
                            "reads its images (or latent cache) from there")
    if cfg.get(key) is None:
        raise KeyError(f"data config for kind {cfg.get('kind', cfg.get('name'))!r} "
                       f"needs key {key!r}")
    return cfg[key]


def build_dataset(cfg: dict[str, Any]) -> Dataset:
    """Dataset from a data config dict: `kind` (or `name`) ∈ DATASETS plus that kind's keys, e.g.
    {"kind": "imagefolder", "root": "/data/imagenet/train", "image_size": 256}; other keys are
    ignored. An unknown kind raises, listing the valid ones."""
    kind = cfg.get("kind", cfg.get("name"))
    if kind not in DATASETS:
        raise ValueError(f"data kind {kind!r} is not one of: {', '.join(DATASETS)}")
    return DATASETS[kind](cfg)


def build_dataset_from_config(cfg: Config) -> Dataset:
    """The dataset of the ``data`` section, seeded with ``train.seed``."""
    if cfg["data"]["kind"] not in DATASETS:
        raise ConfigError(f"data.kind={cfg['data']['kind']!r}; valid: {', '.join(DATASETS)}")
    data = {**cfg["data"], "seed": cfg["train"]["seed"]}
    if cfg["repa"]["encoder"] is None:  # images beside cached latents are for REPA's encoder only
        data["image_root"] = None
    return build_dataset(data)


def resolve_latent_norm(cfg: Config, dataset: Dataset, vae: nn.Module | None,
                        channels: int) -> LatentNorm:
    """The run's latent normalisation: the ``vae`` section's, or with ``latent_stats: cache`` the
    cache's per-channel statistics (per-channel values already in the section must equal them: a
    resumed run). A latent cache is set to return it. ConfigError naming the key otherwise."""
    section, kind = cfg["vae"], cfg["data"]["kind"]
    norm = LatentNorm.from_section(section)
    if section["latent_stats"] == "cache":
        stats = dataset.latent_stats()
        if norm.per_channel and norm != stats:
            raise ConfigError(
                f"vae.scaling_factor / vae.shift_factor hold per-channel values other than the "
                f"statistics of the latent cache {cfg['data']['root']}: this run's were made "
                "from another cache; point data.root at that cache, or start a new run")
        if not norm.per_channel and section["shift_factor"] is not None:
            raise ConfigError(f"vae.shift_factor={section['shift_factor']} with "
                              "vae.latent_stats=cache: the statistics give the shift; "
                              "drop one of them")
        norm = stats
    norm.check_channels(channels)
    if vae is not None:
        norm.check_vae(vae.config, section["name"])
    if kind == "latents":  # the cache records the VAE's normalisation as it was written
        stored = {"shift_factor": dataset.norm.shift, "scaling_factor": dataset.norm.scale}
        norm.check_vae(stored, f"{dataset.vae} (as the latent cache {dataset.cache_dir} "
                       "stores it)")
        dataset.normalize_to(norm)
    return norm


def _check_patch_grid(cfg: Config, side: int, factor: int) -> None:
    """ConfigError naming ``data.image_size`` (or the latent cache) when the model's input side
    ``side`` (data side / ``factor``, the VAE's downsampling) is not a multiple of its patch size:
    the patch embedding would fail at the first step, after the run folder is made."""
    m, data = cfg["model"], cfg["data"]
    patch = m.get("patch_size") or int(_NAME.match(m["name"])["patch"])
    if side % patch == 0 and side > 0:
        return
    if data["kind"] == "latents":
        raise ConfigError(f"data.root={data['root']}: the cached latents are {side}x{side}, not a "
                          f"multiple of {m['name']}'s patch size {patch}")
    seen = f"{side}x{side} latents" if factor > 1 else f"{side}x{side} inputs"
    raise ConfigError(f"data.image_size={data['image_size']}: the model sees {seen}, not a "
                      f"multiple of {m['name']}'s patch size {patch}; use a multiple of "
                      f"{patch * factor}")


def resolve_data_dependent(cfg: Config, dataset: Dataset, vae: nn.Module | None) -> Config:
    """A copy of ``cfg`` with ``model.input_size / in_channels / num_classes`` filled from the data
    and the ``vae`` normalisation resolved (``resolve_latent_norm``); values already given are
    checked against it (ConfigError)."""
    channels, height, _ = dataset.sample_shape
    kind, vae_name = cfg["data"]["kind"], cfg["vae"]["name"]
    factor = 1  # data pixels per model-input pixel
    if vae is not None and kind != "latents":  # images encoded on the fly
        if channels != 3:
            raise ConfigError(f"vae.name={vae_name!r} encodes RGB images, but data.kind={kind!r} "
                              f"gives {channels}-channel images; set vae.name=none")
        factor = downsampling_factor(vae)
        channels, height = vae.config.latent_channels, height // factor
    if kind == "latents" and vae is not None and vae.config.latent_channels != channels:
        raise ConfigError(f"vae.name={vae_name!r} makes {vae.config.latent_channels}-channel "
                          f"latents, but the latent cache {cfg['data']['root']} holds {channels}")
    _check_patch_grid(cfg, height, factor)
    resolved = copy.deepcopy(cfg)
    if vae is not None or kind == "latents":
        resolved["vae"].update(resolve_latent_norm(cfg, dataset, vae, channels).section())
    derived = {"input_size": height, "in_channels": channels, "num_classes": dataset.num_classes}
    for key, value in derived.items():
        given = cfg["model"].get(key)
        if given is None:
            resolved["model"][key] = value
        elif key == "num_classes" and given < value:
            raise ConfigError(f"model.num_classes={given} but the dataset has {value} classes")
        elif key != "num_classes" and given != value:
            raise ConfigError(f"model.{key}={given} but the data gives {value}; leave it unset "
                              "(null) to derive it")
    return resolved
