"""Issue 40 part 4, evaluation side: ``python -m fid``'s JSON says how the samples were made (from
the bulk npz's metadata_json, else "unknown" / null), and a reference whose classes or sample count
do not fit the samples is refused in one line naming both files."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pytest

import fid.__main__ as cli
import fid.digits
from fid import provenance
from sit_vit5.sampling import METADATA_KEY, SampleSpec, sample_bulk
from tests.test_fid_cli import FakeExtractor
from tests.test_hostile_fid import refused
from tests.test_sampling import pipeline

pytestmark = pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")  # 4-d fake features of gray images

#: the fields issue 40 asks every FID JSON to hold
FIELDS = ("label_sampling", "class_histogram", "sampler", "nfe_per_image", "cfg_scale",
          "cfg_interval", "precision", "checkpoint_sha256", "reference_sha256", "num_samples")


@pytest.fixture
def fake_network(monkeypatch):
    monkeypatch.setattr(cli, "load_inception", lambda *args, **kwargs: FakeExtractor())
    monkeypatch.setattr(cli, "FEATURE_DIMS", dict.fromkeys(cli.FEATURE_DIMS, 4))


def images(n: int, seed: int = 0, side: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def evaluate(samples, reference, *extra) -> dict:
    """``python -m fid samples reference --metrics fid`` on the CPU: its JSON record."""
    assert cli.main([str(samples), str(reference), "--metrics", "fid", "--device", "cpu",
                     *map(str, extra)]) == 0
    return json.loads(samples.with_name(samples.stem + ".metrics.json").read_text())


@pytest.fixture(scope="module")
def bulk_npz(tmp_path_factory):
    """A 20-sample bulk npz of the tiny 10-class model: equal labels, SDE, CFG 1.5 in [0.1, 0.9]."""
    spec = SampleSpec(method="sde", sampling_method="Euler", num_steps=4, cfg_scale=1.5,
                      cfg_interval=(0.1, 0.9))
    out = tmp_path_factory.mktemp("bulk")
    return sample_bulk(pipeline(spec), 20, out, global_seed=1, batch_size=10, progress=False,
                       label_sampling="equal", settings={"checkpoint_sha256": "cd" * 32}).npz


def test_the_json_holds_every_field_from_the_bulk_metadata(tmp_path, bulk_npz, fake_network):
    samples = tmp_path / "samples.npz"
    samples.write_bytes(bulk_npz.read_bytes())
    np.savez(tmp_path / "ref.npz", arr_0=images(30))
    record = evaluate(samples, tmp_path / "ref.npz")
    assert set(FIELDS) <= set(record)
    with np.load(samples, allow_pickle=False) as f:
        meta, labels = json.loads(str(f[METADATA_KEY])), f["arr_1"]
    assert record["label_sampling"] == "equal" and record["num_samples"] == 20
    assert record["class_histogram"] == [Counter(labels.tolist())[c] for c in range(10)] == [2] * 10
    assert record["sampler"] == {"method": "sde", "solver": "Euler", "num_steps": 4}
    assert (record["cfg_scale"], record["cfg_interval"]) == (1.5, [0.1, 0.9])
    assert record["nfe_per_image"] == meta["nfe_per_image"] == 4
    assert (record["precision"], record["checkpoint_sha256"]) == ("fp32", "cd" * 32)
    ref_digest = hashlib.sha256((tmp_path / "ref.npz").read_bytes()).hexdigest()
    assert record["reference_sha256"] == ref_digest and record["sample_metadata"] == meta
    assert record["metrics"]["num_samples"] == 20


def test_the_first_n_of_an_equal_file_are_counted_and_noted(tmp_path, bulk_npz, fake_network,
                                                            capsys):
    samples = tmp_path / "samples.npz"
    samples.write_bytes(bulk_npz.read_bytes())
    np.savez(tmp_path / "ref.npz", arr_0=images(30))
    record = evaluate(samples, tmp_path / "ref.npz", "--num-samples", 12)
    with np.load(samples) as f:
        first = f["arr_1"][:12].tolist()
    assert record["class_histogram"] == [first.count(c) for c in range(10)]
    assert (record["num_samples"], record["num_samples_in_file"]) == (12, 20)
    assert "its first 12 do not" in capsys.readouterr().err


def test_old_npz_files_evaluate_with_unknown_fields(tmp_path, fake_network):
    np.savez(tmp_path / "ref.npz", arr_0=images(30))
    labels = np.random.default_rng(1).integers(0, 7, 24)
    np.savez(tmp_path / "labelled.npz", arr_0=images(24, 2), arr_1=labels)
    record = evaluate(tmp_path / "labelled.npz", tmp_path / "ref.npz")
    assert record["label_sampling"] == "unknown" and record["sample_metadata"] is None
    counts = Counter(labels.tolist())
    assert record["class_histogram"] == [counts[c] for c in range(max(counts) + 1)]
    for key in provenance.METADATA_FIELDS:
        assert record[key] is None, key
    np.savez(tmp_path / "bare.npz", arr_0=images(24, 2))
    record = evaluate(tmp_path / "bare.npz", tmp_path / "ref.npz")
    assert (record["label_sampling"], record["class_histogram"]) == ("unknown", None)
    assert record["num_samples"] == 24 and len(record["reference_sha256"]) == 64


# --------------------------------------------------------------------- reference mismatches


def test_sample_classes_outside_the_reference_labels_are_refused(tmp_path, fake_network, capsys):
    np.savez(tmp_path / "ref.npz", arr_0=images(30), arr_1=np.arange(30) % 5)
    np.savez(tmp_path / "s.npz", arr_0=images(24, 1), arr_1=np.arange(24) % 8)
    line = refused(capsys, [tmp_path / "s.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "s.npz" in line and "ref.npz" in line and "0..4" in line and "(5, 6, 7)" in line
    assert not (tmp_path / "s.metrics.json").exists()
    # a reference that happens to lack a class inside its range is no mismatch (10K of 1000)
    np.savez(tmp_path / "gappy.npz", arr_0=images(30), arr_1=np.array([0, 1, 2, 4, 7] * 6))
    np.savez(tmp_path / "ok.npz", arr_0=images(24, 1), arr_1=np.arange(24) % 8)
    assert evaluate(tmp_path / "ok.npz", tmp_path / "gappy.npz")["class_histogram"] == [3] * 8


def test_a_model_that_cannot_make_every_reference_class_is_refused(tmp_path, bulk_npz,
                                                                   fake_network, capsys):
    np.savez(tmp_path / "ref.npz", arr_0=images(30), arr_1=np.arange(30) % 12)
    samples = tmp_path / "samples.npz"
    samples.write_bytes(bulk_npz.read_bytes())  # a 10-class model's labels all lie in 0..11
    line = refused(capsys, [samples, tmp_path / "ref.npz", "--metrics", "fid"])
    assert "10 classes" in line and "0..11" in line and "ref.npz" in line
    np.savez(tmp_path / "ref10.npz", arr_0=images(30), arr_1=np.arange(30) % 10)
    assert evaluate(samples, tmp_path / "ref10.npz")["label_sampling"] == "equal"


def test_a_reference_for_another_sample_count_is_refused(tmp_path, fake_network, capsys):
    np.savez(tmp_path / "imgs.npz", arr_0=images(30))
    assert cli.main(["make-reference", str(tmp_path / "imgs.npz"), str(tmp_path / "ref.npz"),
                     "--device", "cpu", "--num-samples", "20"]) == 0
    capsys.readouterr()
    np.savez(tmp_path / "s.npz", arr_0=images(24, 1))
    line = refused(capsys, [tmp_path / "s.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "24 samples" in line and "ref.npz" in line and "is for 20" in line
    assert "--num-samples" in line and not (tmp_path / "s.metrics.json").exists()
    assert evaluate(tmp_path / "s.npz", tmp_path / "ref.npz", "--num-samples", 20)["num_samples"] == 20
    # ADM's way: a reference without a recorded count takes any count (10K images vs 50K samples)
    np.savez(tmp_path / "adm.npz", arr_0=images(10))
    assert evaluate(tmp_path / "s.npz", tmp_path / "adm.npz")["num_samples"] == 24


def test_statistics_only_reference_checks_its_recorded_image_size(tmp_path, fake_network, capsys):
    np.savez(tmp_path / "imgs.npz", arr_0=images(30))
    assert cli.main(["make-reference", str(tmp_path / "imgs.npz"), str(tmp_path / "ref.npz"),
                     "--device", "cpu"]) == 0
    capsys.readouterr()
    with np.load(tmp_path / "ref.npz") as f:
        recorded = json.loads(str(f[METADATA_KEY]))
        np.savez(tmp_path / "stats.npz", **{k: f[k] for k in f.files if k != "arr_0"})
    assert (recorded["image_shape"], recorded["num_images"], recorded["num_samples"]) == ([8, 8, 3], 30, None)
    np.savez(tmp_path / "s16.npz", arr_0=images(24, 1, side=16))
    line = refused(capsys, [tmp_path / "s16.npz", tmp_path / "stats.npz", "--metrics", "fid"])
    assert "16x16x3" in line and "8x8x3" in line and "stats.npz" in line


def test_metadata_that_does_not_describe_its_file_is_refused(tmp_path, bulk_npz, fake_network,
                                                            capsys):
    np.savez(tmp_path / "ref.npz", arr_0=images(30))
    with np.load(bulk_npz) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays[METADATA_KEY]))
    np.savez(tmp_path / "cut.npz", **{**arrays, "arr_0": arrays["arr_0"][:15], "arr_1": arrays["arr_1"][:15]})
    line = refused(capsys, [tmp_path / "cut.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "cut.npz[metadata_json]" in line and "num_samples=20" in line and "15 images" in line
    relabelled = np.roll(arrays["arr_1"], 1)
    relabelled[0] = (relabelled[0] + 1) % 10
    np.savez(tmp_path / "relabelled.npz", **{**arrays, "arr_1": relabelled})
    line = refused(capsys, [tmp_path / "relabelled.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "relabelled.npz[metadata_json]" in line and "class_histogram" in line
    np.savez(tmp_path / "garbled.npz", **{**arrays, METADATA_KEY: np.array("{not json")})
    line = refused(capsys, [tmp_path / "garbled.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "garbled.npz[metadata_json]" in line and "JSON" in line
    np.savez(tmp_path / "short.npz", **{**arrays, "arr_1": arrays["arr_1"][:19]})
    line = refused(capsys, [tmp_path / "short.npz", tmp_path / "ref.npz", "--metrics", "fid"])
    assert "19 class labels for 20 images" in line
    assert meta["num_samples"] == 20 and not list(tmp_path.glob("*.metrics.json"))


def test_digits_refuses_a_model_of_fewer_classes_and_records_the_fields(tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(fid.digits, "digits_metrics", lambda images, labels=None, net=None: {"digits_fid": 1.0})
    monkeypatch.setattr(cli, "FEATURE_DIMS", dict.fromkeys(cli.FEATURE_DIMS, 4))
    gray = np.repeat(images(12)[..., :1], 3, axis=3)
    meta = {"num_samples": 12, "num_classes": 5, "label_sampling": "random", "precision": "bf16"}
    np.savez(tmp_path / "five.npz", arr_0=gray, arr_1=np.arange(12) % 5, metadata_json=np.array(json.dumps(meta)))
    line = refused(capsys, [tmp_path / "five.npz", "digits"])
    assert "5 classes" in line and "0..9" in line and "digits" in line
    meta["num_classes"] = 10
    np.savez(tmp_path / "ten.npz", arr_0=gray, arr_1=np.arange(12) % 5, metadata_json=np.array(json.dumps(meta)))
    assert cli.main([str(tmp_path / "ten.npz"), "digits"]) == 0
    record = json.loads((tmp_path / "ten.metrics.json").read_text())
    assert set(FIELDS) <= set(record) and record["reference_sha256"] is None
    assert (record["label_sampling"], record["precision"]) == ("random", "bf16")
    assert record["class_histogram"] == [3, 3, 2, 2, 2, 0, 0, 0, 0, 0]


def test_the_metadata_key_copy_equals_its_source():
    from sit_vit5.sampling import bulk

    assert provenance.METADATA_KEY == bulk.METADATA_KEY == METADATA_KEY


def test_a_reference_arr_1_that_is_not_labels_is_noted_not_refused(tmp_path, fake_network, capsys):
    np.savez(tmp_path / "ref.npz", arr_0=images(30), arr_1=np.zeros((30, 2)) + 0.5)
    np.savez(tmp_path / "s.npz", arr_0=images(24, 1), arr_1=np.arange(24) % 8)
    assert evaluate(tmp_path / "s.npz", tmp_path / "ref.npz")["class_histogram"] == [3] * 8
    notes = [line for line in capsys.readouterr().err.splitlines() if "not checked" in line]
    assert len(notes) == 1 and "ref.npz[arr_1]" in notes[0]
