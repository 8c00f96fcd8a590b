"""Train a SiT / ViT-5 diffusion model (``python train.py`` in a checkout, ``sit-vit5-train`` when
installed).

    python train.py                               # the demo: tiny ViT-5 on 8×8 digits, CPU
    python train.py --config configs/X.yaml train.steps=1000 optim.lr=2e-4
    python train.py --config demo-dit             # the demo with DiT's objective (DDPM)
    python train.py --config configs/X.yaml --resume latest  # continue the run in train.out_dir
    python train.py --resume runs/X               # the same, with the run's saved config.yaml
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/X.yaml
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d ... train.py --config configs/X.yaml
    sbatch --nodes 4 examples/slurm/train.sbatch  # Slurm: docs/multinode.md

Settings: see sit_vit5/config.py (every key documented). ``--config`` also finds the shipped configs
from any directory (``configs/demo.yaml``, ``demo``, ``imagenet/sit-xl-2``). The resolved config is
saved as <train.out_dir>/config.yaml and inside every checkpoint.

SiT's and DiT's train.py flags work as aliases of config keys (``--model SiT-XL/2`` =
``model.name=SiT-XL/2``, ``--data-path``, ``--global-batch-size``, ...: see ``--help``), on the
defaults (ImageNet-style image folder, SD-VAE on the fly) unless ``--config`` is given:
``--results-dir R`` = ``train.out_dir=R/<model>``, a ``DiT-*`` model trains with DiT's objective,
``--ckpt F`` = ``--resume F``; ``--epochs`` is refused (the run counts optimizer steps).

Exit status: 0 done; 2 bad input (config key or value, data root, checkpoint, unreadable image, full
disk: one line naming the culprit; SIT_VIT5_DEBUG=1 shows the traceback); 1 the loss became NaN/inf;
3 pre-empted: SIGTERM, SIGINT or SIGUSR1 arrived, the current step finished and a checkpoint of it
was written (rerun with --resume latest to continue, bit-identically).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sit_vit5.cli.preflight import check_resume, check_torch_pair
from sit_vit5.config import (
    Config,
    ConfigError,
    check_out_dir,
    configs_dir,
    load_config,
    validate_models,
)
from sit_vit5.names import OBJECTIVE_OVERRIDES, name_objective
from sit_vit5.utils.errors import KNOWN_ERRORS, one_line, run_cli
from sit_vit5.utils.launcher import check_launcher_env

if TYPE_CHECKING:
    from sit_vit5.training import TrainResult

# The arguments, the config (keys, types, ranges), train.out_dir and the --resume file are checked
# before torch and the trainer are imported (seconds): a bad input is reported at once.

DEMO_CONFIG = "demo.yaml"  # in the shipped configs, found wherever the command runs
EXIT_PREEMPTED = 3  # a signal stopped the run after a checkpoint; rerun with --resume latest
#: SiT's / DiT's train.py flags -> the config key each sets (the value is parsed as YAML)
HABIT_FLAGS = {
    "--model": "model.name",
    "--data-path": "data.root",
    "--results-dir": "train.out_dir",
    "--global-batch-size": "data.global_batch_size",
    "--image-size": "data.image_size",
    "--num-classes": "model.num_classes",
    "--ckpt-every": "train.ckpt_every",
    "--log-every": "train.log_every",
    "--sample-every": "train.sample_every",
    "--global-seed": "train.seed",
    "--num-workers": "data.num_workers",
    "--path-type": "transport.path_type",
    "--prediction": "transport.prediction",
    "--loss-weight": "transport.loss_weight",
    "--cfg-scale": "sample.cfg_scale",
}


def default_config(resume: str | None) -> tuple[Path, list[str]]:
    """Config file and implied overrides without --config: the demo, or when resuming from a run
    directory / checkpoint, that run's config.yaml with train.out_dir set to where it now is."""
    if resume is None or resume == "latest":
        return configs_dir() / DEMO_CONFIG, []
    path = Path(resume)
    run_dir = path if path.is_dir() else path.parent.parent  # <run>/checkpoints/<file>.pt
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {resume}: no {run_dir / 'config.yaml'} to take the config "
                          "from; pass --config")
    return run_dir / "config.yaml", [f"train.out_dir={run_dir}"]


