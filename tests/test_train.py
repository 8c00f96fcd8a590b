"""Training loop end to end on tiny models and the embedded digits: loss falls, exact resume, refusals,
non-finite loss, sample grids, data order, and a 2-process (gloo) run equal to 1 process × 2 accumulation."""

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from sit_vit5.config import ConfigError, load_config, save_config
from sit_vit5.models import load_model, model_from_config
from sit_vit5.objective import create_objective
from sit_vit5.training import (
    IncompatibleCheckpointError,
    NonFiniteLossError,
    StepBatchSampler,
    TrainResult,
    latest_checkpoint,
    read_checkpoint,
    train,
)
from sit_vit5.training.grids import grid_classes, grid_images
from sit_vit5.training.optim import learning_rate
from tests.helpers import TRAIN_ARGV, assert_names, assert_states_equal, naming, run_train

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.name=ViT5-S/2", "model.depth=2", "model.hidden_size=32", "model.num_heads=2", "model.learn_sigma=false",
    "data.kind=digits", "data.image_size=8", "data.random_flip=false", "data.num_workers=0", "vae.name=none",
    "optim.lr=1e-3", "optim.ema_decay=0.9", "train.tensorboard=false", "train.sample_every=0",
    "train.log_every=2", "train.milestone_every=0",
]


def tiny_config(out_dir, *extra):
    return load_config(None, [*TINY, f"train.out_dir={out_dir}", *extra])


def load_cli():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def scramble_global_rngs():
    """What a fresh process would have: nothing in common with the interrupted run's RNG states."""
    import random

    import numpy as np

    torch.manual_seed(12345)
    np.random.seed(54321)  # noqa: NPY002
    random.seed(999)


# ----------------------------------------------------------------------------- data order


def test_step_batch_sampler_partitions_each_global_batch():
    single = StepBatchSampler(100, 16, world_size=1, rank=0, grad_accum=1, seed=3)
    ranks = [StepBatchSampler(100, 16, world_size=2, rank=r, grad_accum=2, seed=3) for r in range(2)]
    accum4 = StepBatchSampler(100, 16, world_size=1, rank=0, grad_accum=4, seed=3)
    for epoch in (0, 1):
        for s in (single, *ranks, accum4):
            s.set_epoch(epoch)
        full = list(single)
        assert len(full) == 100 // 16 and all(len(b) == 16 for b in full)
        assert len(set(sum(full, []))) == 96  # no index twice in an epoch
        per_rank = [list(s) for s in ranks]
        for b, batch in enumerate(full):
            m = 4
            r0, r1 = per_rank[0][b], per_rank[1][b]
            # chunk c = a·world + rank: chunks 0, 2 on rank 0 and 1, 3 on rank 1 (micro-batches in order)
            assert r0 == batch[0:m] + batch[2 * m:3 * m] and r1 == batch[m:2 * m] + batch[3 * m:4 * m]
            assert list(accum4)[b] == batch  # 1 process × 4 accumulation = the same chunks in order
    single.set_epoch(0)
    epoch0 = list(single)
    single.set_epoch(1)
    assert list(single) != epoch0  # a new order each epoch
    single.set_epoch(0, start_batch=4)
    assert list(single) == epoch0[4:] and len(single) == len(epoch0) - 4


def test_batch_must_split_evenly():
    with pytest.raises(ConfigError, match=naming("data.global_batch_size=10", "(4)", "train.grad_accum (1)")):
        StepBatchSampler(100, 10, world_size=4, rank=0)
    with pytest.raises(ConfigError, match=naming("10", "data.global_batch_size=16")):
        StepBatchSampler(10, 16)


