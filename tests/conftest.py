"""Shared test fixtures: one torch thread, and a tiny AutoencoderKL saved to disk."""

from __future__ import annotations

import os

import pytest
import torch

from sit_vit5.utils.cpu_threads import THREAD_ENV_VARS

#: A tiny SD-VAE-shaped AutoencoderKL (downsampling factor 2, 4 latent channels), built without downloads.
TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                norm_num_groups=8, sample_size=16)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny tensors: extra threads only add overhead, and on a loaded 2-core runner OpenMP spins.
    The thread variables too: ``train()`` follows a user's OMP_NUM_THREADS, and tests compare
    in-process runs with subprocesses started with one thread (bit for bit)."""
    threads, saved = torch.get_num_threads(), {k: os.environ.get(k) for k in THREAD_ENV_VARS}
    torch.set_num_threads(1)
    os.environ.update({k: "1" for k in THREAD_ENV_VARS})
    yield
    torch.set_num_threads(threads)
    for key, value in saved.items():
        if value is None:
            del os.environ[key]
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def vae_dir(tmp_path_factory):
    """A directory holding a randomly initialised tiny AutoencoderKL (``save_pretrained`` layout)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_vae")
    AutoencoderKL(**TINY_VAE).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def record_sample_outputs(request, monkeypatch):
    """With ``SIT_VIT5_SAMPLE_SHA_LOG=<file>``: append the SHA-256 of every image / npz array that a
    ``sample.py`` call of this test wrote (refactors must leave them bit-identical)."""
    import hashlib
    import os
    from pathlib import Path

    import numpy as np

    log = os.environ.get("SIT_VIT5_SAMPLE_SHA_LOG")
    if not log:
        yield
        return
    from sit_vit5.cli import sample as cli_sample

    real_main, calls = cli_sample.main, []

    def main(argv=None):
        status = real_main(argv)
        argv = list(argv or [])
        out = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--out", "--sample-dir")),
                   None)
        lines = [f"{request.node.nodeid} call{len(calls)} status={status}"]
        if out is not None and Path(out).is_dir():
            for path in sorted(Path(out).rglob("*")):
                if path.suffix == ".png":
                    lines.append(f"  {path.relative_to(out)} {hashlib.sha256(path.read_bytes()).hexdigest()}")
                elif path.suffix == ".npz" and path.parent.name != "parts":
                    with np.load(path) as f:
                        # the samples, not their record
                        for key in sorted(set(f.files) - {"settings", "metadata_json"}):
                            digest = hashlib.sha256(np.ascontiguousarray(f[key]).tobytes()).hexdigest()
                            lines.append(f"  {path.relative_to(out)}:{key} {digest}")
        calls.append(lines)
        return status

    monkeypatch.setattr(cli_sample, "main", main)
    import sample as root_sample  # the checkout's sample.py, as most tests call it

    monkeypatch.setattr(root_sample, "main", main)
    yield
    with open(log, "a") as f:
        for lines in calls:
            f.write("\n".join(lines) + "\n")
