"""Building a training run (accelerator, data, VAE, model, EMA, optimizer, logger), restored
from a checkpoint when resuming, in one :class:`Run` that the loop steps."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ..config import Config, ConfigError, check_out_dir, save_config, validate_architecture
from ..models import count_params, model_from_config
from ..models.registry import _NAME, SIZES
from ..objective import Objective, create_objective
from ..utils.cpu_threads import set_cpu_threads
from ..utils.distributed import check_group, describe_group, prepare_launch
from ..utils.precision import grad_scaler
from ..utils.run_files import previous_checkpoint
from ..vae import load_vae, vae_enabled
from .batching import StepBatchSampler
from .checkpoint import (
    CKPT_DIR,
    CheckpointError,
    check_compatible,
    latest_checkpoint,
    read_checkpoint,
    resolve_resume,
    set_rng_state,
)
from .data import build_dataset_from_config, resolve_data_dependent
from .diagnostics import GateMonitor
from .ema import create_ema
from .logging import MetricLogger
from .optim import adamw_kernel, param_groups

if TYPE_CHECKING:
    from .fsdp import Sharded
    from .repa import RepaTraining

#: (objective, model, x (B, C, H, W), y (B,)) -> per-sample loss (B,): ``objective_loss`` or a
#: stand-in a test passes to ``train``
LossFn = Callable[[Objective, nn.Module, Tensor, Tensor], Tensor]


def objective_loss(objective: Objective, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The objective's own per-sample loss (B,) of ``model`` on ``x`` (B, C, H, W), ``y`` (B,)."""
    return objective.loss(model, x, y)


@dataclass
class TrainResult:
    """What ``train`` returns: run directory, final step, last checkpoint and grid, the
    all-process mean loss of each step this call ran, and the resolved config."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    sample_grid: Path | None
    losses: list[float] = field(default_factory=list)
    config: Config = field(default_factory=dict)
    preempted: str | None = None  # the signal (e.g. "SIGTERM") that stopped the run, checkpointed
    cpu_threads: str | None = None  # "N (reason)" on the CPU: the torch thread count chosen


@dataclass
class Position:
    """Where training is: optimizer steps done, and the data position (epoch, batch within it)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0

    def advance(self, batches_per_epoch: int) -> None:
        """One optimizer step done: move to the next batch (and epoch)."""
        self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
        if self.batch_in_epoch == batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0


@dataclass
class Run:
    """Everything a ``train`` call builds; the steps read it and update ``position``/``result``.
    ``model``: the DDP-prepared or FSDP2-sharded model, ``unwrapped`` the module behind it;
    ``vae``: None in pixel space or where unused; ``sharding``: the FSDP2 side (None: DDP or one
    process). The platform parts (FSDP2, REPA, the latent cache) are imported here only when the
    config asks for them.
    """

    cfg: Config
    accelerator: Accelerator
    run_dir: Path
    dataset: Dataset
    batches: StepBatchSampler
    loader: DataLoader
    vae: nn.Module | None
    model: nn.Module
    unwrapped: nn.Module
    ema: nn.Module
    optimizer: Any
    objective: Objective  # SiT's transport or DiT's diffusion (the config's transport.objective)
    gates: GateMonitor
    logger: MetricLogger
    position: Position
    result: TrainResult
    sharding: Sharded | None = None
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler (None in fp32 / bf16)
    loss_fn: LossFn = objective_loss
    repa: RepaTraining | None = None  # encoder, projector, hook when repa.encoder is set

    @property
    def sharded(self) -> bool:
        return self.sharding is not None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CKPT_DIR

    @property
    def encode_on_the_fly(self) -> bool:
        return vae_enabled(self.cfg["vae"]["name"]) and self.cfg["data"]["kind"] != "latents"


def _make_accelerator(cfg: Config) -> Accelerator:
    """accelerate in the launcher's group: gloo without a GPU (or train.cpu), else NCCL; a group
    other than the launcher's WORLD_SIZE is a LaunchError."""
    # accelerate's state is process-wide: forget the previous train() call's (tests, notebooks)
    AcceleratorState._reset_state(reset_partial_state=False)
    t = cfg["train"]
    cpu = prepare_launch(t["cpu"])
    # FSDP is applied by the loop (FSDP2, fsdp.py): accelerate's plugin does nothing on a CPU group
    compile_here = t["compile"] and t["distributed"] != "fsdp"
    accelerator = Accelerator(cpu=cpu, mixed_precision="bf16" if t["precision"] == "bf16" else "no",
                              dynamo_backend="inductor" if compile_here else "no")
    check_group(accelerator.num_processes, cpu)
    return accelerator


