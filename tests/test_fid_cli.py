"""evaluate(), make_reference() and the CLI, wired to a cheap stand-in feature network (the real Inception
pipeline is exercised end to end in test_fid_inception.py)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import fid
import fid.__main__ as cli
from fid import FeatureStats, InputError, evaluate, images_from_array, make_reference, read_reference
from tests.helpers import assert_names, naming, one_error_line


class FakeExtractor:
    """Same interface as InceptionFeatures: uint8 [N, 3, H, W] → pool / spatial / logits; counts images seen."""

    def __init__(self):
        self.images_seen = 0

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        assert images.dtype == torch.uint8 and images.shape[1] == 3
        self.images_seen += images.shape[0]
        x = images.float() / 255
        pool = torch.stack([x.mean((1, 2, 3)), x[:, 0].mean((1, 2)), x[:, 1].std((1, 2)), x[:, 2].amax((1, 2))], 1)
        return {"pool": pool, "spatial": F.adaptive_avg_pool2d(x, 2).flatten(1), "logits": 20 * x.flatten(1)[:, :5]}


def _features(images: np.ndarray) -> dict[str, np.ndarray]:
    out = FakeExtractor()(torch.from_numpy(images).permute(0, 3, 1, 2))
    return {k: v.numpy() for k, v in out.items()}


def _image_sets():
    rng = np.random.default_rng(0)
    samples = rng.integers(0, 256, (24, 8, 8, 3), dtype=np.uint8)
    refs = rng.integers(40, 256, (30, 8, 8, 3), dtype=np.uint8)
    return samples, refs


def test_make_reference_statistics_and_subset(tmp_path):
    _, refs = _image_sets()
    stats, kept = make_reference(
        images_from_array(refs), FakeExtractor(), tmp_path / "ref.npz", pr_images=7, batch_size=4
    )
    expected = FeatureStats.from_features(_features(refs))
    np.testing.assert_allclose(stats.sigma, expected.sigma, rtol=1e-12)
    np.testing.assert_allclose(stats.mu_s, expected.mu_s, rtol=1e-12)
    # the kept images are 7 distinct reference images, in their original order
    rows = [int(np.flatnonzero((refs == im).all(axis=(1, 2, 3)))[0]) for im in kept]
    assert len(rows) == 7 and rows == sorted(set(rows))
    ref = read_reference(tmp_path / "ref.npz")
    np.testing.assert_array_equal(ref.images.read(0, 7), kept)
    np.testing.assert_array_equal(ref.stats.sigma_s, stats.sigma_s)


def test_evaluate_matches_direct_computation(tmp_path):
    samples, refs = _image_sets()
    make_reference(images_from_array(refs), FakeExtractor(), tmp_path / "ref.npz")
    extractor = FakeExtractor()
    got = evaluate(
        images_from_array(samples),
        read_reference(tmp_path / "ref.npz"),
        extractor,
        splits=4,
        batch_size=5,
        num_samples=20,
    )
    s, r = _features(samples[:20]), _features(refs)
    ss, rs = FeatureStats.from_features(s), FeatureStats.from_features(r)
    assert got["fid"] == pytest.approx(fid.frechet_distance(ss.mu, ss.sigma, rs.mu, rs.sigma), rel=1e-6)
    assert got["sfid"] == pytest.approx(fid.frechet_distance(ss.mu_s, ss.sigma_s, rs.mu_s, rs.sigma_s), rel=1e-6)
    is_mean, is_std = fid.inception_score(s["logits"], 4)
    assert (got["inception_score"], got["inception_score_std"]) == pytest.approx((is_mean, is_std), rel=1e-9)
    assert (got["precision"], got["recall"]) == pytest.approx(fid.precision_recall(r["pool"], s["pool"]))
    assert got["num_samples"] == 20 and got["num_reference_images"] == 30
    assert extractor.images_seen == 20 + 30
    # without stored statistics they are computed from the reference images: same FID
    np.savez(tmp_path / "images_only.npz", arr_0=refs)
    got2 = evaluate(
        images_from_array(samples),
        read_reference(tmp_path / "images_only.npz"),
        FakeExtractor(),
        metrics=["fid"],
        num_samples=20,
    )
    assert got2["fid"] == pytest.approx(got["fid"], rel=1e-9) and set(got2) == {
        "fid",
        "num_samples",
        "num_reference_images",
    }


def test_evaluate_stats_only_reference_reads_no_reference_images(tmp_path):
    samples, refs = _image_sets()
    stats, _ = make_reference(images_from_array(refs), FakeExtractor())
    fid.save_reference(tmp_path / "stats.npz", stats)
    extractor = FakeExtractor()
    got = evaluate(
        images_from_array(samples), read_reference(tmp_path / "stats.npz"), extractor, metrics=["fid", "sfid"]
    )
    assert extractor.images_seen == 24 and got["num_reference_images"] == 0
    with pytest.raises(InputError, match=naming("stats.npz", "'arr_0'", "'pr'", "--metrics")):
        evaluate(images_from_array(samples), read_reference(tmp_path / "stats.npz"), extractor, metrics=["pr"])


def test_evaluate_input_checks(tmp_path):
    samples, refs = _image_sets()
    np.savez(tmp_path / "ref.npz", arr_0=refs)
    ref = read_reference(tmp_path / "ref.npz")
    with pytest.raises(InputError, match=naming("['kid']", "['fid', 'sfid', 'is', 'pr']")):
        evaluate(images_from_array(samples), ref, FakeExtractor(), metrics=["fid", "kid"])
    with pytest.raises(InputError, match=naming("--num-samples 25", "24")):
        evaluate(images_from_array(samples), ref, FakeExtractor(), num_samples=25)
    with pytest.raises(InputError, match=naming("9", "['is']", "10")):
        evaluate(images_from_array(samples[:9]), ref, FakeExtractor(), metrics=["is"])
    np.savez(tmp_path / "tiny_ref.npz", arr_0=refs[:3])
    with pytest.raises(InputError, match=naming("tiny_ref.npz", "3", "'pr'")):
        evaluate(images_from_array(samples), read_reference(tmp_path / "tiny_ref.npz"), FakeExtractor(), metrics=["pr"])


@pytest.fixture
def fake_network(monkeypatch):
    monkeypatch.setattr(cli, "load_inception", lambda *args, **kwargs: FakeExtractor())
    # these tests evaluate a dozen images: the refusal of too few samples is tested with the real
    # dimensions in test_fid_cli_fast.py
    monkeypatch.setattr(cli, "FEATURE_DIMS", dict.fromkeys(cli.FEATURE_DIMS, 4))


def test_cli_prints_table_and_writes_json(tmp_path, fake_network, capsys):
    samples, refs = _image_sets()
    np.savez(tmp_path / "samples.npz", arr_0=samples)
    assert cli.main(["make-reference", str(tmp_path / "refs.npz"), str(tmp_path / "out_ref.npz")]) == 2  # missing
    np.savez(tmp_path / "refs.npz", arr_0=refs)
    assert cli.main(["make-reference", str(tmp_path / "refs.npz"), str(tmp_path / "ref.npz"), "--device", "cpu"]) == 0
    rc = cli.main(
        [
            str(tmp_path / "samples.npz"),
            str(tmp_path / "ref.npz"),
            "--metrics",
            "fid,pr",
            "--device",
            "cpu",
            "--batch-size",
            "7",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "FID" in out and "Precision" in out and "Recall" in out
    record = json.loads((tmp_path / "samples.metrics.json").read_text())
    expected = evaluate(
        images_from_array(samples), read_reference(tmp_path / "ref.npz"), FakeExtractor(), metrics=["fid", "pr"]
    )
    assert record["metrics"] == pytest.approx(expected)
    assert record["inception_weights"]["official"] is True and "torch_fidelity" in record["versions"]


def test_cli_bad_input_exits_2_with_message(tmp_path, fake_network, capsys):
    np.savez(tmp_path / "float.npz", arr_0=np.zeros((12, 8, 8, 3), np.float32))
    np.savez(tmp_path / "ref.npz", arr_0=np.zeros((12, 8, 8, 3), np.uint8))
    assert cli.main([str(tmp_path / "float.npz"), str(tmp_path / "ref.npz")]) == 2
    err = capsys.readouterr().err
    assert "float.npz" in err and "uint8" in err
    np.savez(tmp_path / "ok.npz", arr_0=np.zeros((12, 8, 8, 3), np.uint8))
    assert cli.main([str(tmp_path / "ok.npz"), str(tmp_path / "ref.npz"), "--metrics", "fid,foo"]) == 2
    assert_names(capsys.readouterr().err, "foo", "fid")
    assert cli.main([str(tmp_path / "ok.npz"), str(tmp_path / "ref.npz"), "--batch-size", "0"]) == 2
    assert not (tmp_path / "ok.metrics.json").exists()


# --------------------------------------------------------------------- bad inputs: one line, exit 2


def fid_main(argv, capsys) -> tuple[int, str]:
    """``python -m fid argv``: (exit status, its one error line, or "" when it succeeded)."""
    status = cli.main([str(a) for a in argv])
    return status, one_error_line(capsys) if status else ""


def digits_images(n=12) -> np.ndarray:
    """n random 8x8 one-channel uint8 images (n, 8, 8, 1)."""
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8, 1), dtype=np.uint8)


@pytest.mark.parametrize("labels, named", [
    (np.arange(12) + 5, ("[0, 10)", "index 5: 10")),  # used to print accuracy 0.0 and exit 0
    (np.full(12, -1), ("[0, 10)", "index 0: -1")),
    (np.array([str(i % 10) for i in range(12)]), ("dtype <U1", "'0'")),
    (np.arange(12) % 10 + 0.5, ("dtype float64", "0.5")),
    (np.arange(5), ("5", "12")),
])
def test_fid_digits_label_checks(tmp_path, capsys, labels, named):
    path = tmp_path / "samples.npz"
    np.savez(path, arr_0=digits_images(), labels=labels)
    status, line = fid_main([path, "digits"], capsys)
    assert status == 2
    assert_names(line, f"{path}[labels]", *named)


def test_fid_valid_labels_pass_the_check(tmp_path):
    path = tmp_path / "samples.npz"
    np.savez(path, arr_0=digits_images(), labels=(np.arange(12) % 10).astype(np.float32))
    np.testing.assert_array_equal(cli.read_labels(path, 12), np.arange(12) % 10)


def test_fid_zero_image_npz(tmp_path, capsys):
    path = tmp_path / "empty.npz"
    np.savez(path, arr_0=np.zeros((0, 8, 8, 3), np.uint8))
    for reference in ("digits", path):
        status, line = fid_main([path, reference, "--no-json"], capsys)
        assert status == 2 and f"{path}[arr_0]" in line


@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_fid_object_array_is_named_and_never_unpickled(tmp_path, capsys, suffix):
    path = tmp_path / f"objects{suffix}"
    array = np.array([{"a": 1}, None], dtype=object)
    np.savez(path, arr_0=array) if suffix == ".npz" else np.save(path, array)
    status, line = fid_main([path, "digits", "--no-json"], capsys)
    assert status == 2 and str(path) in line and "object" in line


def test_fid_corrupt_image_in_folder_is_named(tmp_path, capsys):
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, image in enumerate(digits_images(3)):
        Image.fromarray(image[..., 0]).save(folder / f"{i}.png")
    (folder / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    status, line = fid_main([folder, "digits", "--no-json"], capsys)
    assert status == 2 and str(folder / "3.png") in line


def test_fid_unwritable_out_is_refused_before_the_work(tmp_path, capsys):
    path = tmp_path / "samples.npz"
    np.savez(path, arr_0=digits_images())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status, line = fid_main([path, "digits", "--out", blocker / "m.json"], capsys)
    assert status == 2 and "--out" in line and str(blocker) in line
