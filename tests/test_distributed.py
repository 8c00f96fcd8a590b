"""A launcher's world size is never ignored: the launcher variables, the one-line errors, and (slow) real
2-process torchrun runs of training, bulk sampling and FSDP without ``train.cpu`` / ``--device``; FSDP2 with
bf16, compile and gradient checkpointing against DDP, and FSDP checkpoints resumed under DDP."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sit_vit5.config import load_config, save_config
from sit_vit5.training import read_checkpoint, train
from sit_vit5.utils.distributed import (
    WORLD_SIZE_VARS,
    LaunchError,
    check_group,
    describe_group,
    launcher_world_size,
)


def test_launcher_world_size_reads_the_variables_accelerate_reads():
    assert launcher_world_size({}) == (1, None)
    assert launcher_world_size({"WORLD_SIZE": "2", "PMI_SIZE": "8"}) == (2, "WORLD_SIZE")
    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "4"}) == (4, "OMPI_COMM_WORLD_SIZE")
    for bad in ("two", "0"):
        with pytest.raises(LaunchError, match=f"WORLD_SIZE={bad!r}|WORLD_SIZE=0"):
            launcher_world_size({"WORLD_SIZE": bad})


@pytest.mark.parametrize("environ, group, words", [
    ({"WORLD_SIZE": "2"}, 1, ["WORLD_SIZE=2", "RANK/LOCAL_RANK", "torchrun", "unset WORLD_SIZE"]),
    ({"PMI_SIZE": "2"}, 1, ["PMI_SIZE=2", "PMI_RANK", "unset PMI_SIZE"]),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, 1, ["WORLD_SIZE=2", "group of 1", "MASTER_ADDR"]),
    ({"PMI_SIZE": "4", "PMI_RANK": "0"}, 2, ["PMI_SIZE=4", "group of 2"]),
    ({}, 2, ["group of 2", "WORLD_SIZE", "torchrun"]),
])
def test_a_group_that_differs_from_the_launcher_is_a_one_line_error(environ, group, words):
    with pytest.raises(LaunchError) as err:
        check_group(group, cpu=True, environ=environ)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_matching_groups_pass_and_the_header_names_size_and_backend():
    check_group(1, cpu=True, environ={})
    check_group(2, cpu=True, environ={"WORLD_SIZE": "2", "RANK": "1"})
    assert describe_group(1, "cpu") == "1 process(es) (backend none), cpu"


# ----------------------------------------------------------------------------- real launches


ROOT = Path(__file__).resolve().parents[1]
#: The run header up to the strategy: group size and backend, device, the CPU thread count when one was set.
HEADER = r"on 2 process\(es\) \(backend gloo\), cpu(:0)?( \(\d+( \(\w+\))? threads\))?, "
#: learn_sigma stays on (the default): the model's output is then a view, as on ImageNet under FSDP
TINY = ["model.name=ViT5-S/2", "model.depth=2", "model.hidden_size=32", "model.num_heads=2",
        "data.kind=digits", "data.image_size=8", "data.random_flip=false",
        "data.num_workers=0", "vae.name=none", "optim.lr=1e-3", "optim.ema_decay=0.9",
        "optim.weight_decay=0.01",  # two AdamW groups: the FSDP optimizer layout must follow them
        "train.tensorboard=false", "train.sample_every=0", "train.log_every=1", "train.milestone_every=0",
        "train.ckpt_every=1", "train.keep_last=5", "data.global_batch_size=16",
        "train.grad_accum=2"]  # gradient sync on the last micro-batch only (DDP no_sync / FSDP2)


def launch(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``args`` under torchrun with 2 processes, one node, c10d rendezvous (no train.cpu, no --device)."""
    env = {k: v for k, v in os.environ.items() if k not in WORLD_SIZE_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "test", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in metric_rows(run_dir)]


def checkpoint_at(run_dir: Path, step: int) -> dict:
    return read_checkpoint(run_dir / "checkpoints" / f"{step:07d}.pt")


