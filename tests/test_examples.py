"""examples/: the multi-node launch scripts run as written with stand-in launchers on PATH (torchrun, accelerate,
srun, scontrol record their arguments), and what they would launch parses: torchrun's and accelerate's own
parsers, then train.py's command line and config (with ``train`` replaced by a recorder)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sit_vit5.training import TrainResult

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: A launcher stand-in: appends {"argv", "env"} to $FAKE_LOG; with FAKE_WAIT_USR1 it waits for SIGUSR1 first
#: (writing $FAKE_LOG.ready once it waits) and records it. Exits with $FAKE_STATUS (default 0).
FAKE = """#!{python}
import json, os, signal, sys, time
got = []
if os.environ.get("FAKE_WAIT_USR1"):
    signal.signal(signal.SIGUSR1, lambda *a: got.append("USR1"))
    open(os.environ["FAKE_LOG"] + ".ready", "w").close()
    deadline = time.time() + 30
    while not got and time.time() < deadline:
        time.sleep(0.05)
keep = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "signals": got,
                        "env": {{k: os.environ.get(k) for k in keep}}}}) + "\\n")
sys.exit(int(os.environ.get("FAKE_STATUS", "0")))
"""


@pytest.fixture
def fake_bin(tmp_path):
    """A bin/ directory with torchrun, accelerate, srun and scontrol stand-ins; returns (env, log path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("torchrun", "accelerate", "srun"):
        path = bin_dir / tool
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    scontrol = bin_dir / "scontrol"  # `show hostnames LIST` prints two nodes; anything else is recorded
    scontrol.write_text('#!/usr/bin/env bash\nif [[ $1 == show ]]; then printf "node01\\nnode02\\n"; else '
                        'echo "{\\"tool\\": \\"scontrol\\", \\"argv\\": [\\"$1\\", \\"$2\\"]}" >> "$FAKE_LOG"; fi\n')
    scontrol.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "OUT_DIR": str(tmp_path / "run"), "PYTHONPATH": str(ROOT)}
    return env, log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def parse_train_cli(argv: list[str]) -> tuple[dict, str | None]:
    """train.py's own parsing and config resolution on ``argv``; returns (config, resume) it would train."""
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    seen = {}

    def recorder(cfg: dict, resume: str | None) -> TrainResult:
        seen.update(cfg=cfg, resume=resume)
        return TrainResult(Path(cfg["train"]["out_dir"]), 0, None, None, config=cfg)

    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # the scripts cd to the repository root; config paths are relative to it
        assert script.main(argv, train_fn=recorder) == 0
    finally:
        os.chdir(cwd)
    return seen["cfg"], seen["resume"]


def add_checkpoint(out_dir: Path) -> None:
    (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out_dir / "checkpoints" / "0000010.pt").write_bytes(b"")


def torchrun_config(argv: list[str]):
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(argv)
    config, _, _ = config_from_args(args)
    return args, config, args.training_script_args


