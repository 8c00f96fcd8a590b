"""Shared test fixtures: one torch thread, and a tiny AutoencoderKL saved to disk."""

from __future__ import annotations

import pytest
import torch

#: A tiny SD-VAE-shaped AutoencoderKL (downsampling factor 2, 4 latent channels), built without downloads.
TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                norm_num_groups=8, sample_size=16)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny tensors: extra threads only add overhead, and on a loaded 2-core runner OpenMP spins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def vae_dir(tmp_path_factory):
    """A directory holding a randomly initialised tiny AutoencoderKL (``save_pretrained`` layout)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_vae")
    AutoencoderKL(**TINY_VAE).save_pretrained(path)
    return path
