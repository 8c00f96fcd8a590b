"""Issue 40 part 4, sampling side: ``sample.py bulk --label-sampling equal|random`` and the
``metadata_json`` record the merged npz carries (what a FID line is traced by)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sit_vit5.cli import sample as sample_cli
from sit_vit5.sampling import (
    LABEL_SAMPLINGS,
    METADATA_KEY,
    ResumeError,
    SampleSpec,
    equal_labels,
    sample_bulk,
)
from sit_vit5.sampling import bulk as bulk_module
from sit_vit5.utils.errors import SettingError
from tests.helpers import one_error_line
from tests.test_first_minute import pixel_checkpoint
from tests.test_sampling import ODE, SDE, pipeline

K = 10  # classes of the tiny models


def _labels(npz: Path) -> np.ndarray:
    with np.load(npz, allow_pickle=False) as f:
        return f["arr_1"]


def _metadata(npz: Path) -> dict:
    with np.load(npz, allow_pickle=False) as f:  # no pickle: a 0-d string array
        return json.loads(str(f[METADATA_KEY]))


def expected_random_labels(indices, seed: int, num_classes: int) -> list[int]:
    """The labels sample.py bulk drew before --label-sampling existed, recomputed from the raw
    generator calls: sample i's label stream (1) seeded by NumPy's SeedSequence hash of (seed, i,
    1), one torch.randint draw."""
    out = []
    for i in indices:
        words = np.random.SeedSequence([seed, i, 1]).generate_state(2, dtype=np.uint32)
        gen = torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))
        out.append(int(torch.randint(num_classes, (1,), generator=gen)))
    return out


# ----------------------------------------------------------------------------- random (default)


def test_random_stays_the_default_and_draws_the_labels_it_always_drew(tmp_path):
    n, seed = 13, 5
    default = sample_bulk(pipeline(ODE), n, tmp_path / "default", global_seed=seed, batch_size=4,
                          progress=False)
    explicit = sample_bulk(pipeline(ODE), n, tmp_path / "random", global_seed=seed, batch_size=6,
                           progress=False, label_sampling="random")
    expected = expected_random_labels(range(n), seed, K)
    assert _labels(default.npz).tolist() == expected == _labels(explicit.npz).tolist()
    with np.load(default.npz) as a, np.load(explicit.npz) as b:
        assert np.array_equal(a["arr_0"], b["arr_0"])
    assert _metadata(default.npz)["label_sampling"] == "random"
    settings = json.loads((tmp_path / "default" / "settings.json").read_text())
    assert settings["label_sampling"] == "random" and "num_samples" not in settings  # N may grow


# ----------------------------------------------------------------------------- equal


@pytest.mark.parametrize("n, k, seed", [(10, 10, 0), (50, 10, 3), (1000, 8, 1), (12, 1, 2)])
def test_equal_gives_exactly_n_over_k_of_every_class_in_a_seeded_order(n, k, seed):
    labels = equal_labels(range(n), seed, n, k)
    assert labels.dtype == np.int64 and labels.shape == (n,)
    counts = {c: int((labels == c).sum()) for c in range(k)}
    assert counts == dict.fromkeys(range(k), n // k) and set(labels.tolist()) <= set(range(k))
    if n >= 50 and k > 1:  # shuffled: neither class blocks nor a round robin
        assert not np.array_equal(labels, np.sort(labels))
        assert not np.array_equal(labels, np.arange(n) % k)
        assert not np.array_equal(labels, equal_labels(range(n), seed + 1, n, k))  # the seed's


def test_equal_label_of_i_is_a_pure_function_of_seed_n_k_and_i():
    full = equal_labels(range(60), 4, 60, K)
    picks = [59, 0, 17, 17, 33]
    assert equal_labels(picks, 4, 60, K).tolist() == [int(full[i]) for i in picks]
    again = np.concatenate([equal_labels(range(r, 60, 3), 4, 60, K) for r in range(3)])
    order = np.concatenate([np.arange(r, 60, 3) for r in range(3)])
    assert np.array_equal(again, full[order])  # three processes' shares, each on its own
    assert not np.array_equal(equal_labels(range(60), 4, 70, K)[:60], full)  # depends on N too


def test_equal_bulk_is_balanced_across_processes_batches_and_a_resume(tmp_path, monkeypatch):
    n, seed = 30, 2
    one = sample_bulk(pipeline(SDE), n, tmp_path / "one", global_seed=seed, batch_size=7,
                      progress=False, label_sampling="equal")
    labels = _labels(one.npz)
    assert np.bincount(labels, minlength=K).tolist() == [n // K] * K
    assert np.array_equal(labels, equal_labels(range(n), seed, n, K))
    # two processes (i % 2), other batch sizes, the first one interrupted after one batch
    real_save, saved = bulk_module._save_part, []

    def crash_after_first(parts_dir, batch):
        if saved:
            raise KeyboardInterrupt
        saved.append(real_save(parts_dir, batch))
        return saved[-1]

    monkeypatch.setattr(bulk_module, "_save_part", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        sample_bulk(pipeline(SDE), n, tmp_path / "two", global_seed=seed, batch_size=4, rank=0,
                    world_size=2, progress=False, label_sampling="equal")
    monkeypatch.setattr(bulk_module, "_save_part", real_save)
    for rank, batch_size in ((1, 5), (0, 3)):
        last = sample_bulk(pipeline(SDE), n, tmp_path / "two", global_seed=seed,
                           batch_size=batch_size, rank=rank, world_size=2, progress=False,
                           label_sampling="equal")
    assert last.skipped == 4 and np.array_equal(_labels(last.npz), labels)
    with np.load(one.npz) as a, np.load(last.npz) as b:
        assert np.abs(a["arr_0"].astype(int) - b["arr_0"].astype(int)).max() <= 1


def test_equal_with_a_count_not_a_multiple_of_the_classes_is_refused_before_writing(tmp_path):
    with pytest.raises(SettingError, match=r"label_sampling='equal'.*25 samples.*10 classes.*"
                       r"--num-samples 20 or 30"):
        sample_bulk(pipeline(ODE), 25, tmp_path / "out", progress=False, label_sampling="equal")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SettingError, match="label_sampling='uniform'.*random, equal"):
        sample_bulk(pipeline(ODE), 20, tmp_path / "out", progress=False, label_sampling="uniform")
    assert not (tmp_path / "out").exists()


def test_resuming_with_other_label_sampling_or_count_is_refused(tmp_path):
    out = tmp_path / "out"
    sample_bulk(pipeline(ODE), 10, out, batch_size=5, progress=False, label_sampling="equal")
    with pytest.raises(ResumeError, match="label_sampling: 'equal'.*'random'"):
        sample_bulk(pipeline(ODE), 10, out, batch_size=5, progress=False)
    with pytest.raises(ResumeError, match="num_samples: 10.*20"):  # every label would change
        sample_bulk(pipeline(ODE), 20, out, batch_size=5, progress=False, label_sampling="equal")
    # a directory written before label sampling was recorded held random labels
    old = tmp_path / "old"
    sample_bulk(pipeline(ODE), 4, old, batch_size=4, progress=False)
    settings = json.loads((old / "settings.json").read_text())
    for key in ("label_sampling", "precision"):
        del settings[key]
    (old / "settings.json").write_text(json.dumps(settings))
    assert sample_bulk(pipeline(ODE), 6, old, batch_size=4, progress=False).generated == 2
    with pytest.raises(ResumeError, match="label_sampling: 'random'.*'equal'"):
        sample_bulk(pipeline(ODE), 10, old, batch_size=4, progress=False, label_sampling="equal")


# ----------------------------------------------------------------------------- metadata


def test_merged_npz_metadata_says_how_the_samples_were_made(tmp_path):
    spec = SampleSpec(method="sde", sampling_method="Euler", num_steps=4, cfg_scale=1.5,
                      cfg_interval=(0.1, 0.9))
    pipe = pipeline(spec)
    result = sample_bulk(pipe, 20, tmp_path, global_seed=3, batch_size=8, progress=False,
                         label_sampling="equal", settings={"checkpoint_sha256": "ab" * 32})
    meta = _metadata(result.npz)
    labels = _labels(result.npz)
    assert meta["num_samples"] == 20 and meta["image_shape"] == [8, 8, 3]
    assert (meta["label_sampling"], meta["num_classes"]) == ("equal", K)
    assert meta["class_histogram"] == [int((labels == c).sum()) for c in range(K)] == [2] * K
    assert meta["sampler"] == {"method": "sde", "solver": "Euler", "num_steps": 4}
    # Euler-Maruyama: 3 steps of one evaluation, plus the Mean last step's (the objective counts)
    assert meta["nfe_per_image"] == pipe.objective.evaluations(spec) == 4 == result.nfe
    assert (meta["cfg_scale"], meta["cfg_interval"]) == (1.5, [0.1, 0.9])
    assert meta["precision"] == "fp32" and meta["checkpoint_sha256"] == "ab" * 32
    assert meta["global_seed"] == 3 and meta["spec"]["cfg_scale"] == 1.5
    with np.load(result.npz, allow_pickle=False) as f:  # ADM's arrays as they were
        assert f["arr_0"].dtype == np.uint8 and f["arr_0"].shape == (20, 8, 8, 3)
        assert f["arr_1"].dtype == np.int64


def test_metadata_of_old_parts_says_the_nfe_is_unknown(tmp_path):
    result = sample_bulk(pipeline(ODE), 4, tmp_path, batch_size=2, progress=False)
    assert _metadata(result.npz)["nfe_per_image"] == 3  # 4 grid points: 3 Euler steps
    part = sorted((tmp_path / "parts").glob("0*.npz"))[0]
    with np.load(part) as f:  # as an older version wrote it: no nfe member
        arrays = {k: f[k] for k in f.files if k != "nfe"}
    np.savez(part, **arrays)
    meta = _metadata(bulk_module.merge_parts(tmp_path, 4, progress=False))
    assert meta["nfe_per_image"] is None and meta["label_sampling"] == "random"


# ----------------------------------------------------------------------------- sample.py bulk


def test_cli_equal_labels_and_checkpoint_sha256(tmp_path, capsys):
    ckpt = pixel_checkpoint(tmp_path / "run" / "checkpoints")
    out = tmp_path / "bulk"
    flags = ["--ckpt", str(ckpt), "--num-steps", "3", "--method", "ode", "--sampling-method",
             "euler", "--no-progress", "--out", str(out)]
    assert sample_cli.main(["bulk", *flags, "--num-samples", "15", "--label-sampling",
                            "equal"]) == 2
    line = one_error_line(capsys)
    assert "--label-sampling equal" in line and "15" in line and "10 classes" in line
    assert not out.exists()  # refused before anything was written
    assert sample_cli.main(["bulk", *flags, "--num-samples", "20", "--label-sampling",
                            "equal"]) == 0
    (npz,) = out.glob("samples_20x*.npz")
    meta = _metadata(npz)
    assert meta["checkpoint_sha256"] == hashlib.sha256(Path(ckpt).read_bytes()).hexdigest()
    assert meta["class_histogram"] == [2] * K and meta["label_sampling"] == "equal"
    assert meta["sampler"] == {"method": "ode", "solver": "euler", "num_steps": 3}
    assert meta["nfe_per_image"] == 2 and meta["precision"] == "fp32"


def test_the_cli_label_sampling_choices_are_the_library_s():
    assert sample_cli.LABEL_SAMPLINGS is LABEL_SAMPLINGS  # one table, names.LABEL_SAMPLINGS
    args = sample_cli.build_parser().parse_args(["bulk"])
    assert args.label_sampling == "random"
    assert sample_cli.translate_mode_word(["--label-sampling", "equal"])[0] == "bulk"
