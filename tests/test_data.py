"""Datasets: ADM center crop, ImageFolder labels/flips/errors, digits, config dispatch, per-item RNG."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from sit_vit5.datasets import DigitsDataset, item_generator
from sit_vit5.image_data import ImageFolderDataset, UnreadableImageError, center_crop_arr
from sit_vit5.training.data import build_dataset
from sit_vit5.transport.rng import item_seed
from tests.helpers import TRAIN_ARGV, naming, run_train


def _random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _write_folder(root, sizes_by_class: dict[str, list[tuple[int, int]]]) -> dict[str, list]:
    """root/<class>/img_<i>.png with random pixels; returns the written PIL images per class."""
    written = {}
    for c, (name, sizes) in enumerate(sizes_by_class.items()):
        (root / name).mkdir(parents=True)
        written[name] = []
        for i, (w, h) in enumerate(sizes):
            img = _random_image(w, h, seed=100 * c + i)
            img.save(root / name / f"img_{i}.png")
            written[name].append(img)
    return written


# ----------------------------------------------------------------------------- center crop


def test_center_crop_matches_hand_computed_pil_steps():
    img = _random_image(517, 389, seed=0)
    # by hand for target 64: 389 ≥ 128 → BOX to 258×194; 194 ≥ 128 → BOX to 129×97; 97 < 128 stop;
    # scale 64/97 → BICUBIC to (round(129·64/97) = 85) × 64; crop x from (85 − 64)//2 = 10
    expected = (img.resize((258, 194), Image.BOX).resize((129, 97), Image.BOX)
                .resize((85, 64), Image.BICUBIC).crop((10, 0, 74, 64)))
    out = center_crop_arr(img, 64)
    assert out.size == (64, 64)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_center_crop_portrait_without_halving():
    img = _random_image(50, 73, seed=1)
    # short side 50 < 2·32: only BICUBIC by 32/50 → 32 × round(46.72) = 47; crop y from (47 − 32)//2 = 7
    expected = img.resize((32, 47), Image.BICUBIC).crop((0, 7, 32, 39))
    np.testing.assert_array_equal(np.asarray(center_crop_arr(img, 32)), np.asarray(expected))


def test_center_crop_upscales_small_images():
    img = _random_image(10, 12, seed=2)
    expected = img.resize((16, round(12 * 1.6)), Image.BICUBIC).crop((0, 1, 16, 17))  # 19 rows → offset 1
    np.testing.assert_array_equal(np.asarray(center_crop_arr(img, 16)), np.asarray(expected))


# ----------------------------------------------------------------------------- image folder


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    written = _write_folder(root, {"zebra": [(20, 24), (16, 16)], "ant": [(30, 18), (17, 40), (16, 20)]})
    return root, written


def test_imagefolder_labels_follow_sorted_class_names(folder):
    root, written = folder
    ds = ImageFolderDataset(root, 16, random_flip=False)
    assert ds.classes == ["ant", "zebra"] and ds.num_classes == 2 and len(ds) == 5
    assert ds.sample_shape == (3, 16, 16)
    for i in range(len(ds)):
        image, label = ds[i]
        name = ds.classes[label]
        k = int(ds.files[i].split("img_")[1].split(".")[0])
        assert ds.files[i].startswith(name)
        expected = np.asarray(center_crop_arr(written[name][k], 16), dtype=np.float32) / 127.5 - 1
        assert image.shape == (3, 16, 16) and image.dtype == torch.float32
        torch.testing.assert_close(image, torch.from_numpy(expected).permute(2, 0, 1))
        assert image.min() >= -1 and image.max() <= 1


def test_imagefolder_flip_is_deterministic_per_seed_epoch_index(folder):
    root, _ = folder
    plain = ImageFolderDataset(root, 16, random_flip=False)
    flipped = ImageFolderDataset(root, 16, random_flip=True, seed=3)
    seen = set()
    for epoch in range(6):
        flipped.set_epoch(epoch)
        for i in range(len(flipped)):
            image, label = flipped[i]
            original = plain[i][0]
            is_flipped = bool(torch.equal(image, original.flip(-1)))
            assert is_flipped or torch.equal(image, original)
            assert label == plain[i][1]
            # the decision is the first bit drawn from the (seed, epoch, index) generator
            assert is_flipped == bool(torch.randint(2, (1,), generator=item_generator(3, epoch, i)).item())
            seen.add(is_flipped)
            assert torch.equal(flipped[i][0], image)  # same (seed, epoch, index) → same item
    assert seen == {True, False}


def test_imagefolder_survives_pickling_for_workers(folder):
    root, _ = folder
    ds = ImageFolderDataset(root, 16, seed=5)
    ds.set_epoch(2)
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[3][0], ds[3][0])


def test_unreadable_image_error_names_the_file(folder):
    root, _ = folder
    bad = root / "ant" / "broken.png"
    bad.write_bytes(b"this is not a png")
    ds = ImageFolderDataset(root, 16, random_flip=False)
    index = ds.files.index("ant/broken.png")
    with pytest.raises(UnreadableImageError, match="broken.png") as info:
        ds[index]
    assert info.value.path == str(bad)


def test_unreadable_image_is_skipped_and_counted(folder):
    root, _ = folder
    (root / "ant" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    ds = ImageFolderDataset(root, 16, random_flip=False, skip_bad=True)
    index = ds.files.index("ant/broken.png")
    with pytest.warns(UserWarning, match="broken.png"):
        image, label = ds[index]
    assert ds.num_skipped == 1
    assert torch.equal(image, ds.read(index + 1)) and label == int(ds.labels[index + 1])


def test_imagefolder_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        ImageFolderDataset(tmp_path / "missing", 16)
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(FileNotFoundError, match=naming(tmp_path / "flat")):
        ImageFolderDataset(tmp_path / "flat", 16)


# ----------------------------------------------------------------------------- digits


def test_digits_values_labels_and_range():
    ds = DigitsDataset()
    ref = load_digits()
    assert len(ds) == 1797 and ds.num_classes == 10 and ds.sample_shape == (1, 8, 8)
    for i in (0, 1, 500, 1796):
        image, label = ds[i]
        assert image.shape == (1, 8, 8) and label == ref.target[i]
        torch.testing.assert_close(image[0], torch.from_numpy(ref.images[i] / 8.0 - 1.0).float())
    assert ds.images.min() == -1 and ds.images.max() == 1  # pixel values span 0..16


def test_digits_splits_are_disjoint_stratified_and_cover_all():
    train, test, full = DigitsDataset(split="train"), DigitsDataset(split="test"), DigitsDataset()
    assert len(train) + len(test) == len(full)
    # every image of the full set appears in exactly one split (match rows by content and label)
    def keys(ds):
        return sorted((ds.images[i].numpy().tobytes(), int(ds.labels[i])) for i in range(len(ds)))
    assert sorted(keys(train) + keys(test)) == keys(full)
    counts_full, counts_test = np.bincount(full.labels), np.bincount(test.labels)
    np.testing.assert_array_equal(counts_test, np.round(0.2 * counts_full))
    with pytest.raises(ValueError, match="valid: all, train, test"):
        DigitsDataset(split="val")


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_digits_resize(mode):
    ds = DigitsDataset(image_size=16, resize_mode=mode)
    image, _ = ds[7]
    assert image.shape == (1, 16, 16) and ds.images.min() >= -1 and ds.images.max() <= 1
    # closed form of a 2× bilinear upsample (align_corners=False) at the interior pixel (2i+1, 2j+1):
    # 9/16·x[i,j] + 3/16·(x[i+1,j] + x[i,j+1]) + 1/16·x[i+1,j+1]
    if mode == "bilinear":
        x = DigitsDataset()[7][0][0]
        i, j = 3, 4
        expected = (9 * x[i, j] + 3 * (x[i + 1, j] + x[i, j + 1]) + x[i + 1, j + 1]) / 16
        torch.testing.assert_close(image[0, 2 * i + 1, 2 * j + 1], expected)


def test_digits_not_flipped_by_default_and_flip_is_reproducible():
    plain = DigitsDataset()
    assert all(torch.equal(plain[i][0], plain.images[i]) for i in range(50))
    flipping = DigitsDataset(random_flip=True, seed=1)
    flipping.set_epoch(4)
    states = [torch.equal(flipping[i][0], plain.images[i].flip(-1)) for i in range(50)]
    assert any(states) and not all(states)
    assert states == [torch.equal(flipping[i][0], plain.images[i].flip(-1)) for i in range(50)]


# ----------------------------------------------------------------------------- config and RNG


def test_build_dataset_dispatch_and_errors(folder):
    root, _ = folder
    assert isinstance(build_dataset({"kind": "digits", "split": "test"}), DigitsDataset)
    ds = build_dataset({"name": "imagefolder", "root": str(root), "image_size": 16, "random_flip": False})
    assert isinstance(ds, ImageFolderDataset) and len(ds) == 5
    with pytest.raises(ValueError, match="digits, imagefolder, latents"):
        build_dataset({"kind": "cifar"})
    # the whole data section of a config may be passed: other kinds' keys and loader keys are ignored
    ds = build_dataset({"kind": "imagefolder", "root": str(root), "image_size": 8, "split": "all",
                        "resize_mode": "bilinear", "num_workers": 4, "global_batch_size": 256, "seed": 1})
    assert ds.image_size == 8 and ds.seed == 1
    with pytest.raises(KeyError, match="image_size"):
        build_dataset({"kind": "imagefolder", "root": str(root)})


def test_item_seed_depends_on_every_part():
    seeds = {item_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 450  # no collisions on a small grid
    a = torch.randn(4, generator=item_generator(1, 2, 3))
    torch.testing.assert_close(a, torch.randn(4, generator=item_generator(1, 2, 3)), rtol=0, atol=0)


def test_dataloader_workers_reraise_the_unreadable_file(folder):
    root, _ = folder
    (root / "zebra" / "bad.jpg").write_bytes(b"not a jpeg")
    ds = ImageFolderDataset(root, 16, random_flip=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1)
    with pytest.raises(UnreadableImageError, match="zebra/bad.jpg"):
        list(loader)


# ------------------------------------------------------------------------ refusals through train.py


def write_image_folder(root: Path, bad: str | None = None) -> None:
    """root/{a,b}/<i>.png, 8 random 8x8 images per class, and a fake JPEG at root/bad if given."""
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(8):
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i}.png")
    if bad:
        (root / bad).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")


@pytest.mark.parametrize("kind", ["missing", "empty", "unset"])
def test_bad_data_root_is_a_one_line_error(tmp_path, capsys, kind):
    root = tmp_path / "data"
    if kind == "empty":
        root.mkdir()
    argv = [*TRAIN_ARGV, "data.kind=imagefolder", "data.image_size=8",
            f"train.out_dir={tmp_path / 'run'}", "train.steps=2"]
    if kind != "unset":
        argv.append(f"data.root={root}")
    status, line = run_train(argv, capsys)
    assert status == 2 and ("data.root" in line if kind == "unset" else str(root) in line)


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_jpeg_without_skip_bad_names_the_file(tmp_path, capsys, workers):
    root = tmp_path / "data"
    write_image_folder(root, bad="a/broken.jpg")
    argv = [*TRAIN_ARGV, "data.kind=imagefolder", "data.image_size=8", f"data.root={root}",
            f"data.num_workers={workers}", f"train.out_dir={tmp_path / 'run'}", "train.steps=4"]
    status, line = run_train(argv, capsys)
    assert status == 2 and "broken.jpg" in line and "data.skip_bad=true" in line


def test_training_refuses_a_tiny_image_unless_told(tmp_path):
    """data.min_image_side (default 8): a 1x1 image in a training folder is refused, naming the file,
    rather than silently upscaled to the training size; data.min_image_side=0 accepts it."""
    from PIL import Image

    from sit_vit5.config import load_config
    from sit_vit5.image_data import TooSmallImageError
    from sit_vit5.training.data import build_dataset_from_config

    for name, side in (("a/big.png", 16), ("a/tiny.png", 1)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (side, side), (200, 10, 10)).save(tmp_path / name)
    base = ["data.kind=imagefolder", f"data.root={tmp_path}", "data.image_size=8"]
    dataset = build_dataset_from_config(load_config(None, base))
    tiny = dataset.files.index(next(f for f in dataset.files if "tiny" in str(f)))
    with pytest.raises(TooSmallImageError, match=naming("tiny.png", "1x1")):
        dataset.read(tiny)
    assert build_dataset_from_config(load_config(None, [*base, "data.min_image_side=0"])).read(tiny).shape == (3, 8, 8)
