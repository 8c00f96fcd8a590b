"""sample.py bulk / grid as a hostile user drives them: a checkpoint replaced under the same path, two
runs into one folder, a crashed run's claims, an output path that is a file, Ctrl-C. Each case: the
documented exit status, one line on stderr (no traceback) and nothing lost or half-written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import sample
from sit_vit5.sampling import SampleSpec, SamplingPipeline, sample_bulk
from sit_vit5.sampling.bulk import CLAIM_PREFIX, _part_name, claim_batch
from sit_vit5.sampling.sampling_pipeline import Generated
from tests.test_sampling_cli import our_checkpoint

ODE = SampleSpec(method="ode", sampling_method="euler", num_steps=3)
FLAGS = ["--num-steps", "3", "--method", "ode", "--sampling-method", "euler", "--no-progress",
         "--batch-size", "2"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two different checkpoints of the same tiny pixel model."""
    first = our_checkpoint(tmp_path_factory.mktemp("first"), in_channels=1)
    second = our_checkpoint(tmp_path_factory.mktemp("second"), in_channels=1, seed=1)
    return first, second


def stderr_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def tiny_pipeline(seed: int) -> SamplingPipeline:
    from sit_vit5.models import create_model
    from sit_vit5.transport import create_transport

    torch.manual_seed(seed)
    model = create_model("SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8,
                         in_channels=1, num_classes=10)
    return SamplingPipeline(model, create_transport(), ODE, (1, 8, 8), 10)


def test_a_checkpoint_replaced_at_the_same_path_is_not_resumed_onto(ckpts, tmp_path, capsys):
    first, second = ckpts
    ckpt = tmp_path / "model.pt"
    shutil.copy(first, ckpt)
    out = tmp_path / "bulk"
    argv = ["bulk", "--ckpt", str(ckpt), *FLAGS, "--out", str(out)]
    assert sample.main([*argv, "--num-samples", "4"]) == 0
    before = sorted(p.name for p in (out / "parts").iterdir())
    shutil.copy(second, ckpt)  # same path, other weights
    for sidecar in tmp_path.glob("*.sha256"):
        sidecar.unlink()
    assert sample.main([*argv, "--num-samples", "8"]) == 2
    line = stderr_line(capsys)
    assert line.startswith("sample.py bulk: error: ") and "weights_sha256" in line
    assert sorted(p.name for p in (out / "parts").iterdir()) == before  # nothing added or lost


def test_two_runs_into_one_folder_split_the_batches(tmp_path):
    """A batch claimed by a live process is left to it; the rest is made; once its claim is gone
    a rerun makes only that batch, and the npz equals one uninterrupted run's."""
    reference = sample_bulk(tiny_pipeline(0), 6, tmp_path / "ref", batch_size=2, progress=False)
    out = tmp_path / "shared"
    (out / "parts").mkdir(parents=True)
    held = claim_batch(out / "parts", np.arange(2, 4))  # this live process holds samples 2, 3
    assert held is not None and claim_batch(out / "parts", np.arange(2, 4)) is None
    result = sample_bulk(tiny_pipeline(0), 6, out, batch_size=2, progress=False)
    assert (result.generated, result.claimed, result.npz) == (4, 2, None)
    held.unlink()
    again = sample_bulk(tiny_pipeline(0), 6, out, batch_size=2, progress=False)
    assert (again.generated, again.skipped) == (2, 4)
    with np.load(again.npz) as got, np.load(reference.npz) as want:
        assert np.array_equal(got["arr_0"], want["arr_0"])
    assert not list((out / "parts").glob(f"{CLAIM_PREFIX}*"))  # every claim released


def test_a_dead_claimants_batch_is_taken_over(tmp_path):
    out = tmp_path / "bulk"
    (out / "parts").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = out / "parts" / f"{CLAIM_PREFIX}{_part_name(np.arange(0, 2))[:-4]}"
    stale.write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout), "time": 0}))
    result = sample_bulk(tiny_pipeline(0), 4, out, batch_size=2, progress=False)
    assert (result.generated, result.claimed) == (4, 0) and result.npz is not None


def test_other_weights_refuse_a_resume_naming_the_digest(tmp_path):
    out = tmp_path / "bulk"
    first = tiny_pipeline(0)
    sample_bulk(first, 2, out, batch_size=2, settings=first.input_digests(), progress=False)
    other = tiny_pipeline(1)
    assert other.input_digests() != first.input_digests()
    with pytest.raises(ValueError, match="weights_sha256"):
        sample_bulk(other, 4, out, batch_size=2, settings=other.input_digests(), progress=False)


@pytest.mark.parametrize("command", ["grid", "bulk"])
def test_an_output_path_that_is_a_file_is_named(ckpts, tmp_path, capsys, command):
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    argv = [command, "--ckpt", str(ckpts[0]), *FLAGS, "--out", str(blocker / "sub")]
    assert sample.main([*argv, *(["--num-samples", "2"] if command == "bulk" else [])]) == 2
    line = stderr_line(capsys)
    assert f"{blocker} is a file" in line and "Errno" not in line
    assert blocker.read_text() == "not a folder"


def test_ctrl_c_in_bulk_exits_130_saying_how_to_continue(ckpts, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bulk"
    argv = ["bulk", "--ckpt", str(ckpts[0]), *FLAGS, "--num-samples", "4", "--out", str(out)]
    real, calls = SamplingPipeline.generate, []

    def interrupted(self, indices, *args, **kwargs) -> Generated:
        calls.append(list(indices))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, indices, *args, **kwargs)

    monkeypatch.setattr(SamplingPipeline, "generate", interrupted)
    assert sample.main(argv) == 130
    assert stderr_line(capsys) == ("sample.py bulk: interrupted; rerun the same command to "
                                   "continue")
    assert len(list((out / "parts").glob("[0-9]*.npz"))) == 1  # the finished batch is kept
    assert not list((out / "parts").glob(f"{CLAIM_PREFIX}*"))
    monkeypatch.setattr(SamplingPipeline, "generate", real)
    assert sample.main(argv) == 0 and (out / "samples_4x8x8x3.npz").is_file()
