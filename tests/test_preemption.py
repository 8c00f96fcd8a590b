"""Pre-emption (sit_vit5.training.preemption): a real signal to a real ``python train.py``
checkpoints the step, and ``--resume latest`` is bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sit_vit5.cli.train import main as train_main
from sit_vit5.config import load_config
from sit_vit5.training import checkpoint as ck
from sit_vit5.training import train
from sit_vit5.utils import checksums
from tests.helpers import ROOT, TRAIN_ARGV


def train_command(run: Path, steps: int, *extra: str) -> list[str]:
    """The ``python train.py`` command line of a tiny run of ``steps`` steps in ``run``."""
    return [sys.executable, str(ROOT / "train.py"), *TRAIN_ARGV, f"train.out_dir={run}",
            f"train.steps={steps}", "train.ckpt_every=1000", "train.log_every=10", *extra]


def compared(state: dict) -> dict:
    """What a resume must reproduce bit for bit (args holds out_dir and steps, which differ)."""
    return {k: state[k] for k in ("model", "ema", "opt", "step", "epoch", "batch_in_epoch", "rng")}


#: The signalled run's length: far past the signal at step ~10, so it still runs when it lands.
STEPS = 400
#: Where the resumed and the uninterrupted runs end: past the warm-up (100 steps) and an epoch
#: boundary (1797 digits / 16 = 112 batches), as the former 400 steps were, at a third of the cost.
END = 130


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(n)``: the final checkpoint of an uninterrupted run of ``n`` steps, trained in
    this process (train.py without --config = the demo config + overrides); each ``n`` once."""
    root, done = tmp_path_factory.mktemp("uninterrupted"), {}

    def run(target: int) -> Path:
        if target not in done:
            ref = train(load_config(ROOT / "configs" / "demo.yaml",
                                    [*TRAIN_ARGV, f"train.out_dir={root / f'ref{target}'}",
                                     f"train.steps={target}", "train.ckpt_every=1000"]))
            assert ref.preempted is None and ref.step == target
            done[target] = ref.checkpoint
        return done[target]

    return run


@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow),
                                  pytest.param("SIGUSR1", marks=pytest.mark.slow)])
def test_signal_checkpoints_the_step_and_resume_is_bit_identical(tmp_path, name, uninterrupted):
    """A real signal to a real `python train.py`: it finishes the step, writes a checkpoint of it,
    exits 3; `--resume latest` then ends exactly where an uninterrupted run ends."""
    steps, run = STEPS, tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "log.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen(train_command(run, steps), env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while (proc.poll() is None and "step 0000010" not in log.read_text()
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()
    proc.send_signal(getattr(signal, name))
    assert proc.wait(timeout=120) == 3, log.read_text()
    ckpt = ck.latest_checkpoint(run / "checkpoints")
    stopped = ck.read_checkpoint(ckpt)["step"]
    assert 10 <= stopped < steps and f"stopped by {name} after step {stopped}" in log.read_text()

    # the uninterrupted run: the same states at the pre-emption step and at the end (train.steps may
    # change on resume: the schedule does not depend on it)
    end = max(END, stopped + 10)
    for target, other in ((stopped, ckpt), (end, None)):
        ref = uninterrupted(target)
        if other is None:  # `python train.py ... --resume latest`, in this process (no signal here)
            assert train_main(train_command(run, end, "--resume", "latest")[2:]) == 0
            other = ck.latest_checkpoint(run / "checkpoints")
            assert ck.read_checkpoint(other)["step"] == end
        assert checksums.payload_sha256(compared(ck.read_checkpoint(other))) == \
            checksums.payload_sha256(compared(ck.read_checkpoint(ref))), target
