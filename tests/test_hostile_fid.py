"""Hostile inputs to ``python -m fid``: samples that do not match the reference (size, colour),
Ctrl-C, a failed write. Each ends in exit 2 (130 for Ctrl-C) with one stderr line
``python -m fid: error: ...`` naming the file and value, no traceback, and no result file lost or
half-written."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fid.__main__ as cli
import fid.digits
import fid.reference
from fid import InputError
from tests.helpers import assert_names, refused_in_one_line
from tests.test_fid_cli import FakeExtractor

ROOT = Path(__file__).resolve().parents[1]


def gray(n: int, side: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    image = np.random.default_rng(seed).integers(0, 256, (n, side, side, 1), dtype=np.uint8)
    return np.repeat(image, channels, axis=3)


def refused(capsys, argv, status=2, prog="python -m fid") -> str:
    assert cli.main([str(a) for a in argv]) == status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note: ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: " if status == 2 else f"{prog}: interrupted"), lines
    return lines[0]


@pytest.fixture
def fake_digits(monkeypatch):
    """digits_metrics replaced by a recorder (the real network is tested in test_fid_digits.py)."""
    seen = []

    def metrics(images, labels=None, net=None):
        seen.append(images)
        return {"digits_fid": 1.0, "num_samples": images.shape[0]}

    monkeypatch.setattr(fid.digits, "digits_metrics", metrics)
    # these tests evaluate a dozen images: the refusal of too few samples is tested with the real
    # dimensions in test_fid_cli_fast.py
    monkeypatch.setattr(cli, "FEATURE_DIMS", dict.fromkeys(cli.FEATURE_DIMS, 4))
    return seen


@pytest.fixture
def fake_network(monkeypatch):
    monkeypatch.setattr(cli, "load_inception", lambda *args, **kwargs: FakeExtractor())
    # these tests evaluate a dozen images: the refusal of too few samples is tested with the real
    # dimensions in test_fid_cli_fast.py
    monkeypatch.setattr(cli, "FEATURE_DIMS", dict.fromkeys(cli.FEATURE_DIMS, 4))


def test_16x16_samples_against_digits_need_the_resize_flag(tmp_path, capsys, fake_digits):
    path = tmp_path / "s16.npz"
    np.savez(path, arr_0=gray(12, 16))
    line = refused(
        capsys, [path, "digits"]
    )  # used to print a digits FID (area-downsampled) and exit 0
    assert_names(line, f"{path}[arr_0]", "16x16", "8x8")
    assert "--resize-samples" in line and not fake_digits
    assert not (tmp_path / "s16.metrics.json").exists()
    assert (
        cli.main([str(path), "digits", "--resize-samples"]) == 0
    )  # asked for: evaluated as before
    assert fake_digits[0].shape == (12, 1, 16, 16)


def test_colour_samples_against_digits_are_refused_gray_ones_accepted(
    tmp_path, capsys, fake_digits
):
    colour = tmp_path / "colour.npz"
    np.savez(colour, arr_0=np.random.default_rng(0).integers(0, 256, (12, 8, 8, 3), dtype=np.uint8))
    line = refused(capsys, [colour, "digits", "--no-json"])  # used to be averaged to gray silently
    assert (
        f"{colour}[arr_0]" in line and "image 0" in line and not fake_digits
    )
    for channels in (
        1,
        3,
    ):  # the digits reference is gray: one channel or sample.py's three equal ones
        np.savez(tmp_path / f"g{channels}.npz", arr_0=gray(12, 8, channels))
        assert cli.main([str(tmp_path / f"g{channels}.npz"), "digits", "--no-json"]) == 0
    assert len(fake_digits) == 2 and (fake_digits[0] == fake_digits[1]).all()


def test_samples_of_another_size_than_the_reference_images(tmp_path, capsys, fake_network):
    np.savez(tmp_path / "ref.npz", arr_0=gray(30, 8))
    np.savez(tmp_path / "s16.npz", arr_0=gray(24, 16, seed=1))
    line = refused(capsys, [tmp_path / "s16.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "16x16x3" in line and "8x8x3" in line
    assert "--resize-samples" in line and not (tmp_path / "s16.metrics.json").exists()
    assert (
        cli.main(
            [
                str(tmp_path / "s16.npz"),
                str(tmp_path / "ref.npz"),
                "--metrics",
                "fid",
                "--resize-samples",
                "--device",
                "cpu",
            ]
        )
        == 0
    )


def test_statistics_only_reference_notes_the_unchecked_size(tmp_path, capsys, fake_network):
    np.savez(tmp_path / "imgs.npz", arr_0=gray(30, 8))
    assert (
        cli.main(
            [
                "make-reference",
                str(tmp_path / "imgs.npz"),
                str(tmp_path / "ref.npz"),
                "--device",
                "cpu",
                "--pr-images",
                "5",
            ]
        )
        == 0
    )
    with np.load(tmp_path / "ref.npz") as f:
        np.savez(tmp_path / "stats.npz", **{k: f[k] for k in ("mu", "sigma", "mu_s", "sigma_s")})
    np.savez(tmp_path / "s16.npz", arr_0=gray(24, 16, seed=1))
    capsys.readouterr()
    assert (
        cli.main(
            [
                str(tmp_path / "s16.npz"),
                str(tmp_path / "stats.npz"),
                "--metrics",
                "fid",
                "--device",
                "cpu",
                "--no-json",
            ]
        )
        == 0
    )
    assert (
        "16x16" in capsys.readouterr().err
    )


def test_ctrl_c_is_one_line_130_and_writes_nothing(tmp_path, capsys, fake_network, monkeypatch):
    np.savez(tmp_path / "ref.npz", arr_0=gray(30, 8))
    np.savez(tmp_path / "s.npz", arr_0=gray(24, 8, seed=1))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "evaluate", interrupted)
    line = refused(
        capsys, [tmp_path / "s.npz", tmp_path / "ref.npz", "--device", "cpu"], status=130
    )
    assert line == "python -m fid: interrupted; nothing was written"
    assert not (tmp_path / "s.metrics.json").exists()


def test_debug_env_shows_the_exception(tmp_path, monkeypatch):
    np.savez(tmp_path / "s16.npz", arr_0=gray(12, 16))
    monkeypatch.setenv("SIT_VIT5_DEBUG", "1")
    with pytest.raises(InputError, match="16x16"):
        cli.main([str(tmp_path / "s16.npz"), "digits"])


def test_a_failed_results_write_keeps_the_old_file_whole(
    tmp_path, capsys, fake_digits, monkeypatch
):
    np.savez(tmp_path / "s.npz", arr_0=gray(12, 8))
    out = tmp_path / "s.metrics.json"
    out.write_text('{"metrics": "the previous run"}\n')
    real = Path.write_text

    def disk_full(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)  # half of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    line = refused(capsys, [tmp_path / "s.npz", "digits"])
    assert f"--out {out}" in line and "No space left on device" in line  # the OS's words
    monkeypatch.setattr(Path, "write_text", real)
    assert json.loads(out.read_text()) == {"metrics": "the previous run"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.metrics.json", "s.npz"]


def test_a_failed_reference_write_keeps_the_old_reference(
    tmp_path, capsys, fake_network, monkeypatch
):
    np.savez(tmp_path / "imgs.npz", arr_0=gray(30, 8))
    old = tmp_path / "ref.npz"
    old.write_bytes(b"the previous reference")

    def disk_full(file, **arrays):
        file.write(b"PK\x03\x04 half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fid.reference.np, "savez", disk_full)
    line = refused(
        capsys,
        ["make-reference", tmp_path / "imgs.npz", old, "--device", "cpu"],
        prog="python -m fid make-reference",
    )
    assert "No space left on device" in line
    assert old.read_bytes() == b"the previous reference"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs.npz", "ref.npz"]


def test_subprocess_size_mismatch_prints_no_traceback(tmp_path):
    np.savez(tmp_path / "s16.npz", arr_0=gray(12, 16))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "fid", str(tmp_path / "s16.npz"), "digits"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = refused_in_one_line(run)
    assert line.startswith("python -m fid: error: ") and "16x16" in line
