"""Latent cache: encode → shards → LatentCacheDataset; resume, interruption, settings, bad images."""

import json
import pickle

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

import sit_vit5.cache_latents as cache_latents
import sit_vit5.latent_cache as latent_cache
from sit_vit5.datasets import item_generator
from sit_vit5.image_data import ImageFolderDataset
from sit_vit5.latent_cache import LatentCacheDataset
from sit_vit5.training.data import build_dataset
from tests.helpers import make_image_folder, naming

SCALE = 0.18215




@pytest.fixture
def data_dir(tmp_path):
    """10 random PNGs of varied sizes in two classes (4 in 'cat', 6 in 'dog')."""
    return make_image_folder(tmp_path / "images", {"dog": 6, "cat": 4})


def _run(data_dir, out, vae_dir, *extra):
    cache_latents.main(["--data-dir", str(data_dir), "--out", str(out), "--vae", str(vae_dir),
                        "--image-size", "16", "--batch-size", "3", "--shard-size", "4", "--num-workers", "0",
                        *extra])


def _reference_moments(vae_dir, data_dir):
    """Scaled posterior mean/std of every image and its flip, straight from diffusers: [N, 2, 4, 8, 8]."""
    vae = AutoencoderKL.from_pretrained(vae_dir).eval()
    images = ImageFolderDataset(data_dir, 16, random_flip=False)
    x = torch.stack([images.read(i) for i in range(len(images))])
    with torch.no_grad():
        posteriors = [vae.encode(v).latent_dist for v in (x, x.flip(-1))]
    mean = torch.stack([p.mean for p in posteriors], 1) * SCALE
    std = torch.stack([p.std for p in posteriors], 1) * SCALE
    return mean, std, images