def test_torchrun_example_is_a_c10d_launch_of_train_py(fake_bin, tmp_path):
    env, log = fake_bin
    env.update(HEAD="node01", NNODES="4")
    run = subprocess.run([str(EXAMPLES / "torchrun_multinode.sh"), "train.steps=10"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (call,) = calls(log)
    args, config, script_args = torchrun_config(call["argv"])
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (4, 4, 8)
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "node01:29500" and config.run_id == "run"
    assert args.training_script == "train.py"
    cfg, resume = parse_train_cli(script_args)
    assert resume is None and cfg["train"]["steps"] == 10 and cfg["train"]["out_dir"] == str(tmp_path / "run")
    assert cfg["model"]["name"] == "ViT5-XL/2"
    add_checkpoint(tmp_path / "run")  # a restarted job continues the run
    subprocess.run([str(EXAMPLES / "torchrun_multinode.sh")], env=env, check=True, capture_output=True, timeout=60)
    _, _, script_args = torchrun_config(calls(log)[-1]["argv"])
    assert parse_train_cli(script_args)[1] == "latest"


def test_torchrun_example_names_the_missing_variable(fake_bin):
    env, log = fake_bin
    run = subprocess.run([str(EXAMPLES / "torchrun_multinode.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "HEAD" in run.stderr and not calls(log)


def test_accelerate_example_launches_what_the_torchrun_example_does(fake_bin):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import _filter_args, prepare_multi_gpu_env

    env, log = fake_bin
    env.update(HEAD="node01", NODE_RANK="1", NNODES="2")
    for script in ("accelerate_multinode.sh", "torchrun_multinode.sh"):
        subprocess.run([str(EXAMPLES / script), "train.steps=7"], env=env, check=True, capture_output=True,
                       timeout=60)
    acc_call, torchrun_call = calls(log)
    assert acc_call["argv"][0] == "launch"
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        args = launch_command_parser().parse_args(acc_call["argv"][1:])
        args, _, _ = _validate_launch_command(args)
    finally:
        os.chdir(cwd)
    assert args.multi_gpu and args.machine_rank == 1
    from torch.distributed.run import config_from_args, get_args_parser

    prepare_multi_gpu_env(args)  # what `accelerate launch` hands torchrun (its multi_gpu_launcher's steps)
    acc_script_args = args.training_script_args
    args = _filter_args(args, get_args_parser(), ["--training_script", args.training_script,
                                                  "--training_script_args", args.training_script_args])
    acc_config, _, _ = config_from_args(args)
    _, tr_config, tr_script_args = torchrun_config(torchrun_call["argv"])
    for field in ("min_nodes", "max_nodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint"):
        assert getattr(acc_config, field) == getattr(tr_config, field), field
    assert acc_config.rdzv_backend == "c10d"
    assert parse_train_cli(acc_script_args)[0] == parse_train_cli(tr_script_args)[0]


def sbatch_directives() -> list[str]:
    return [line.split(None, 1)[1].strip() for line in (EXAMPLES / "slurm" / "train.sbatch").read_text().splitlines()
            if line.startswith("#SBATCH")]


def slurm_env(env: dict) -> dict:
    env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}  # the script derives it from the CPUs
    return {**env, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2",
            "SLURM_NTASKS_PER_NODE": "8", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_CPUS_PER_TASK": "12"}


def test_sbatch_directives_and_the_task_command(fake_bin, tmp_path):
    directives = sbatch_directives()
    for needed in ("--signal=B:USR1@120", "--requeue", "--ntasks-per-node=8", "--gpus-per-node=8"):
        assert needed in directives
    env, log = fake_bin
    run = subprocess.run(["bash", str(EXAMPLES / "slurm" / "train.sbatch"), "train.steps=5"], env=slurm_env(env),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    (call,) = calls(log)  # srun once, no requeue
    assert call["tool"] == "srun" and call["env"]["MASTER_ADDR"] == "node01" and call["env"]["OMP_NUM_THREADS"] == "12"
    argv = call["argv"]
    task = argv.index("examples/slurm/task.sh")
    assert all(a.startswith("--") for a in argv[:task])
    python, script, *train_args = argv[task + 1:]
    assert python == "python" and script == "train.py"
    cfg, resume = parse_train_cli(train_args)
    assert resume is None and cfg["train"]["steps"] == 5 and cfg["train"]["out_dir"] == str(tmp_path / "run")


def test_sbatch_forwards_usr1_to_the_tasks_and_requeues(fake_bin, tmp_path):
    env, log = fake_bin
    add_checkpoint(tmp_path / "run")
    env = {**slurm_env(env), "FAKE_WAIT_USR1": "1", "FAKE_STATUS": "1"}
    proc = subprocess.Popen(["bash", str(EXAMPLES / "slurm" / "train.sbatch")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ready = Path(str(log) + ".ready")
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    proc.send_signal(signal.SIGUSR1)  # what Slurm sends the batch shell 120 s before the end (B:USR1@120)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    srun, requeue = calls(log)
    assert srun["signals"] == ["USR1"]  # forwarded through srun to the training processes
    assert requeue == {"tool": "scontrol", "argv": ["requeue", "4242"]}
    assert "--resume" in srun["argv"] and srun["argv"][srun["argv"].index("--resume") + 1] == "latest"


def test_slurm_task_maps_slurm_variables_to_torch_distributed(tmp_path):
    env = {**os.environ, "SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "8(x2)"}
    env.pop("SLURM_NTASKS_PER_NODE", None)
    out = subprocess.run([str(EXAMPLES / "slurm" / "task.sh"), sys.executable, "-c",
                          "import os, json; print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', "
                          "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK')}))"],
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                                      "NODE_RANK": "1"}


def test_shell_scripts_are_valid_bash():
    scripts = [*EXAMPLES.glob("*.sh"), *EXAMPLES.glob("slurm/*")]
    assert EXAMPLES / "slurm" / "task.sh" in scripts and len(scripts) >= 3, scripts
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
