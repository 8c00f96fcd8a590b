"""VAE wrapper on a tiny AutoencoderKL built from a config dict (no download)."""

import pytest
import torch
from diffusers import AutoencoderKL

from sit_vit5.latent_norm import LatentNorm
from sit_vit5.names import SD_VAE_SCALING_FACTOR
from sit_vit5.vae import decode, encode, encode_moments, load_vae


def test_load_local_dir_roundtrips_weights(vae_dir):
    vae = load_vae(vae_dir)
    reference = AutoencoderKL.from_pretrained(vae_dir)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    for (name, p), q in zip(vae.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(p, q), name
    assert load_vae(vae_dir, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_encode_moments_are_scaled_posterior(vae_dir):
    vae = load_vae(vae_dir)
    x = torch.rand(5, 3, 16, 16) * 2 - 1
    mean, std = encode_moments(vae, x, batch_size=2)  # batches of 2, 2, 1
    posterior = vae.encode(x).latent_dist
    assert mean.shape == (5, 4, 8, 8)
    torch.testing.assert_close(mean, posterior.mean * SD_VAE_SCALING_FACTOR, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std, torch.exp(0.5 * posterior.logvar) * SD_VAE_SCALING_FACTOR,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(encode(vae, x, sample=False, norm=LatentNorm(0.5)), posterior.mean * 0.5,
                               rtol=1e-5, atol=1e-6)


def test_encode_sample_is_mean_plus_std_noise(vae_dir):
    vae = load_vae(vae_dir)
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    z = encode(vae, x, generator=torch.Generator().manual_seed(7))
    mean, std = encode_moments(vae, x)
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(z, mean + std * eps)
    assert not torch.equal(z, encode(vae, x, generator=torch.Generator().manual_seed(8)))


def test_decode_divides_by_scaling_factor(vae_dir):
    vae = load_vae(vae_dir)
    z = torch.randn(3, 4, 8, 8)
    images = decode(vae, z, batch_size=2)
    assert images.shape == (3, 3, 16, 16) and images.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(images, vae.decode(z / SD_VAE_SCALING_FACTOR).sample, rtol=1e-5, atol=1e-6)


def test_missing_local_dir_error_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere") as info:
        load_vae(tmp_path / "nowhere")
    assert "hf download" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*config.json"):
        load_vae(tmp_path / "empty")


def test_uncached_hub_id_error_says_where_and_how(tmp_path):
    with pytest.raises(OSError) as info:
        load_vae("stabilityai/sd-vae-ft-ema", cache_dir=tmp_path / "hf", local_files_only=True)
    message = str(info.value)
    assert "vae.name=stabilityai/sd-vae-ft-ema" in message  # the setting at fault
    assert str(tmp_path / "hf") in message
    assert "hf download stabilityai/sd-vae-ft-ema" in message


def test_the_decoder_does_not_depend_on_how_the_vae_was_loaded(tmp_path):
    """diffusers' from_pretrained leaves the weights trainable, load_vae freezes them; torch's matmul
    takes another path for weights that require grad (the attention's transposed inputs), which put
    the pipeline's pixels one uint8 step off sample.py's: the decoder freezes its VAE."""
    from bench.common import TINY_VAE_ARCH
    from sit_vit5.vae import decoder

    torch.manual_seed(0)
    AutoencoderKL(**TINY_VAE_ARCH).save_pretrained(tmp_path)
    trainable = AutoencoderKL.from_pretrained(tmp_path).eval()
    assert all(p.requires_grad for p in trainable.parameters())
    decode_a, decode_b = decoder(trainable), decoder(load_vae(tmp_path))
    assert not any(p.requires_grad for p in trainable.parameters())
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(decode_a(latents), decode_b(latents))