def test_cache_round_trip_matches_diffusers(vae_dir, data_dir, tmp_path):
    out = tmp_path / "cache"
    _run(data_dir, out, vae_dir, "--dtype", "float32")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_images"] == 10 and manifest["classes"] == ["cat", "dog"]
    assert manifest["latent_shape"] == [4, 8, 8] and manifest["scaling_factor"] == SCALE
    assert [(s["start"], s["stop"]) for s in manifest["shards"]] == [(0, 4), (4, 8), (8, 10)]
    np.testing.assert_array_equal(np.load(out / "labels.npy"), [0] * 4 + [1] * 6)
    assert (out / "files.txt").read_text().splitlines()[4] == "dog/0.png"

    mean, std, images = _reference_moments(vae_dir, data_dir)
    stored_mean = np.concatenate([np.load(out / s["mean"], mmap_mode="r") for s in manifest["shards"]])
    stored_std = np.concatenate([np.load(out / s["std"], mmap_mode="r") for s in manifest["shards"]])
    assert stored_mean.shape == (10, 2, 4, 8, 8) and stored_mean.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(stored_mean), mean, rtol=1e-5, atol=1e-6)  # [:, 1] = flipped
    torch.testing.assert_close(torch.from_numpy(stored_std), std, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(mean[:, 0], mean[:, 1])  # the flip slot really holds something else

    ds = LatentCacheDataset(out, random_flip=True, seed=11)
    assert len(ds) == 10 and ds.num_classes == 2 and ds.sample_shape == (4, 8, 8)
    flips = set()
    for epoch in range(3):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            latent, label = ds[i]
            assert label == int(images.labels[i])
            gen = item_generator(11, epoch, i)  # documented draw order: flip bit, then ε
            flip = int(torch.randint(2, (1,), generator=gen).item())
            eps = torch.randn(4, 8, 8, generator=gen)
            torch.testing.assert_close(latent, mean[i, flip] + std[i, flip] * eps, rtol=1e-5, atol=1e-6)
            flips.add(flip)
    assert flips == {0, 1}


def test_float16_cache_and_dataset_details(vae_dir, data_dir, tmp_path):
    out = tmp_path / "cache"
    _run(data_dir, out, vae_dir)
    mean, std, _ = _reference_moments(vae_dir, data_dir)
    ds = LatentCacheDataset(out, random_flip=False)
    for i in (0, 5, 9):
        m, s = ds.moments(i, 1)
        torch.testing.assert_close(m, mean[i, 1], rtol=1e-3, atol=1e-4)  # float16 storage
        torch.testing.assert_close(s, std[i, 1], rtol=1e-3, atol=1e-4)
    ds.set_epoch(3)
    first = ds[7][0]
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn-started DataLoader worker receives
    assert clone._arrays == {} and torch.equal(clone[7][0], first)
    ds.set_epoch(4)
    assert not torch.equal(ds[7][0], first)
    built = build_dataset({"kind": "latents", "root": str(out), "image_size": 16})
    assert isinstance(built, LatentCacheDataset)
    with pytest.raises(ValueError, match="256"):
        build_dataset({"kind": "latents", "root": str(out), "image_size": 256})


def test_dataloader_workers_give_the_same_latents(vae_dir, data_dir, tmp_path):
    out = tmp_path / "cache"
    _run(data_dir, out, vae_dir)
    ds = LatentCacheDataset(out, seed=2)
    ds.set_epoch(1)
    ds[0]  # opens a memmap in this process; workers must open their own
    serial = [ds[i] for i in range(len(ds))]
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    latents, labels = zip(*loader)
    torch.testing.assert_close(torch.cat(latents), torch.stack([z for z, _ in serial]), rtol=0, atol=0)
    assert torch.cat(labels).tolist() == [y for _, y in serial]


def test_resume_recomputes_only_unmarked_shards(vae_dir, data_dir, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    _run(data_dir, out, vae_dir)
    before = {p.name: p.read_bytes() for p in out.glob("shard_*.npy")}
    assert len(before) == 6, sorted(before)  # 10 images, 4 per shard: 3 shards x (mean, std)
    (out / "shard_00001.done").unlink()
    (out / "shard_00001.mean.npy").write_bytes(b"stale")  # whatever is there gets replaced

    encoded = []
    original = latent_cache.encode_moments

    def counting(vae, x, *args, **kwargs):
        encoded.append(len(x))
        return original(vae, x, *args, **kwargs)

    monkeypatch.setattr(latent_cache, "encode_moments", counting)
    _run(data_dir, out, vae_dir)
    assert sum(encoded) == 2 * 4  # shard 1's four images, each with its flip
    after = {p.name: p.read_bytes() for p in out.glob("shard_*.npy")}
    assert after == before and (out / "shard_00001.done").is_file()
    encoded.clear()
    _run(data_dir, out, vae_dir)  # a complete cache: nothing to do
    assert encoded == []


def test_interrupted_run_leaves_no_half_shard(vae_dir, data_dir, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    _run(data_dir, reference, vae_dir)

    out = tmp_path / "cache"
    calls = []
    original = latent_cache.encode_moments

    def dies_in_second_shard(vae, x, *args, **kwargs):
        calls.append(len(x))
        if len(calls) == 3:  # batches of 3 images: calls 1-2 fill shard 0, call 3 is inside shard 1
            raise KeyboardInterrupt
        return original(vae, x, *args, **kwargs)

    monkeypatch.setattr(latent_cache, "encode_moments", dies_in_second_shard)
    with pytest.raises(KeyboardInterrupt):
        _run(data_dir, out, vae_dir)
    assert (out / "shard_00000.done").is_file() and (out / "shard_00000.mean.npy").is_file()
    assert not (out / "shard_00001.mean.npy").exists() and not (out / "shard_00001.std.npy").exists()
    assert not (out / "shard_00001.done").exists()
    with pytest.raises(RuntimeError, match=naming("1/3", "--out")):
        LatentCacheDataset(out)

    monkeypatch.setattr(latent_cache, "encode_moments", original)
    _run(data_dir, out, vae_dir)
    for name in ("shard_00000", "shard_00001", "shard_00002"):
        for kind in ("mean", "std"):
            file = f"{name}.{kind}.npy"
            assert (out / file).read_bytes() == (reference / file).read_bytes()
    assert not list(out.glob("*.tmp"))
    assert len(LatentCacheDataset(out)) == 10


def test_rerun_with_other_settings_is_refused(vae_dir, data_dir, tmp_path):
    out = tmp_path / "cache"
    _run(data_dir, out, vae_dir)
    with pytest.raises(ValueError, match=naming("shard_size", "4", "5")):
        _run(data_dir, out, vae_dir, "--shard-size", "5")
    Image.new("RGB", (20, 20)).save(data_dir / "cat" / "new.png")
    with pytest.raises(ValueError, match="num_images"):
        _run(data_dir, out, vae_dir)


def test_unreadable_image_stops_or_is_skipped(vae_dir, data_dir, tmp_path):
    (data_dir / "dog" / "3.png").write_bytes(b"garbage")
    with pytest.raises(Exception, match="dog/3.png"):
        _run(data_dir, tmp_path / "strict", vae_dir)

    out = tmp_path / "lenient"
    _run(data_dir, out, vae_dir, "--skip-bad")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["bad_indices"] == [7]  # cat/0-3 → 0-3, dog/0-5 → 4-9
    ds = LatentCacheDataset(out, random_flip=False)
    assert len(ds) == 9
    mean, _, _ = _reference_moments_without(vae_dir, data_dir, skip=7)
    torch.testing.assert_close(torch.stack([ds.moments(i, 0)[0] for i in range(9)]), mean[:, 0],
                               rtol=1e-3, atol=1e-4)
    assert [ds[i][1] for i in range(9)] == [0] * 4 + [1] * 5


def _reference_moments_without(vae_dir, data_dir, skip):
    vae = AutoencoderKL.from_pretrained(vae_dir).eval()
    images = ImageFolderDataset(data_dir, 16, random_flip=False)
    x = torch.stack([images.read(i) for i in range(len(images)) if i != skip])
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean * SCALE
    return mean[:, None], None, images


def test_missing_cache_error_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m sit_vit5.cache_latents"):
        LatentCacheDataset(tmp_path / "nothing")


@pytest.mark.slow
def test_two_processes_share_the_work_and_match_one(vae_dir, data_dir, tmp_path):
    """torchrun with 2 processes, no --cpu (no GPU: gloo): disjoint shard sets, same values as one process."""
    import os
    import re
    import signal
    import subprocess
    import sys

    single = tmp_path / "single"
    _run(data_dir, single, vae_dir)
    out = tmp_path / "double"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "sit_vit5.cache_latents", "--data-dir", str(data_dir), "--out", str(out),
           "--vae", str(vae_dir), "--image-size", "16", "--batch-size", "3", "--shard-size", "4",
           "--num-workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
        raise
    assert proc.returncode == 0, stderr[-3000:]
    assigned = dict(re.findall(r"process (\d)/2: shards (\[.*?\])", stdout))
    assert assigned == {"0": "['00000', '00002']", "1": "['00001']"}
    files = sorted(p.name for p in single.glob("shard_*.npy"))
    assert len(files) == 6, files  # 10 images, 4 per shard: 3 shards x (mean, std)
    for file in files:  # other thread counts: float16 ulps
        np.testing.assert_allclose(np.load(out / file), np.load(single / file), rtol=2e-3, atol=1e-4)
    assert json.loads((out / "manifest.json").read_text())["complete"]
