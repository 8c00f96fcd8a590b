"""A diffusers AutoencoderKL: loading, batched encode to normalised latents, decode.

Latents are the posterior normalised by a ``LatentNorm`` (default SD-VAE's, as DiT/SiT: × 0.18215).
Images: [N, 3, H, W] in [-1, 1]; latents [N, C, H/f, W/f] (SD-VAE: C 4, f 8; FLUX: 16, 8; VA-VAE:
32, 16). diffusers is imported on first load only.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .latent_norm import LatentNorm
from .names import SD_VAE_IDS as SD_VAE_IDS  # SiT/DiT's decoders (ft-EMA, ft-MSE)

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

SD_VAE_NORM = LatentNorm()  # DiT / SiT: × 0.18215, no shift
SD_VAE_EMA = SD_VAE_IDS[0]  # SiT's sample.py decoder (--vae ema), behind the released numbers


def vae_enabled(name: str | os.PathLike | None) -> bool:
    """Whether a ``vae.name`` names a VAE (``None`` / ``"none"`` = pixel space)."""
    return name is not None and str(name).lower() != "none"


def downsampling_factor(vae: AutoencoderKL) -> int:
    """Pixels per latent along one side: 2 per down block after the first (SD-VAE: 8)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def decoder(vae: AutoencoderKL, norm: LatentNorm = SD_VAE_NORM
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``decode(latents)`` bound to ``vae`` and ``norm``. Freezes ``vae`` as ``load_vae`` does
    (weights requiring grad take another matmul path, ~3e-6 apart)."""
    vae.requires_grad_(False)
    return lambda latents: decode(vae, latents, norm)


def _is_hub_id(name: str) -> bool:
    return (name.count("/") == 1 and not name.startswith((".", "/", "~"))
            and not os.path.exists(name))


def _fetch_hint(hub_id: str) -> str:
    return (f"fetch it on a machine with internet access with `hf download {hub_id}` (then copy "
            f"the Hugging Face cache here or point HF_HOME at it), or `hf download {hub_id} "
            f"--local-dir <dir>` and pass <dir> instead of the hub id")


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """Hide diffusers' huggingface_hub deprecation warning and the hub's retry warnings."""
    from .utils import hub_access

    with warnings.catch_warnings(), hub_access.quiet_hub_logs():
        warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks", category=UserWarning)
        yield


def load_vae(name_or_path: str | os.PathLike, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, *, subfolder: str | None = None,
             local_files_only: bool | None = None,
             cache_dir: str | os.PathLike | None = None, key: str = "vae.name") -> AutoencoderKL:
    """A frozen AutoencoderKL in eval mode, from a local diffusers directory or a hub id such as
    "stabilityai/sd-vae-ft-ema": the HF cache (`cache_dir`) first, then a download unless
    `local_files_only` (default: when offline, ``hub_access``). Errors name `key`, what was looked
    for, where, and the command that fetches it.
    """
    from diffusers import AutoencoderKL  # heavy: only when a VAE is actually loaded

    name = os.fspath(name_or_path)
    if not _is_hub_id(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"VAE directory {path} does not exist. Pass a diffusers "
                                    "AutoencoderKL directory or a hub id "
                                    f"({', '.join(SD_VAE_IDS)}); "
                                    + _fetch_hint(SD_VAE_IDS[0]))
        folder = path / subfolder if subfolder else path
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"VAE directory {folder} has no config.json: expected a "
                                    "diffusers AutoencoderKL folder "
                                    "(config.json + diffusion_pytorch_model.*)")
        try:
            vae = AutoencoderKL.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
        except (OSError, ValueError) as err:
            raise OSError(f"could not load the VAE weights in {folder}: {err}") from err
    else:
        from huggingface_hub import constants

        from .utils import hub_access  # the network probe: only for a hub id, never a local folder

        cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
        # probed before any hub call (huggingface_hub goes offline before its first request)
        offline = hub_access.is_offline() if local_files_only is None else local_files_only
        try:  # the cache first: no connection is needed for a VAE already fetched
            with _quiet_hub():
                vae = AutoencoderKL.from_pretrained(name, subfolder=subfolder, cache_dir=cache_dir,
                                                    local_files_only=True, torch_dtype=dtype)
        except (OSError, ValueError) as local_err:
            if offline:
                why = hub_access.offline_reason()
                raise OSError(f"{key}={name}: not in the local Hugging Face cache {cache} and "
                              f"{why}; " + _fetch_hint(name)) from local_err
            try:
                with _quiet_hub():
                    vae = AutoencoderKL.from_pretrained(name, subfolder=subfolder,
                                                        cache_dir=cache_dir, torch_dtype=dtype)
            except (OSError, ValueError) as err:
                raise OSError(f"{key}={name}: not in the local Hugging Face cache {cache} and "
                              f"downloading it failed ({type(err).__name__}: {err}); "
                              + _fetch_hint(name)) from err
    return vae.to(device=device).eval().requires_grad_(False)


def _batches(x: torch.Tensor, batch_size: int | None):
    return x.split(batch_size) if batch_size else (x,)


def _vae_input(vae: AutoencoderKL, x: torch.Tensor) -> torch.Tensor:
    return x.to(device=vae.device, dtype=vae.dtype)


@torch.no_grad()
def encode_moments(vae: AutoencoderKL, images: torch.Tensor, norm: LatentNorm = SD_VAE_NORM,
                   batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior (mean, std) of images [N, 3, H, W] in [-1, 1], normalised by ``norm``: float32 on
    the VAE's device, each [N, C, H/f, W/f]; mean + std·ε is a training latent."""
    means, stds = [], []
    for chunk in _batches(images, batch_size):
        posterior = vae.encode(_vae_input(vae, chunk)).latent_dist
        means.append(norm.normalize(posterior.mean.float()))
        stds.append(norm.scale_std(posterior.std.float()))
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def encode(vae: AutoencoderKL, images: torch.Tensor, sample: bool = True,
           generator: torch.Generator | None = None, norm: LatentNorm = SD_VAE_NORM,
           batch_size: int | None = None) -> torch.Tensor:
    """Training latents [N, C, H/f, W/f] (float32) of images [N, 3, H, W] in [-1, 1]: the
    normalised posterior mean + std·ε if `sample` (ε from `generator`, which must live on the VAE's
    device), else the normalised mean."""
    mean, std = encode_moments(vae, images, norm, batch_size)
    if not sample:
        return mean
    return mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)


@torch.no_grad()
def decode(vae: AutoencoderKL, latents: torch.Tensor, norm: LatentNorm = SD_VAE_NORM,
           batch_size: int | None = None) -> torch.Tensor:
    """Images [N, 3, H, W] (float32, about [-1, 1], unclamped) from latents [N, C, h, w]."""
    out = [vae.decode(norm.denormalize(_vae_input(vae, chunk))).sample.float()
           for chunk in _batches(latents, batch_size)]
    return torch.cat(out)
