"""Hostile inputs to the latent cache, writer (``python -m sit_vit5.cache_latents``) and reader
(``LatentCacheDataset``): each case ends in exit 2 (130 for Ctrl-C) with one stderr line naming the
file, flag or value, never a traceback, and leaves no file lost or half-written (no ``.tmp-*``
file, every shard in place complete, every shard done before untouched)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

import sit_vit5.cache_latents as cache_latents
import sit_vit5.latent_cache as latent_cache
from sit_vit5.config import load_config
from sit_vit5.latent_cache import CacheMismatchError, CorruptCacheError, LatentCacheDataset, npy_layout
from sit_vit5.training import NonFiniteLossError, train
from sit_vit5.training.data import build_dataset
from sit_vit5.utils.atomic_files import TMP_PREFIX
from sit_vit5.utils.errors import SitVit5Error, run_cli
from tests.conftest import TINY_VAE
from tests.helpers import assert_names, make_image_folder, naming, refused_in_one_line

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m sit_vit5.cache_latents"
TRAIN_TINY = [
    "model.name=ViT5-S/2",
    "model.depth=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.learn_sigma=false",
    "data.kind=latents",
    "data.image_size=16",
    "data.num_workers=0",
    "vae.name=none",
    "train.tensorboard=false",
    "train.sample_every=0",
    "train.log_every=1",
    "train.milestone_every=0",
    "data.global_batch_size=4",
    "train.steps=3",
]


@pytest.fixture
def data_dir(tmp_path):
    """10 random PNGs of varied sizes in two classes (cat: indices 0-3, dog: 4-9)."""
    return make_image_folder(tmp_path / "images", {"cat": 4, "dog": 6})


def argv(data_dir, out, vae_dir, *extra) -> list[str]:
    return [
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
        "--vae",
        str(vae_dir),
        "--image-size",
        "16",
        "--batch-size",
        "3",
        "--shard-size",
        "4",
        "--num-workers",
        "0",
        *extra,
    ]


def stderr_lines(text: str) -> list[str]:
    """Non-empty stderr lines, progress-bar redraws and "skipping" reports left out."""
    lines = [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
    return [line for line in lines if "%|" not in line and not line.startswith("skipping ")]


def refused(capsys, args, status=2, prog=PROG) -> str:
    """Run the command; assert ``status`` and exactly one stderr line ``<prog>: error: ...`` (no
    traceback); return that line."""
    assert cache_latents.cli([str(a) for a in args]) == status
    err = capsys.readouterr().err
    lines = stderr_lines(err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: " if status == 2 else f"{prog}: interrupted"), lines
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def assert_consistent(out: Path) -> None:
    """No temporary file; every shard array in place is whole; every done marker's digests hold."""
    assert not [
        p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX) or p.suffix == ".tmp"
    ]
    for path in out.glob("shard_*.npy"):
        assert path.stat().st_size == npy_layout(path)[2], path
    for marker in out.glob("shard_*.done"):
        digests = json.loads(marker.read_text())["sha256"]
        for key, digest in digests.items():
            name = marker.name.replace(".done", f".{key}.npy")
            assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name


@pytest.fixture
def cache(data_dir, vae_dir, tmp_path):
    out = tmp_path / "cache"
    assert cache_latents.cli(argv(data_dir, out, vae_dir)) == 0
    return out


# ----------------------------------------------------------------------------- the writer