def parser() -> argparse.ArgumentParser:
    """The command line: --config, --resume and section.key=value overrides."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None,
                   help="experiment YAML (default: the demo, or with --resume PATH that run's "
                        "config.yaml)")
    p.add_argument("--resume", default=None, metavar="latest|PATH",
                   help="'latest' (the newest checkpoint of train.out_dir), a checkpoint file or a "
                        "run dir")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, values parsed as YAML (e.g. train.steps=100 "
                        "optim.betas=[0.9,0.95])")
    g = p.add_argument_group("SiT/DiT train.py flags (aliases of config keys; overrides win)")
    for flag, key in HABIT_FLAGS.items():
        g.add_argument(flag, dest=key, metavar="VALUE", help=f"= {key}=VALUE")
    g.add_argument("--wandb", action="store_true", dest="train.wandb", help="= train.wandb=true")
    g.add_argument("--vae", choices=("ema", "mse"), help="= vae.name=stabilityai/sd-vae-ft-VAE")
    g.add_argument("--ckpt", help="= --resume CKPT (SiT's resume flag)")
    g.add_argument("--epochs", help="refused: this trainer counts optimizer steps (train.steps)")
    return p


def habit_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides SiT/DiT's flags stand for (``--ckpt`` moves to ``args.resume``)."""
    if args.epochs is not None:
        raise ConfigError(f"--epochs {args.epochs}: this trainer counts optimizer steps, not "
                          "epochs; set train.steps (epochs x images / data.global_batch_size)")
    if args.ckpt is not None:
        if args.resume is not None and args.resume != args.ckpt:
            raise ConfigError(f"--ckpt {args.ckpt} and --resume {args.resume}: keep one")
        args.resume = args.ckpt
    overrides = [f"{key}={getattr(args, key)}" for key in HABIT_FLAGS.values()
                 if getattr(args, key) is not None]
    model, results = getattr(args, "model.name"), getattr(args, "train.out_dir")
    if model is not None and results is not None:  # SiT/DiT: one folder per experiment under it
        overrides.append(f"train.out_dir={Path(results) / model.replace('/', '-')}")
    if model is not None:  # DiT-*: DiT's objective and sampler
        overrides += OBJECTIVE_OVERRIDES.get(name_objective(model) or "", ())
    if getattr(args, "train.wandb"):
        overrides.append("train.wandb=true")
    if args.vae is not None:
        overrides.append(f"vae.name=stabilityai/sd-vae-ft-{args.vae}")
    return overrides


def _message(err: BaseException) -> str:
    hint = " (set data.skip_bad=true to skip unreadable images)"
    data = sys.modules.get("sit_vit5.image_data")  # imported if the error came from the data
    unreadable = data is not None and isinstance(err, data.UnreadableImageError)
    return one_line(err) + (hint if unreadable else "")


def main(argv: list[str] | None = None,
         train_fn: Callable[[Config, str | None], TrainResult] | None = None) -> int:
    """Run the command on ``argv``; returns the exit status. ``train_fn(cfg, resume)`` trains."""
    args = parser().parse_args(argv)
    statuses: dict[type[BaseException], int] = {}  # filled once the trainer is imported

    def run() -> int:
        check_launcher_env()  # a bad launch is the first thing wrong, whatever the config says
        habits = habit_overrides(args)
        if args.config or (habits and args.resume is None):  # SiT/DiT flags: on the defaults
            config, implied = args.config, []
        else:
            config, implied = default_config(args.resume)
        cfg = load_config(config, implied + habits + args.overrides, check_models=False)
        check_out_dir(cfg)
        if args.resume is not None:
            check_resume(args.resume, cfg["train"]["out_dir"])
        check_torch_pair()
        validate_models(cfg)  # imports the models (torch)
        result = _trainer(train_fn, statuses)(cfg, args.resume)
        if result.preempted:
            print(f"stopped by {result.preempted} after step {result.step}; checkpoint "
                  f"{result.checkpoint} written. Continue with --resume latest", file=sys.stderr)
            return EXIT_PREEMPTED
        return 0

    return run_cli("train.py", run, errors=KNOWN_ERRORS, render=_message, statuses=statuses)


def _trainer(train_fn: Callable[[Config, str | None], Any] | None,
             statuses: dict[type[BaseException], int]) -> Callable[[Config, str | None], Any]:
    """``train_fn``, else the trainer (imported now); registers exit status 1 for a NaN/inf loss."""
    from sit_vit5.training import NonFiniteLossError, train

    statuses[NonFiniteLossError] = 1
    return train_fn or train


if __name__ == "__main__":
    sys.exit(main())