def _run_dir(cfg: Config, resume: str | None) -> tuple[Path, Path | None]:
    """The run directory (checked writable) and the checkpoint to resume from (None: fresh run,
    refused in a directory that holds checkpoints)."""
    t = cfg["train"]
    check_out_dir(cfg)
    run_dir = Path(t["out_dir"])
    validate_architecture(cfg["model"])
    ckpt_path = resolve_resume(resume, run_dir) if resume else None
    if ckpt_path is None and latest_checkpoint(run_dir / CKPT_DIR) is not None:
        raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume latest to continue "
                          "that run, or choose another train.out_dir")
    return run_dir, ckpt_path


def _data(cfg: Config, accelerator: Accelerator
          ) -> tuple[Config, Dataset, nn.Module | None, StepBatchSampler, DataLoader]:
    """The resolved config, dataset, VAE (if used here), batch sampler and loader."""
    t, device, main = cfg["train"], accelerator.device, accelerator.is_main_process
    dataset = build_dataset_from_config(cfg)
    with_vae = vae_enabled(cfg["vae"]["name"])
    sampling = t["sample_every"] > 0
    if cfg["data"]["kind"] == "latents" and not with_vae and sampling:
        raise ConfigError("data.kind=latents with vae.name=none cannot decode sample grids: name "
                          "the VAE (vae.name) or set train.sample_every=0")
    needs_vae = with_vae and (cfg["data"]["kind"] != "latents" or (sampling and main))
    vae = load_vae(cfg["vae"]["name"], device=device) if needs_vae else None
    cfg = resolve_data_dependent(cfg, dataset, vae)
    world, rank = accelerator.num_processes, accelerator.process_index
    batches = StepBatchSampler(len(dataset), cfg["data"]["global_batch_size"], world, rank,
                               t["grad_accum"], t["seed"])
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=cfg["data"]["num_workers"],
                        pin_memory=device.type == "cuda", generator=torch.Generator())
    return cfg, dataset, vae, batches, loader