def test_truncated_jpeg_is_one_line_and_leaves_no_temporary(data_dir, vae_dir, tmp_path, capsys):
    Image.fromarray(np.full((30, 30, 3), 90, np.uint8)).save(data_dir / "dog" / "1.png")
    jpeg = data_dir / "dog" / "1.png"  # index 5: shard 1
    Image.open(jpeg).save(data_dir / "dog" / "1.jpg", quality=90)
    jpeg.unlink()
    data = (data_dir / "dog" / "1.jpg").read_bytes()
    (data_dir / "dog" / "1.jpg").write_bytes(data[: len(data) // 2])
    out = tmp_path / "cache"
    line = refused(capsys, argv(data_dir, out, vae_dir))
    assert "dog/1.jpg" in line and "truncated" in line and "--skip-bad" in line
    assert (out / "shard_00000.done").is_file() and not (out / "shard_00001.mean.npy").exists()
    assert_consistent(out)
    shard0 = (out / "shard_00000.mean.npy").read_bytes()
    assert (
        cache_latents.cli(argv(data_dir, out, vae_dir, "--skip-bad")) == 0
    )  # resumes, skipping it
    assert (
        "skipping" in capsys.readouterr().err
        and "dog/1.jpg" in json.loads((out / "manifest.json").read_text())["bad_files"][0]
    )
    assert (out / "shard_00000.mean.npy").read_bytes() == shard0
    assert_consistent(out)


@pytest.mark.parametrize(
    "change, named",
    [
        (("--dtype", "float32"), ("dtype", "'float16'", "'float32'")),
        (("--vae-dtype", "bfloat16"), ("vae_dtype", "'float32'", "'bfloat16'")),  # was accepted
        (("--image-size", "20"), ("image_size", "16", "20")),
    ],
)
def test_resume_with_other_settings_is_one_line_and_changes_nothing(
    cache, data_dir, vae_dir, capsys, change, named
):
    before = snapshot(cache)
    line = refused(capsys, argv(data_dir, cache, vae_dir) + list(change))
    assert_names(line, *named, cache)
    assert snapshot(cache) == before


def test_resume_onto_other_vae_weights_is_refused(cache, data_dir, vae_dir, tmp_path, capsys):
    other = tmp_path / "vae"  # the same config, other weights: the path alone would not tell
    torch.manual_seed(1)
    AutoencoderKL(**TINY_VAE).save_pretrained(other)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["vae"] = str(other.resolve())  # as if the cache had been made from this folder
    (cache / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(cache)
    line = refused(capsys, argv(data_dir, cache, other))
    assert "vae_weights_sha256" in line and "vae_config_sha256" not in line
    assert snapshot(cache) == before


def test_resume_onto_a_changed_image_is_refused(cache, data_dir, vae_dir, capsys):
    (cache / "shard_00001.done").unlink()  # a partial cache: the rerun would encode shard 1 again
    Image.fromarray(np.zeros((33, 35, 3), np.uint8)).save(data_dir / "cat" / "2.png")  # same name
    before = snapshot(cache)
    line = refused(capsys, argv(data_dir, cache, vae_dir))
    assert "1" in line and "cat/2.png" in line
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    "size, named",
    [(15, ("--image-size 15", "2", "14", "16"))],
)
def test_image_size_not_a_multiple_of_the_vae_factor(
    data_dir, vae_dir, tmp_path, capsys, size, named
):
    out = tmp_path / "cache"
    line = refused(capsys, argv(data_dir, out, vae_dir, "--image-size", str(size)))
    assert_names(line, *named)
    assert not out.exists()


def test_missing_data_dir_and_out_under_a_file(data_dir, vae_dir, tmp_path, capsys):
    line = refused(capsys, argv(tmp_path / "nowhere", tmp_path / "c", vae_dir))
    assert str(tmp_path / "nowhere") in line
    blocker = tmp_path / "file"
    blocker.write_text("keep")
    line = refused(capsys, argv(data_dir, blocker / "cache", vae_dir))
    assert f"--out {blocker / 'cache'}" in line and "is a file" in line
    assert blocker.read_text() == "keep"


def test_tiny_and_non_image_files_refused_or_each_reported(data_dir, vae_dir, tmp_path, capsys):
    Image.new("RGB", (1, 1), (200, 10, 10)).save(
        data_dir / "cat" / "tiny.png"
    )  # used to be upscaled
    (data_dir / "dog" / "notes.jpg").write_text("not an image")
    line = refused(capsys, argv(data_dir, tmp_path / "strict", vae_dir))
    assert "cat/tiny.png" in line and "1x1" in line and "--min-image-side" in line and "--skip-bad" in line
    assert_consistent(tmp_path / "strict")

    out = tmp_path / "lenient"
    assert cache_latents.cli(argv(data_dir, out, vae_dir, "--skip-bad")) == 0
    captured = capsys.readouterr()
    reports = [line for line in re.split(r"[\r\n]+", captured.err) if line.startswith("skipping ")]
    assert len(reports) == 2 and "cat/tiny.png" in reports[0] and "dog/notes.jpg" in reports[1]
    assert "2 skipped: image" in captured.out and "tiny.png" in captured.out
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["bad_indices"]) == 2 and len(manifest["bad_files"]) == 2
    assert len(LatentCacheDataset(out)) == 10

    accepting = (
        tmp_path / "accepting"
    )  # asked for: the 1x1 image is encoded (notes.jpg still skipped)
    assert (
        cache_latents.cli(argv(data_dir, accepting, vae_dir, "--skip-bad", "--min-image-side", "0"))
        == 0
    )
    assert len(LatentCacheDataset(accepting)) == 11


def test_ctrl_c_says_rerun_leaves_no_temporary_and_the_rerun_is_identical(
    cache, data_dir, vae_dir, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "interrupted"
    calls, original = [], latent_cache.encode_moments

    def interrupted_in_shard_1(vae, x, *args, **kwargs):
        calls.append(len(x))
        if len(calls) == 3:  # batches of 3: calls 1-2 fill shard 0, call 3 is inside shard 1
            raise KeyboardInterrupt
        return original(vae, x, *args, **kwargs)

    monkeypatch.setattr(latent_cache, "encode_moments", interrupted_in_shard_1)
    line = refused(capsys, argv(data_dir, out, vae_dir), status=130)
    assert line == f"{PROG}: interrupted; rerun the same command to continue"
    assert_consistent(out)
    assert not (out / "shard_00001.mean.npy").exists()
    monkeypatch.setattr(latent_cache, "encode_moments", original)
    assert cache_latents.cli(argv(data_dir, out, vae_dir)) == 0
    assert snapshot(out) == snapshot(cache)


def test_a_killed_writers_temporaries_are_swept_and_never_read(cache, data_dir, vae_dir, tmp_path):
    out = tmp_path / "killed"
    assert cache_latents.cli(argv(data_dir, out, vae_dir)) == 0
    (out / "shard_00001.done").unlink()
    (
        out / "shard_00001.mean.npy"
    ).unlink()  # as a kill -9 between the temporary and the rename leaves it
    (out / f"{TMP_PREFIX}4242-shard_00001.mean.npy").write_bytes(b"half a shard")
    (out / "shard_00001.std.npy.tmp").write_bytes(b"an older version's temporary")
    assert cache_latents.cli(argv(data_dir, out, vae_dir)) == 0
    assert snapshot(out) == snapshot(cache)


def test_subprocess_truncated_image_prints_no_traceback(data_dir, vae_dir, tmp_path):
    (data_dir / "dog" / "3.png").write_bytes((data_dir / "dog" / "3.png").read_bytes()[:60])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "sit_vit5.cache_latents", *argv(data_dir, tmp_path / "c", vae_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = stderr_lines(run.stderr)
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "dog/3.png" in lines[0]
    assert_consistent(tmp_path / "c")


def test_subprocess_offline_default_vae_is_one_line_saying_what_to_fetch(data_dir, tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "empty_hf_home"),
    }
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sit_vit5.cache_latents",
            "--data-dir",
            str(data_dir),
            "--out",
            str(tmp_path / "c"),
            "--num-workers",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = refused_in_one_line(run)
    assert "stabilityai/sd-vae-ft-ema" in line and "download" in line and "<dir>" in line
    assert not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- the reader


def nan_shard(cache: Path, name: str = "shard_00001.mean.npy") -> None:
    """Overwrite a shard with NaN of the same shape and dtype (same size: only the values tell)."""
    array = np.load(cache / name)
    size = (cache / name).stat().st_size
    np.save(cache / name, np.full_like(array, np.nan))
    assert (cache / name).stat().st_size == size


def test_nan_shard_is_named_not_blamed_on_the_learning_rate(cache, tmp_path, capsys):
    nan_shard(cache)
    dataset = LatentCacheDataset(cache, random_flip=False)
    with pytest.raises(
        CorruptCacheError, match=r"shard_00001\.mean\.npy: row 0 \(image 4, dog/0\.png\)"
    ):
        dataset[4]
    assert torch.isfinite(dataset[0][0]).all()  # the other shards still read
    for workers in (
        0,
        2,
    ):  # a DataLoader worker's error reaches the main process with the same line
        cfg = load_config(
            None,
            [
                *TRAIN_TINY,
                f"data.root={cache}",
                f"data.num_workers={workers}",
                f"train.out_dir={tmp_path / f'run{workers}'}",
            ],
        )
        with pytest.raises(CorruptCacheError) as info:
            train(cfg)
        assert not isinstance(info.value, NonFiniteLossError)
        assert run_cli("train.py", lambda cfg=cfg: train(cfg)) == 2  # what the entry points print
        lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(lines) == 1 and "shard_00001.mean.npy" in lines[0] and "lower" not in lines[0], (
            lines
        )
        assert "Traceback" not in lines[0] and "re-encode" in lines[0]


@pytest.mark.parametrize(
    "name, cut, named",
    [
        (
            "shard_00002.mean.npy",
            500,
            "shard_00002.mean.npy: 500 bytes, its header (float16 [2, 2, 4, 8, 8]) "
            "needs 2176 (truncated)",
        ),
        ("shard_00000.std.npy", 5, "shard_00000.std.npy: not a readable .npy file"),
        ("labels.npy", 140, "labels.npy: 140 bytes"),
    ],
)
def test_truncated_files_are_named_at_open(cache, name, cut, named):
    (cache / name).write_bytes((cache / name).read_bytes()[:cut])
    with pytest.raises(CorruptCacheError, match=re.escape(named)):
        LatentCacheDataset(cache)


def test_missing_shard_and_unreadable_manifest_are_named(cache):
    (cache / "shard_00001.std.npy").unlink()
    with pytest.raises(
        CorruptCacheError, match=naming("shard_00001.std.npy", "shard_00001.done")
    ):
        LatentCacheDataset(cache)
    (cache / "manifest.json").write_text('{"format": "sit_vit5.latent_cache/1", ')
    with pytest.raises(CorruptCacheError, match=naming("manifest.json", "JSON")):
        LatentCacheDataset(cache)


def test_shard_of_another_shape_is_named(cache):
    np.save(
        cache / "shard_00000.mean.npy", np.zeros((4, 2, 4, 4, 4), np.float16)
    )  # another image size
    with pytest.raises(
        CorruptCacheError,
        match=naming("shard_00000.mean.npy", "float16", "[4, 2, 4, 4, 4]", "[4, 2, 4, 8, 8]"),
    ):
        LatentCacheDataset(cache)


def test_cache_of_another_image_size_is_a_one_line_error(cache):
    with pytest.raises(
        CacheMismatchError, match=naming("data.image_size=256", "16px", "data.image_size=16")
    ) as info:
        build_dataset({"kind": "latents", "root": str(cache), "image_size": 256})
    assert isinstance(info.value, SitVit5Error) and isinstance(info.value, ValueError)


def test_verify_pass_finds_nan_and_flipped_bytes(cache, capsys):
    assert cache_latents.cli(["--out", str(cache), "--verify"]) == 0
    assert "verified: 6 shard files" in capsys.readouterr().out
    nan_shard(cache, "shard_00002.std.npy")
    path = cache / "shard_00000.mean.npy"  # one flipped bit: still finite, only the digest tells
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    line = refused(capsys, ["--out", cache, "--verify"])
    assert_names(line, "2", "shard_00000.mean.npy", "SHA-256")
    assert "shard_00002.std.npy" in line


def test_verify_of_an_incomplete_cache_says_how_to_finish_it(cache, capsys):
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["complete"] = False
    (cache / "manifest.json").write_text(json.dumps(manifest))
    line = refused(capsys, ["--out", cache, "--verify"])
    assert_names(line, cache, "sit_vit5.cache_latents", f"--out {cache}")