def test_warmup_learning_rate():
    o = {"lr": 1e-3, "warmup_steps": 4}
    expected = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    assert [learning_rate(o, s) for s in range(6)] == pytest.approx(expected)
    assert learning_rate({"lr": 1e-4, "warmup_steps": 0}, 0) == 1e-4


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_loss_falls_on_digits(tmp_path):
    cfg = tiny_config(tmp_path / "run", "train.steps=100", "data.global_batch_size=32", "train.ckpt_every=100",
                      "train.log_every=50", "optim.lr=2e-3")
    result = train(cfg)
    assert len(result.losses) == 100
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-10:]) / 10
    assert last < 0.8 * first, (first, last)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [50, 100]
    assert rows[0]["loss"] == pytest.approx(sum(result.losses[:50]) / 50)
    assert {"loss", "grad_norm", "lr", "steps_per_s", "img_per_s"} <= rows[0].keys()
    assert (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].startswith("step,epoch,loss,grad_norm")
    saved = load_config(tmp_path / "run" / "config.yaml")  # resolved: derived model sizes filled in
    assert (saved["model"]["input_size"], saved["model"]["in_channels"], saved["model"]["num_classes"]) == (8, 1, 10)


def test_resume_is_bit_identical(tmp_path):
    # 360 test digits, global batch 64 = 2 micro-batches of 32: 5 steps per epoch, so the resumed part
    # (steps 5-8) crosses an epoch boundary; warmup makes the lr depend on the step too.
    extra = ["train.steps=8", "train.ckpt_every=4", "data.split=test", "data.global_batch_size=64",
             "train.grad_accum=2", "optim.warmup_steps=3", "optim.grad_clip=0.5", "model.class_dropout_prob=0.5"]
    straight = train(tiny_config(tmp_path / "a", *extra))

    calls = {"n": 0}

    def killed_at_step_6(objective, model, x, y):
        calls["n"] += 1
        if calls["n"] > 5 * 2:  # the 6th step's first micro-batch: after the checkpoint at step 4
            raise KeyboardInterrupt("killed")
        return objective.loss(model, x, y)

    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(tmp_path / "b", *extra), loss_fn=killed_at_step_6)
    assert latest_checkpoint(tmp_path / "b" / "checkpoints").name == "0000004.pt"

    scramble_global_rngs()
    resumed = train(tiny_config(tmp_path / "b", *extra), resume="latest")
    assert resumed.losses == straight.losses[4:]
    a, b = read_checkpoint(straight.checkpoint), read_checkpoint(resumed.checkpoint)
    assert (a["step"], a["epoch"], a["batch_in_epoch"]) == (b["step"], b["epoch"], b["batch_in_epoch"]) == (8, 1, 3)
    for key in ("model", "ema", "opt"):
        assert_states_equal(a[key], b[key], key)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]  # the killed run's rows after step 4 were replaced, not duplicated


def test_resume_refuses_another_model_and_fresh_start_refuses_old_run(tmp_path):
    run = tmp_path / "run"
    train(tiny_config(run, "train.steps=2", "train.ckpt_every=2", "data.global_batch_size=16"))
    with pytest.raises(IncompatibleCheckpointError) as err:
        train(tiny_config(run, "train.steps=4", "data.global_batch_size=16", "model.depth=3"), resume="latest")
    assert_names(str(err.value), "model.depth", "2", "3")
    with pytest.raises(IncompatibleCheckpointError, match="transport.path_type"):
        train(tiny_config(run, "train.steps=4", "data.global_batch_size=16", "transport.path_type=GVP"),
              resume="latest")
    with pytest.raises(ConfigError, match=naming(run, "--resume latest")):
        train(tiny_config(run, "train.steps=4", "data.global_batch_size=16"))
    # steps, lr and logging may change on resume
    result = train(tiny_config(run, "train.steps=3", "data.global_batch_size=16", "optim.lr=5e-4",
                               "train.log_every=1"), resume="latest")
    assert result.step == 3 and len(result.losses) == 1


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    calls = {"n": 0}

    def nan_at_step_5(objective, model, x, y):
        calls["n"] += 1
        loss = objective.loss(model, x, y)
        return loss * float("nan") if calls["n"] == 5 else loss

    cfg = tiny_config(tmp_path / "run", "train.steps=10", "train.ckpt_every=2", "data.global_batch_size=16")
    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, loss_fn=nan_at_step_5)
    assert err.value.step == 5 and "step 5" in str(err.value) and "0000004.pt" in str(err.value)
    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest.name == "0000004.pt"
    state = read_checkpoint(latest)
    assert all(torch.isfinite(v).all() for v in state["model"].values())

    # the CLI turns it into a message and exit status 1
    calls["n"] = 0
    shutil.rmtree(tmp_path / "run")
    config_file = tmp_path / "tiny.yaml"
    save_config(cfg, config_file)
    cli = load_cli()
    nan_train = functools.partial(train, loss_fn=nan_at_step_5)
    assert cli.main(["--config", str(config_file)], train_fn=nan_train) == 1
    assert "non-finite loss" in capsys.readouterr().err
    assert cli.main(["--config", str(config_file), "train.stpes=3"], train_fn=nan_train) == 2
    assert "train.stpes" in capsys.readouterr().err


