"""Reading sample/reference image sets and ADM reference npz files."""

import numpy as np
import pytest
from PIL import Image

from fid import FeatureStats, InputError, open_images, read_reference, save_reference
from fid.image_sets import images_from_array
from tests.helpers import naming


def _images(n: int, h: int = 6, w: int = 5, c: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, c), dtype=np.uint8)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_streaming_reads_every_row_in_order(tmp_path, save):
    images = _images(10)
    path = tmp_path / "samples.npz"
    save(path, arr_0=images, labels=np.arange(10))
    source = open_images(path)
    assert source.shape == images.shape and len(source) == 10
    np.testing.assert_array_equal(np.concatenate(list(source.batches(3))), images)
    np.testing.assert_array_equal(np.concatenate(list(source.batches(4, limit=7))), images[:7])
    # out-of-order reads reopen the member and skip to the right row
    np.testing.assert_array_equal(source.read(5, 7), images[5:7])
    np.testing.assert_array_equal(source.read(0, 2), images[:2])


def test_npy_and_other_npz_key(tmp_path):
    images = _images(4)
    np.save(tmp_path / "a.npy", images)
    np.testing.assert_array_equal(open_images(tmp_path / "a.npy").read(0, 4), images)
    np.savez(tmp_path / "b.npz", samples=images)
    np.testing.assert_array_equal(open_images(tmp_path / "b.npz", key="samples").read(1, 3), images[1:3])


def test_image_folder_sorted_recursive_and_rgb(tmp_path):
    images = _images(3)
    (tmp_path / "sub").mkdir()
    Image.fromarray(images[0]).save(tmp_path / "a.png")
    Image.fromarray(images[1]).save(tmp_path / "b.png")
    Image.fromarray(images[2]).save(tmp_path / "sub" / "c.png")
    Image.fromarray(images[0][..., 0]).save(tmp_path / "sub" / "d.png")  # grayscale → RGB copies
    (tmp_path / "notes.txt").write_text("ignored")
    source = open_images(tmp_path)
    got = np.concatenate(list(source.batches(2)))
    assert got.shape == (4, 6, 5, 3)
    np.testing.assert_array_equal(got[:3], images)
    np.testing.assert_array_equal(got[3], np.repeat(images[0][..., :1], 3, axis=2))


def test_image_folder_size_mismatch_names_the_file(tmp_path):
    Image.fromarray(_images(1)[0]).save(tmp_path / "a.png")
    Image.fromarray(_images(1, h=7)[0]).save(tmp_path / "b.png")
    with pytest.raises(InputError, match="b.png"):
        list(open_images(tmp_path).batches(8))


def test_validation_messages(tmp_path):
    np.savez(tmp_path / "float.npz", arr_0=np.zeros((2, 4, 4, 3), np.float32))
    with pytest.raises(InputError, match="uint8.*127.5"):
        open_images(tmp_path / "float.npz")
    np.savez(tmp_path / "nchw.npz", arr_0=np.zeros((2, 3, 4, 4), np.uint8))
    with pytest.raises(InputError, match="NCHW"):
        open_images(tmp_path / "nchw.npz")
    np.savez(tmp_path / "flat.npz", arr_0=np.zeros((2, 4, 4), np.uint8))
    with pytest.raises(InputError, match=r"4-D"):
        open_images(tmp_path / "flat.npz")
    with pytest.raises(InputError, match=naming("key.npz", "'arr_0'", "['x']")):
        np.savez(tmp_path / "key.npz", x=np.zeros(1))
        open_images(tmp_path / "key.npz")
    with pytest.raises(InputError, match=naming("missing.npz")):
        open_images(tmp_path / "missing.npz")
    (tmp_path / "x.h5").write_bytes(b"")
    with pytest.raises(InputError, match="unsupported"):
        open_images(tmp_path / "x.h5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=naming("empty", ".png")):
        open_images(tmp_path / "empty")
    with pytest.raises(InputError, match="C in \\(1, 3\\)"):
        images_from_array(np.zeros((2, 4, 4, 2), np.uint8), channels=(1, 3))


def _stats(seed: int = 0) -> FeatureStats:
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(6, 6)), rng.normal(size=(4, 4))
    return FeatureStats(rng.normal(size=6), a @ a.T, rng.normal(size=4), b @ b.T)


def test_reference_npz_round_trip(tmp_path):
    stats, images = _stats(), _images(5)
    save_reference(tmp_path / "ref.npz", stats, images)
    ref = read_reference(tmp_path / "ref.npz")
    for key in ("mu", "sigma", "mu_s", "sigma_s"):
        assert getattr(ref.stats, key).dtype == np.float64
        np.testing.assert_array_equal(getattr(ref.stats, key), getattr(stats, key))
    np.testing.assert_array_equal(ref.images.read(0, 5), images)
    with np.load(tmp_path / "ref.npz") as f:  # exactly the ADM key set
        assert sorted(f.files) == ["arr_0", "mu", "mu_s", "sigma", "sigma_s"]


def test_reference_variants_and_errors(tmp_path):
    save_reference(tmp_path / "stats_only.npz", _stats())
    ref = read_reference(tmp_path / "stats_only.npz")
    assert ref.stats is not None and ref.images is None
    np.savez(tmp_path / "images_only.npz", arr_0=_images(3))
    ref = read_reference(tmp_path / "images_only.npz")
    assert ref.stats is None and len(ref.images) == 3
    s = _stats()
    np.savez(tmp_path / "partial.npz", mu=s.mu, sigma=s.sigma)
    with pytest.raises(InputError, match=r"missing \['mu_s', 'sigma_s'\]"):
        read_reference(tmp_path / "partial.npz")
    with pytest.raises(InputError, match=naming("VIRTUAL_imagenet256_labeled.npz")):
        read_reference(tmp_path / "VIRTUAL_imagenet256_labeled.npz")
    np.savez(tmp_path / "neither.npz", foo=np.zeros(2))
    with pytest.raises(InputError, match=naming("neither.npz", "'mu'", "'arr_0'", "['foo']")):
        read_reference(tmp_path / "neither.npz")
    np.savez(tmp_path / "badshape.npz", mu=s.mu, sigma=s.sigma[:3], mu_s=s.mu_s, sigma_s=s.sigma_s)
    with pytest.raises(InputError, match="sigma"):
        read_reference(tmp_path / "badshape.npz")
