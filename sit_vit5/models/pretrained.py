"""Strict loading of a saved backbone (``save_pretrained`` folders and hub ids): diffusers'
``from_pretrained`` with its warnings turned into errors, so that a folder written for another
class, an unknown config key or weights that do not fit never load as a half-random model."""

from __future__ import annotations

import os

from .checkpoint_files import CheckpointError

#: diffusers' class names for its DiT (the hub's facebook/DiT-XL-2-256 predates the first)
DIFFUSERS_DIT_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")
#: from_pretrained keywords that also locate config.json
_CONFIG_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision",
                  "subfolder", "dduf_entries")
#: diffusers' loading-info keys that make a load fail, and how the error names them
_LOADING_PROBLEMS = (("missing_keys", "missing keys"), ("unexpected_keys", "unexpected keys"),
                     ("mismatched_keys", "shape mismatches"), ("error_msgs", "errors"))


class StrictPretrained:
    """Mixin for a diffusers ``ModelMixin`` backbone (listed before it): a strict
    ``from_pretrained``. The class provides ``_get_init_keys`` and ``ignore_for_config``."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs):
        """diffusers' ``from_pretrained`` (folder or hub id), strict: a config.json written for
        another class, a config key this class does not know, and missing, unexpected or misshapen
        weights raise CheckpointError (one line) instead of warnings over a randomly initialised
        model."""
        where = os.fspath(pretrained_model_name_or_path)
        if kwargs.get("subfolder"):
            where = f"{where}/{kwargs['subfolder']}"
        config = cls.load_config(pretrained_model_name_or_path,
                                 **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
        found = config.get("_class_name")
        if found != cls.__name__:
            hint = ""
            if found in DIFFUSERS_DIT_CLASSES:
                hint = ("; a diffusers DiT folder: convert it with "
                        "sit_vit5.models.load_model(folder) "
                        "or sit_vit5.models.diffusers_dit.from_diffusers_dit(folder)")
            elif found in ("SiT", "ViT5"):
                hint = f"; load it with {found}.from_pretrained"
            raise CheckpointError(f"{where}: config.json is for class {found!r}, expected "
                                  f"{cls.__name__!r}{hint}")
        unknown = sorted(k for k in config if not k.startswith("_") and k not in
                         cls._get_init_keys(cls) | set(cls.ignore_for_config))
        if unknown:
            raise CheckpointError(f"{where}: config.json has key(s) {unknown} that {cls.__name__} "
                                  "does not know (written by a newer sit_vit5?)")
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path,
                                                  output_loading_info=True, **kwargs)
        except ValueError as err:  # diffusers refuses a misshapen tensor, with advice to ignore it
            if "expected shape" not in str(err):
                raise
            raise CheckpointError(f"{where}: the weights do not fit {cls.__name__}: "
                                  f"{str(err).split('. If you want')[0]}") from None
        problems = [f"{label} {info[key]}" for key, label in _LOADING_PROBLEMS if info.get(key)]
        if problems:
            raise CheckpointError(f"{where}: the weights do not fit {cls.__name__}: "
                                  + "; ".join(problems))
        return (model, info) if want_info else model