def test_cli_resume_from_a_moved_run_dir_uses_its_saved_config(tmp_path):
    cli = load_cli()
    config_file = tmp_path / "tiny.yaml"
    save_config(tiny_config(tmp_path / "first", "train.steps=2", "train.ckpt_every=2",
                            "data.global_batch_size=16", "model.depth=1"), config_file)
    assert cli.main(["--config", str(config_file)]) == 0
    (tmp_path / "first").rename(tmp_path / "moved")
    assert cli.main(["--resume", str(tmp_path / "moved"), "train.steps=3"]) == 0
    state = read_checkpoint(latest_checkpoint(tmp_path / "moved" / "checkpoints"))
    assert state["step"] == 3 and state["args"]["model"]["depth"] == 1
    assert state["args"]["train"]["out_dir"] == str(tmp_path / "moved")
    assert not (tmp_path / "first").exists()


def test_sample_grid_is_saved_and_reproducible(tmp_path):
    cfg = tiny_config(tmp_path / "run", "train.steps=2", "train.ckpt_every=2", "data.global_batch_size=16",
                      "train.sample_every=2", "sample.num_images=6", "sample.nrow=3", "sample.num_steps=4")
    result = train(cfg)
    assert result.sample_grid == tmp_path / "run" / "samples" / "0000002.png"
    with Image.open(result.sample_grid) as grid:
        width, height = grid.size
    pad = 4  # 8×8 digits upscaled ×8 to 64 px, padding max(2, 8 // 2)
    assert (width, height) == (3 * 64 + 4 * pad, 2 * 64 + 3 * pad)

    state = read_checkpoint(result.checkpoint)
    ema = model_from_config(state["args"]["model"])
    ema.load_state_dict(state["ema"])
    transport = create_objective(cfg["transport"])
    images = grid_images(ema, transport, state["args"], torch.device("cpu"))
    again = grid_images(ema, transport, state["args"], torch.device("cpu"))
    assert images.shape == (6, 1, 8, 8) and torch.equal(images, again)  # fixed noise and classes
    assert 0 <= images.min() and images.max() <= 1
    assert grid_classes(state["args"]["sample"], 10) == [0, 1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_two_processes_equal_one_process_with_accumulation(tmp_path):
    """torchrun, 2 CPU processes (gloo, DDP) × 1 micro-batch = 1 process × 2 accumulated micro-batches."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo backend not available")
    common = ["train.steps=2", "train.ckpt_every=2", "data.global_batch_size=16", "train.cpu=true"]
    config_file = tmp_path / "tiny.yaml"
    save_config(tiny_config(tmp_path / "unused", *common), config_file)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "train.py"), "--config", str(config_file), f"train.out_dir={tmp_path / 'two'}"],
        env=env, capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "2 process(es)" in two.stdout
    one = train(tiny_config(tmp_path / "one", *common, "train.grad_accum=2"))
    a = read_checkpoint(latest_checkpoint(tmp_path / "two" / "checkpoints"))
    b = read_checkpoint(one.checkpoint)
    for key in ("model", "ema"):
        for name, value in a[key].items():
            torch.testing.assert_close(value, b[key][name], rtol=1e-5, atol=1e-6, msg=f"{key}.{name}")
    torch.manual_seed(0)  # train.seed: the initial weights both runs started from
    init = model_from_config(b["args"]["model"]).state_dict()
    moved = sum((a["model"][k] - init[k]).abs().sum() for k in init)
    mismatch = sum((a["model"][k] - b["model"][k]).abs().sum() for k in init)
    assert moved > 1000 * mismatch  # it did train, and both runs took the same two steps


def test_none_switches_reach_the_model_in_training_and_sampling(tmp_path):
    """``model.layer_scale_init=null`` means "LayerScale off": it must not fall back to the ViT-5 default."""
    cfg = load_config(None, ["model.name=ViT5-S/2", "model.layer_scale_init=null", "model.register_rope_theta=null",
                             "model.input_size=8", "model.in_channels=1", "model.num_classes=10", "model.depth=1",
                             "model.hidden_size=32", "model.num_heads=2"])
    model = model_from_config(cfg["model"])
    assert model.blocks[0].gamma_1 is None and model.rope.register_theta is None
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "ema": model.state_dict(), "args": cfg}, path)
    loaded = load_model(path).model
    assert loaded.blocks[0].gamma_1 is None and loaded.rope.register_theta is None


# ----------------------------------------------------------------------------- refusals


def test_unwritable_out_dir_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # works for root too, unlike chmod
    argv = [*TRAIN_ARGV, f"train.out_dir={blocker / 'run'}", "train.steps=2"]
    status, line = run_train(argv, capsys)
    assert status == 2 and "train.out_dir" in line and str(blocker) in line


def test_sit_and_dit_train_flags_are_aliases_of_config_keys(tmp_path, capsys):
    """SiT/DiT's ``train.py --model ... --data-path ... --results-dir ...`` resolves to the same config
    as our key=value overrides; ``--ckpt`` resumes; ``--epochs`` is refused in one line."""
    from sit_vit5.cli import train as cli_train

    seen = []

    def record(cfg, resume):
        seen.append((cfg, resume))
        return TrainResult(Path(cfg["train"]["out_dir"]), 0, None, None, config=cfg)

    habits = ["--model", "SiT-S/2", "--data-path", str(tmp_path), "--results-dir", str(tmp_path / "r"),
              "--global-batch-size", "16", "--image-size", "32", "--num-classes", "10", "--ckpt-every", "5",
              "--log-every", "2", "--global-seed", "3", "--wandb", "--vae", "mse"]
    ours = ["model.name=SiT-S/2", f"data.root={tmp_path}", f"train.out_dir={tmp_path / 'r' / 'SiT-S-2'}",
            "data.global_batch_size=16", "data.image_size=32", "model.num_classes=10", "train.ckpt_every=5",
            "train.log_every=2", "train.seed=3", "train.wandb=true", "vae.name=stabilityai/sd-vae-ft-mse"]
    assert cli_train.main(habits, train_fn=record) == 0
    assert cli_train.main(["--config", "demo", *ours], train_fn=record) == 0
    assert seen[0][0] == load_config(None, ours) and seen[0][1] is None  # on the defaults
    assert seen[1][0]["data"]["kind"] == "digits"  # --config keeps its base
    assert cli_train.main([*habits, "train.log_every=7"], train_fn=record) == 0
    assert seen[2][0]["train"]["log_every"] == 7  # a key=value override wins over a habit flag
    assert cli_train.main(["--ckpt", str(tmp_path / "c.pt"), "--config", "demo"], train_fn=record) == 0
    assert seen[3][1] == str(tmp_path / "c.pt")
    assert cli_train.main(["--model", "DiT-S/2", "--data-path", str(tmp_path)], train_fn=record) == 0
    dit = seen[4][0]  # a DiT name: DiT's objective; the defaults, not the digits demo
    assert dit["transport"]["objective"] == "ddpm" and dit["data"]["kind"] == "imagefolder"
    assert cli_train.main(["--epochs", "80"], train_fn=record) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: --epochs 80") and "train.steps" in err[0]


def test_the_run_header_states_precision_compile_and_strategy(tmp_path):
    from sit_vit5.training.build import build, describe

    for extra, words in ((["train.precision=bf16"], ("bf16 autocast", "one process")),
                         (["train.compile=true"], ("fp32", "torch.compile"))):
        cfg = load_config(None, [*TINY, f"train.out_dir={tmp_path / extra[0]}", *extra])
        header = describe(build(cfg, None))
        assert all(w in header for w in words), header
        assert ("torch.compile" in header) == ("train.compile=true" in extra)
