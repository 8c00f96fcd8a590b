"""Trackers across a resume: wandb continues one run (id kept in the run dir), TensorBoard purges
the steps after the resumed checkpoint, and TensorBoard is on by default exactly when it is
installed."""

from __future__ import annotations

import json
import sys
import types

import pytest

from sit_vit5.config import ConfigError, load_config
from sit_vit5.training import logging as tracking
from sit_vit5.training.logging import WANDB_ID_FILE, MetricLogger


class FakeRun:
    def __init__(self, run_id: str) -> None:
        self.id, self.logged, self.finished = run_id, [], False

    def log(self, row, step):
        self.logged.append((step, row))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording every ``init`` call; new runs get ids run-0, run-1,
    ..."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return FakeRun(kwargs["id"] or f"run-{len(calls) - 1}")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """A stand-in ``torch.utils.tensorboard`` recording each SummaryWriter's arguments and
    scalars."""
    writers = []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir, self.purge_step, self.scalars = log_dir, purge_step, []
            writers.append(self)

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    return writers


def test_wandb_continues_the_same_run_across_resumes(tmp_path, fake_wandb):
    first = MetricLogger(tmp_path, wandb=True, tensorboard=False, resume_step=0)
    first.log(10, {"loss": 1.0})
    first.close()
    assert fake_wandb[0]["id"] is None and (tmp_path / WANDB_ID_FILE).read_text().strip() == "run-0"
    for resume_step in (1000, 2000):  # two pre-emptions: still the first run
        logger = MetricLogger(tmp_path, wandb=True, tensorboard=False, resume_step=resume_step)
        logger.close()
        assert fake_wandb[-1]["id"] == "run-0" and fake_wandb[-1]["resume"] == "allow"
    fresh = MetricLogger(tmp_path, wandb=True, tensorboard=False, resume_step=0)  # a new run in the same dir
    fresh.close()
    assert fake_wandb[-1]["id"] is None and (tmp_path / WANDB_ID_FILE).read_text().strip() == "run-3"


def test_tensorboard_purges_steps_after_the_resumed_checkpoint(tmp_path, fake_tensorboard):
    fresh = MetricLogger(tmp_path, tensorboard=True, resume_step=None)
    resumed = MetricLogger(tmp_path, tensorboard=True, resume_step=3000)
    resumed.log(3100, {"loss": 0.5})
    assert fresh.tb_writer.purge_step is None
    assert resumed.tb_writer.purge_step == 3001  # events >= 3001 dropped; rows <= 3000 kept, as in the JSONL
    assert resumed.tb_writer.scalars == [("train/loss", 0.5, 3100)]
    for logger in (fresh, resumed):
        logger.close()


def test_jsonl_and_tensorboard_agree_on_what_a_resume_keeps(tmp_path, fake_tensorboard):
    logger = MetricLogger(tmp_path, tensorboard=True)
    for step in (100, 200, 300):
        logger.log(step, {"loss": float(step)})
    logger.close()
    resumed = MetricLogger(tmp_path, tensorboard=True, resume_step=200)
    resumed.close()
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [100, 200] and resumed.tb_writer.purge_step == max(kept) + 1


@pytest.mark.parametrize("installed", [True, False])
def test_tensorboard_default_follows_installation_silently(tmp_path, capsys, monkeypatch, fake_tensorboard,
                                                            installed):
    monkeypatch.setattr(tracking, "tensorboard_installed", lambda: installed)
    logger = MetricLogger(tmp_path, tensorboard=load_config("configs/demo.yaml")["train"]["tensorboard"])
    logger.close()
    assert (logger.tb_writer is not None) == installed
    assert capsys.readouterr().err == ""  # no warning on every demo run


def test_asking_for_tensorboard_explicitly_warns_when_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    MetricLogger(tmp_path, tensorboard=True).close()
    assert "tensorboard is not installed" in capsys.readouterr().err


def test_tensorboard_key_accepts_only_true_false_null():
    assert load_config(None, ["train.tensorboard=false"])["train"]["tensorboard"] is False
    with pytest.raises(ConfigError, match="train.tensorboard"):
        load_config(None, ["train.tensorboard=sometimes"])