def assert_close_states(a, b, atol: float, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=atol, msg=where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_close_states(a[k], b[k], atol, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_states(x, y, atol, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Three 2-process torchrun trainings of 3 steps (2 + 1 resumed for the last) on the digits."""
    root = tmp_path_factory.mktemp("launched")
    config = root / "tiny.yaml"
    save_config(load_config(None, [*TINY, f"train.out_dir={root / 'unused'}"]), config)
    runs = {}
    for name, extra in (("ddp", ["train.steps=3"]), ("fsdp", ["train.steps=3", "train.distributed=fsdp"]),
                        ("fsdp_2", ["train.steps=2", "train.distributed=fsdp"])):
        runs[name] = launch(["train.py", "--config", str(config), f"train.out_dir={root / name}", *extra])
        assert runs[name].returncode == 0, runs[name].stdout[-2000:] + runs[name].stderr[-3000:]
    runs["fsdp_resumed"] = launch(["train.py", "--config", str(config), f"train.out_dir={root / 'fsdp_2'}",
                                   "train.steps=3", "train.distributed=fsdp", "--resume", "latest"])
    assert runs["fsdp_resumed"].returncode == 0, runs["fsdp_resumed"].stderr[-3000:]
    return root, config, runs


@pytest.mark.slow
def test_torchrun_without_cpu_flag_trains_one_gloo_ddp_run(launched, tmp_path):
    """The issue's command: no train.cpu, no GPU. One 2-process group (gloo), equal to 1 process × 4
    accumulated micro-batches (2 processes × 2: the same global batch cut the same way)."""
    root, config, runs = launched
    assert re.search(HEADER + "DDP", runs["ddp"].stdout)
    one = train(load_config(config, [f"train.out_dir={tmp_path / 'one'}", "train.steps=3", "train.grad_accum=4"]))
    assert one.losses == pytest.approx(losses(root / "ddp"), abs=1e-6)
    a, b = checkpoint_at(root / "ddp", 3), read_checkpoint(one.checkpoint)
    assert_close_states(a["model"], b["model"], 1e-6, "model")
    assert_close_states(a["ema"], b["ema"], 1e-6, "ema")


@pytest.mark.slow
def test_fsdp_equals_ddp_and_keeps_the_usual_checkpoint_layout(launched):
    root, _, runs = launched
    assert re.search(HEADER + "FSDP2", runs["fsdp"].stdout)
    ddp_losses, fsdp_losses = losses(root / "ddp"), losses(root / "fsdp")
    assert len(fsdp_losses) == 3 and fsdp_losses == pytest.approx(ddp_losses, abs=1e-5)
    ddp, fsdp = checkpoint_at(root / "ddp", 3), checkpoint_at(root / "fsdp", 3)
    for key in ("model", "ema", "opt"):  # same keys, shapes and (within 1e-5) values: one layout
        assert_close_states(fsdp[key], ddp[key], 1e-5, key)
    assert len(ddp["opt"]["param_groups"]) == 2
    start = checkpoint_at(root / "ddp", 1)["model"]
    moved = max((ddp["model"][k] - start[k]).abs().max().item() for k in start)
    diff = max((ddp["model"][k] - fsdp["model"][k]).abs().max().item() for k in start)
    print(f"DDP vs FSDP after 3 steps: max |weight difference| {diff:.2e} (weights moved {moved:.2e}); "
          f"losses {ddp_losses} vs {fsdp_losses}")
    assert moved > 1e-3  # it trained


@pytest.mark.slow
def test_fsdp_resume_is_bit_identical(launched):
    root, _, runs = launched
    assert losses(root / "fsdp_2") == losses(root / "fsdp")  # the resumed step's row replaced nothing
    straight, resumed = checkpoint_at(root / "fsdp", 3), checkpoint_at(root / "fsdp_2", 3)
    for key in ("model", "ema", "opt"):
        assert_close_states(straight[key], resumed[key], 0.0, key)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_in_one_process(launched, tmp_path):
    """FSDP (2 processes) at step 2 → one process × 4 accumulation for step 3 = FSDP's own step 3."""
    root, config, _ = launched
    one = train(load_config(config, [f"train.out_dir={tmp_path / 'one'}", "train.steps=3", "train.grad_accum=4"]),
                resume=str(root / "fsdp_2" / "checkpoints" / "0000002.pt"))
    assert one.step == 3 and len(one.losses) == 1
    a, b = read_checkpoint(one.checkpoint), checkpoint_at(root / "fsdp", 3)
    for key in ("model", "ema", "opt"):
        assert_close_states(a[key], b[key], 1e-5, key)


@pytest.fixture(scope="module")
def launched_combinations(launched):
    """FSDP2 with bf16, with compile (inductor), with gradient checkpointing; DDP in bf16 and compiled; and
    DDP resumed from the FSDP run's step-2 checkpoint. 2 processes, 3 steps each."""
    root, config, _ = launched
    runs = {}
    for name, extra in (("ddp_bf16", ["train.precision=bf16"]),
                        ("fsdp_bf16", ["train.precision=bf16", "train.distributed=fsdp"]),
                        ("fsdp_compile", ["train.compile=true", "train.distributed=fsdp"]),
                        ("ddp_compile", ["train.compile=true"]),  # accelerate's dynamo_backend
                        ("fsdp_gc", ["train.grad_checkpointing=true", "train.distributed=fsdp"]),
                        ("ddp_from_fsdp", ["--resume", str(root / "fsdp_2" / "checkpoints" / "0000002.pt")])):
        runs[name] = launch(["train.py", "--config", str(config), f"train.out_dir={root / name}",
                             "train.steps=3", *extra], timeout=600)
        assert runs[name].returncode == 0, runs[name].stdout[-2000:] + runs[name].stderr[-3000:]
    return root, runs


@pytest.mark.slow
def test_fsdp_in_bf16_equals_ddp_in_bf16(launched_combinations):
    """Losses and gradient norms step by step (bf16 autocast in both: the same ops, the same 2-term gradient
    sums); weights, EMA and AdamW moments stay fp32 in the checkpoints, laid out as DDP's."""
    root, runs = launched_combinations
    assert re.search(HEADER + "FSDP2", runs["fsdp_bf16"].stdout)
    rows, ddp_rows, fp32_rows = (metric_rows(root / run) for run in ("fsdp_bf16", "ddp_bf16", "ddp"))
    for key, rel in (("loss", 1e-3), ("grad_norm", 1e-2)):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ddp_rows], rel=rel), key
    assert [r["loss"] for r in ddp_rows] != [r["loss"] for r in fp32_rows]  # autocast did change the numbers
    ddp, fsdp = checkpoint_at(root / "ddp_bf16", 3), checkpoint_at(root / "fsdp_bf16", 3)
    print("bf16, FSDP vs DDP: max |loss difference|",
          max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, ddp_rows)), "max |weight difference|",
          max((fsdp["model"][k] - ddp["model"][k]).abs().max().item() for k in ddp["model"]))
    for state in (ddp, fsdp):
        assert state["model"].keys() == state["ema"].keys() == checkpoint_at(root / "ddp", 3)["model"].keys()
        tensors = [*state["model"].values(), *state["ema"].values(),
                   *(v for s in state["opt"]["state"].values() for k, v in s.items() if k != "step")]
        assert {t.dtype for t in tensors} == {torch.float32}
    assert len(fsdp["opt"]["state"]) == len(ddp["opt"]["state"]) and len(fsdp["opt"]["param_groups"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fsdp_compile", "ddp_compile"])
def test_compiled_equals_ddp_and_logs_the_gates(launched_combinations, run):
    """Losses, gradient norms and gates step by step. Weights are not compared: AdamW turns the compiler's
    ~1e-7 rounding differences of near-zero gradients (zero-init adaLN) into ±lr steps."""
    root, runs = launched_combinations
    assert re.search(HEADER + ("FSDP2" if run.startswith("fsdp") else "DDP"), runs[run].stdout)
    rows, eager = (metric_rows(root / name) for name in (run, "ddp"))
    assert len(rows) == 3
    for key, rel in (("loss", 1e-4), ("grad_norm", 1e-3)):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in eager], rel=rel), key
    assert all("gate/attn/mean" in r for r in rows)  # the gate hooks run inside the compiled graph
    assert [r["gate/mlp/mean"] for r in rows] == pytest.approx([r["gate/mlp/mean"] for r in eager], rel=0.05,
                                                               abs=1e-4)
    compiled, ddp = checkpoint_at(root / run, 3), checkpoint_at(root / "ddp", 3)
    for key in ("model", "ema"):  # the usual layout: no _orig_mod. prefix
        assert compiled[key].keys() == ddp[key].keys()
    assert len(compiled["opt"]["state"]) == len(ddp["opt"]["state"])