def _seed_global_rngs(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global RNGs (saved RNG states: f(seed, step))."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002  (the legacy global RNG is what others draw from)


def build(cfg: Config, resume: str | None, loss_fn: LossFn = objective_loss) -> Run:
    """The :class:`Run` of ``cfg``, restored from the checkpoint ``resume`` names (if any);
    ``loss_fn``: the per-sample loss the steps use."""
    t, o = cfg["train"], cfg["optim"]
    accelerator = _make_accelerator(cfg)
    device, main = accelerator.device, accelerator.is_main_process
    if device.type == "cuda":  # as DiT/SiT: TF32 matmuls in fp32 training
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run_dir, ckpt_path = _run_dir(cfg, resume)
    cfg, dataset, vae, batches, loader = _data(cfg, accelerator)

    # model, EMA, optimizer; each part of a resumed checkpoint is popped once used (memory)
    _seed_global_rngs(t["seed"])
    objective = create_objective(cfg["transport"])
    model = model_from_config(cfg["model"])
    threads = None
    if device.type == "cpu":
        count, reason = set_cpu_threads(count_params(model), t["cpu_threads"])
        threads = f"{count} ({reason})"
    if t["grad_checkpointing"]:
        model.set_grad_checkpointing(True)
    checkpoint = None
    if ckpt_path is not None:
        try:
            checkpoint = read_checkpoint(ckpt_path)
        except CheckpointError as err:  # a damaged newest file: name the one a rerun can use
            previous = previous_checkpoint(ckpt_path)
            if previous is None:
                raise
            raise CheckpointError(f"{err}; --resume {previous} continues from the one before "
                                  "it") from err
        check_compatible(checkpoint, cfg, ckpt_path)
        model.load_state_dict(checkpoint.pop("model"))
    ema = create_ema(model).to(device)
    if checkpoint is not None:
        ema.load_state_dict(checkpoint.pop("ema"))
    model.train()
    repa = None
    if cfg["repa"]["encoder"] is not None:  # after the EMA copy: its hook stays off the EMA
        channels = 3 if cfg["data"]["kind"] == "latents" else dataset.sample_shape[0]  # RGB beside
        from .repa import RepaTraining  # platform: only when repa.encoder is set

        repa = RepaTraining(cfg, model, channels, device)
        if checkpoint is not None:
            repa.load_state_dict(checkpoint.pop("repa", None), ckpt_path)
    sharded = t["distributed"] == "fsdp" and accelerator.num_processes > 1  # one: nothing to shard
    if sharded:
        from . import fsdp  # platform: only under train.distributed=fsdp with several processes

        model = fsdp.shard_model(model.to(device))
        if t["compile"]:
            model.compile()
    else:
        model = accelerator.prepare(model)
    groups = param_groups(model, o["weight_decay"])
    # fused on CUDA (28 B per parameter, not foreach's 72), torch's default on the CPU and FSDP
    optimizer = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                  **adamw_kernel(groups, sharded))
    if checkpoint is not None and sharded:
        fsdp.load_optimizer_state(model, optimizer, checkpoint.pop("opt"))
    elif checkpoint is not None:
        optimizer.load_state_dict(checkpoint.pop("opt"))
    sharding = fsdp.Sharded(model, ema) if sharded else None
    if not sharded:  # FSDP keeps the bare optimizer: no scaler in bf16, the wrapper adds nothing
        optimizer = accelerator.prepare(optimizer)
    scaler = grad_scaler(device, t["precision"])
    if checkpoint is not None and scaler is not None and "scaler" in checkpoint:
        scaler.load_state_dict(checkpoint.pop("scaler"))
    position = Position()
    if checkpoint is not None:
        position = Position(checkpoint["step"], checkpoint["epoch"], checkpoint["batch_in_epoch"])
        set_rng_state(checkpoint["rng"])
        del checkpoint

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    unwrapped = model if sharded else accelerator.unwrap_model(model, keep_torch_compile=False)
    # residual-branch strength, read from the logged step's forward (compiled: hooks from the start)
    gates = GateMonitor(unwrapped, persistent=t["compile"])
    logger = MetricLogger(run_dir, enabled=main, tensorboard=t["tensorboard"], wandb=t["wandb"],
                          config=cfg, wandb_project=t["wandb_project"], resume_step=position.step,
                          extra_fields=(*(repa.metric_names if repa else ()), *gates.keys))
    last = latest_checkpoint(run_dir / CKPT_DIR)
    result = TrainResult(run_dir, position.step, last, None, config=cfg, cpu_threads=threads)
    return Run(cfg, accelerator, run_dir, dataset, batches, loader, vae, model, unwrapped, ema,
               optimizer, objective, gates, logger, position, result, sharding, scaler,
               loss_fn, repa)


#: ``model`` keys that change a registry name's size (the log line names them when overridden)
SIZE_KEYS = ("depth", "hidden_size", "num_heads", "patch_size", "mlp_ratio")


def model_label(m: dict[str, Any]) -> str:
    """The model name with the size overrides that make it another size than the name says:
    ``ViT5-S/2 with depth=4, hidden_size=64, num_heads=4`` (the demo), else the bare name."""
    match = _NAME.match(m["name"])
    depth, hidden, heads = SIZES[match["size"]]
    named = {"depth": depth, "hidden_size": hidden, "num_heads": heads,
             "patch_size": int(match["patch"]), "mlp_ratio": 4.0}
    changed = [f"{k}={m[k]:g}" if k == "mlp_ratio" else f"{k}={m[k]}" for k in SIZE_KEYS
               if m.get(k) is not None and m[k] != named[k]]
    return f"{m['name']} with {', '.join(changed)}" if changed else m["name"]


def describe(run: Run) -> str:
    """One line: model size, processes, strategy, precision, data, batch split, steps, run dir."""
    cfg, t, b = run.cfg, run.cfg["train"], run.batches
    n_params = sum(p.numel() for p in run.unwrapped.parameters())  # DTensors count their full size
    strategy = "FSDP2" if run.sharded else ("DDP" if b.world_size > 1 else "one process")
    threads = f" ({run.result.cpu_threads} threads)" if run.result.cpu_threads else ""
    precision = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast + loss scaling"}
    return (f"{model_label(cfg['model'])} ({n_params / 1e6:.2f}M parameters) on "
            f"{describe_group(b.world_size, run.device)}{threads}, {strategy}, "
            f"{precision[t['precision']]}{', torch.compile' if t['compile'] else ''}; "
            f"{len(run.dataset)} items, global batch {cfg['data']['global_batch_size']} = "
            f"{b.world_size} × {t['grad_accum']} × "
            f"{b.micro_batch}; steps {run.position.step} → {t['steps']}; run dir {run.run_dir}"
            + (f"; {run.repa.describe()}" if run.repa is not None else ""))