@pytest.mark.slow
def test_gradient_checkpointing_under_fsdp_changes_nothing(launched_combinations):
    root, _ = launched_combinations
    assert losses(root / "fsdp_gc") == pytest.approx(losses(root / "fsdp"), abs=1e-6)
    for key in ("model", "ema", "opt"):
        assert_close_states(checkpoint_at(root / "fsdp_gc", 3)[key], checkpoint_at(root / "fsdp", 3)[key], 1e-6, key)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_under_ddp(launched_combinations):
    """FSDP (2 processes) at step 2 → DDP (2 processes) for step 3 = FSDP's own step 3."""
    root, runs = launched_combinations
    assert re.search(HEADER + "DDP", runs["ddp_from_fsdp"].stdout)
    assert losses(root / "ddp_from_fsdp") == pytest.approx(losses(root / "fsdp")[2:], abs=1e-6)
    for key in ("model", "ema", "opt"):
        assert_close_states(checkpoint_at(root / "ddp_from_fsdp", 3)[key], checkpoint_at(root / "fsdp", 3)[key],
                            1e-5, key)


@pytest.mark.slow
def test_torchrun_bulk_sampling_splits_the_indices(launched, tmp_path):
    """sample.py bulk under torchrun, no --device: each sample index drawn once, same npz as one process."""
    import sample

    root, _, _ = launched
    ckpt = str(root / "ddp" / "checkpoints" / "0000003.pt")
    flags = ["bulk", "--ckpt", ckpt, "--num-samples", "10", "--batch-size", "4", "--num-steps", "3",
             "--no-progress"]
    two = launch(["sample.py", *flags, "--out", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "bulk sampling on 2 process(es) (backend gloo)" in two.stdout
    assert "[rank 0/2] generated 5," in two.stdout and "[rank 1/2] generated 5," in two.stdout
    assert sample.main([*flags, "--out", str(tmp_path / "one")]) == 0
    (a,), (b,) = (list((tmp_path / d).glob("samples_*.npz")) for d in ("two", "one"))
    with np.load(a) as x, np.load(b) as y:
        assert np.array_equal(x["arr_1"], y["arr_1"])  # labels
        assert np.abs(x["arr_0"].astype(int) - y["arr_0"].astype(int)).max() <= 1  # other batch shapes


#: Runs each ``[script or -m module, *args]`` of argv[1] (JSON) as ``python ...`` would, one after
#: the other in one interpreter (one torch import instead of three); prints [[status, stderr], ...].
RUN_ENTRY_POINTS = """
import json, os, runpy, sys, tempfile, traceback
results = []
for cmd in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)  # the descriptor: all the process would print, warnings included
        try:
            if cmd[0] == "-m":
                sys.argv = [cmd[1], *cmd[2:]]
                runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = cmd
                runpy.run_path(cmd[0], run_name="__main__")
            status = 0
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        err.seek(0)
        results.append([status, err.read()])
print(json.dumps(results))
"""


def test_a_world_size_without_a_launcher_stops_with_one_line(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k not in WORLD_SIZE_VARS}, "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmds = [["train.py", *TINY, f"train.out_dir={tmp_path / 'r'}"],
            ["sample.py", "bulk", "--ckpt", str(tmp_path / "none.pt"),
             "--out", str(tmp_path / "s")],
            ["-m", "sit_vit5.cache_latents", "--data-dir", str(tmp_path),
             "--out", str(tmp_path / "c")]]
    run = subprocess.run([sys.executable, "-c", RUN_ENTRY_POINTS, json.dumps(cmds)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert len(results) == len(cmds)
    for cmd, (status, stderr) in zip(cmds, results):
        assert status == 2, (cmd, stderr[-2000:])
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (cmd, stderr)
        assert "WORLD_SIZE=2" in lines[0] and "torchrun" in lines[0], (cmd, stderr)
