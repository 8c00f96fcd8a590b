"""The training loop: one function, ``train(cfg, resume)``, that runs unchanged on one CPU, one GPU,
``accelerate launch`` and ``torchrun`` (DDP by default, FSDP2 as an option: ``training/fsdp.py``).
Under a multi-process launcher it joins the launcher's group (gloo when no GPU is visible) or stops
with an error naming the variable.

Reproducibility. All randomness is a pure function of ``train.seed`` and the position in training:

* model init: the global RNG seeded with ``seed`` (same on every process);
* data order: a permutation per epoch from a generator seeded by (seed, epoch)
  (:class:`StepBatchSampler`); augmentation: per (seed, epoch, item) inside the dataset;
* noise, t, class dropout, VAE posterior samples: before each micro-batch the global RNG is
  re-seeded from (seed, step, chunk) with ``chunk = accumulation index × world size + rank``.

So a run resumed at step k continues exactly as the uninterrupted run (bit-identical on CPU), and
the same global batch cut into the same number of micro-batches gives the same update however those
are spread over processes and accumulation steps (e.g. 2 processes × 1 = 1 process × 2 accumulation
steps, up to the order of the gradient sums). The saved RNG states are restored too, for anything
outside this scheme.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from ..config import Config, ConfigError, save_config, validate_architecture
from ..data import DATASETS, build_dataset
from ..distributed import check_group, describe_group, prepare_launch
from ..images import save_grid
from ..io import unwritable_dir_reason
from ..models import count_params, model_from_config
from ..objective import Objective, create_objective
from ..precision import autocast, grad_scaler
from ..runtime import set_cpu_threads
from ..sampling import SampleSpec, SamplingPipeline
from ..transport.rng import mix_seed
from ..vae import decoder, downsampling_factor, encode, load_vae, vae_enabled
from . import fsdp
from .checkpoint import (
    CKPT_DIR,
    check_compatible,
    latest_checkpoint,
    package_versions,
    read_checkpoint,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .diagnostics import GateMonitor
from .ema import create_ema, update_ema
from .logging import MetricLogger
from .optim import param_groups
from .preemption import PreemptionGuard

_SALT_DATA, _SALT_NOISE = 0xDA7A, 0x5EED  # separate the data-order and noise streams of one seed


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; ``step`` is the optimizer step that produced it."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


# ----------------------------------------------------------------------------- data order


class StepBatchSampler(Sampler[list[int]]):
    """Yields, for one process, the dataset indices of each optimizer step of an epoch.

    The epoch's order is ``randperm(len)`` from a generator seeded by (seed, epoch); global batch b
    is ``perm[b·G:(b+1)·G]``, cut into ``world × accum`` chunks of ``G / (world × accum)``; this
    process gets chunks ``a·world + rank`` for a = 0..accum−1, concatenated in that order (its
    ``accum`` micro-batches). The last partial global batch of an epoch is dropped.
    ``set_epoch(epoch, start_batch)`` skips the first batches, which is how a resumed run continues
    mid-epoch.
    """

    def __init__(self, num_items: int, global_batch: int, world_size: int = 1, rank: int = 0,
                 grad_accum: int = 1, seed: int = 0) -> None:
        if global_batch % (world_size * grad_accum):
            raise ConfigError(f"data.global_batch_size={global_batch} is not divisible by "
                              f"processes ({world_size}) × train.grad_accum ({grad_accum})")
        if num_items < global_batch:
            raise ConfigError(f"the dataset has {num_items} items, fewer than "
                              f"data.global_batch_size={global_batch}")
        self.num_items, self.global_batch = num_items, global_batch
        self.world_size, self.rank, self.grad_accum, self.seed = world_size, rank, grad_accum, seed
        self.micro_batch = global_batch // (world_size * grad_accum)
        self.batches_per_epoch = num_items // global_batch
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def epoch_permutation(self, epoch: int) -> Tensor:
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, _SALT_DATA))
        return torch.randperm(self.num_items, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.epoch_permutation(self.epoch)
        m = self.micro_batch
        for b in range(self.start_batch, self.batches_per_epoch):
            base = b * self.global_batch
            chunks = [a * self.world_size + self.rank for a in range(self.grad_accum)]
            yield [i for c in chunks for i in perm[base + c * m: base + (c + 1) * m].tolist()]


# ----------------------------------------------------------------------------- building blocks


def build_dataset_from_config(cfg: Config) -> Dataset:
    """The dataset of the ``data`` section (each kind reads only its own keys), seeded with
    ``train.seed``."""
    if cfg["data"]["kind"] not in DATASETS:
        raise ConfigError(f"data.kind={cfg['data']['kind']!r}; valid: {', '.join(DATASETS)}")
    return build_dataset({**cfg["data"], "seed": cfg["train"]["seed"]})


def resolve_data_dependent(cfg: Config, dataset: Dataset, vae: nn.Module | None) -> Config:
    """A copy of ``cfg`` with ``model.input_size / in_channels / num_classes`` filled from the data;
    values already given are checked against it (ConfigError)."""
    channels, height, _ = dataset.sample_shape
    kind, vae_name = cfg["data"]["kind"], cfg["vae"]["name"]
    if vae is not None and kind != "latents":  # images encoded on the fly
        if channels != 3:
            raise ConfigError(f"vae.name={vae_name!r} encodes RGB images, but data.kind={kind!r} "
                              f"gives {channels}-channel images; set vae.name=none")
        channels, height = vae.config.latent_channels, height // downsampling_factor(vae)
    if kind == "latents" and vae_enabled(vae_name):
        if not math.isclose(dataset.scaling_factor, cfg["vae"]["scaling_factor"], rel_tol=1e-6):
            raise ConfigError(f"vae.scaling_factor={cfg['vae']['scaling_factor']} but the latent "
                              f"cache was made with {dataset.scaling_factor}")
    resolved = copy.deepcopy(cfg)
    derived = {"input_size": height, "in_channels": channels, "num_classes": dataset.num_classes}
    for key, value in derived.items():
        given = cfg["model"].get(key)
        if given is None:
            resolved["model"][key] = value
        elif key == "num_classes" and given < value:
            raise ConfigError(f"model.num_classes={given} but the dataset has {value} classes")
        elif key != "num_classes" and given != value:
            raise ConfigError(f"model.{key}={given} but the data gives {value}; leave it unset "
                              "(null) to derive it")
    return resolved


def sample_spec(cfg_sample: dict[str, Any]) -> SampleSpec:
    """The ``sample`` section as a SampleSpec (ConfigError naming the section on a bad value)."""
    try:
        return SampleSpec.resolve(cfg_sample)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"sample: {err}") from err


def compute_loss(transport: Objective, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-sample training loss (B,) of either objective (SiT's transport, DiT's diffusion). A
    module-level function so that tests can wrap it."""
    return transport.loss(model, x, y)


def learning_rate(cfg_optim: dict[str, Any], step: int) -> float:
    """lr of optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``, then constant.
    """
    warmup = cfg_optim["warmup_steps"]
    return cfg_optim["lr"] * (min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)


def grid_classes(cfg_sample: dict[str, Any], num_classes: int) -> list[int]:
    """Class of each grid image: ``sample.classes`` cycled to ``num_images``, or 0, 1, 2, ... mod
    num_classes."""
    n, classes = cfg_sample["num_images"], cfg_sample["classes"]
    if classes is None:
        return [i % num_classes for i in range(n)]
    if not classes or any(not 0 <= int(c) < num_classes for c in classes):
        raise ConfigError(f"sample.classes={classes!r}: need class ids in [0, {num_classes})")
    return [int(classes[i % len(classes)]) for i in range(n)]


def grid_images(ema: nn.Module, transport: Objective, cfg: Config, device: torch.device,
                vae: nn.Module | None = None) -> Tensor:
    """Grid images (N, C, H, W) in [0, 1] (uint8 steps) from the EMA model: samples 0..N-1 of the
    sampling pipeline with the ``sample`` section's settings, global seed ``sample.seed`` and
    classes ``grid_classes`` (so image i equals sample.py's image i for the same checkpoint, seed
    and class). Latent models are decoded with ``vae``."""
    s, m = cfg["sample"], cfg["model"]
    decode = decoder(vae, cfg["vae"]["scaling_factor"]) if vae is not None else None
    shape = (m["in_channels"], m["input_size"], m["input_size"])
    was_training = ema.training
    pipe = SamplingPipeline(ema, transport, sample_spec(s), shape, m["num_classes"], decode, device,
                            source=f"the EMA of the run in {cfg['train']['out_dir']}")
    labels = grid_classes(s, m["num_classes"])
    images = pipe.generate(range(s["num_images"]), s["seed"], labels).images
    ema.train(was_training)
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


# ----------------------------------------------------------------------------- accelerate


def _make_accelerator(cfg: Config) -> Accelerator:
    """accelerate in the launcher's group: gloo when no GPU is visible (or train.cpu), else NCCL; a
    group that differs from the launcher's WORLD_SIZE is a LaunchError."""
    # accelerate keeps one process-wide state; forget the previous train() call's precision and
    # plugins so that several runs with different settings can share a process (tests, notebooks).
    AcceleratorState._reset_state(reset_partial_state=False)
    t = cfg["train"]
    cpu = prepare_launch(t["cpu"])
    # FSDP is applied by the loop (FSDP2, fsdp.py): accelerate's plugin does nothing on a CPU group
    compile_here = t["compile"] and t["distributed"] != "fsdp"
    accelerator = Accelerator(cpu=cpu, mixed_precision="bf16" if t["precision"] == "bf16" else "no",
                              dynamo_backend="inductor" if compile_here else "no")
    check_group(accelerator.num_processes, cpu)
    return accelerator


# ----------------------------------------------------------------------------- the loop


class _MetricWindow:
    """Means of loss and grad norm since the last flush, and the throughput with pauses left out."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch, self.run_start = global_batch, time.perf_counter()
        self._reset()

    def _reset(self) -> None:
        self.loss = self.grad_norm = self.idle = 0.0
        self.steps, self.start = 0, time.perf_counter()

    def add(self, loss: float, grad_norm: float) -> None:
        self.loss, self.grad_norm = self.loss + loss, self.grad_norm + grad_norm
        self.steps += 1

    @contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.idle += time.perf_counter() - start

    def flush(self, epoch: int, lr: float) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start - self.idle, 1e-9)
        steps = max(self.steps, 1)
        metrics = {"epoch": epoch, "loss": self.loss / steps, "grad_norm": self.grad_norm / steps,
                   "lr": lr, "steps_per_s": self.steps / elapsed,
                   "img_per_s": self.steps * self.global_batch / elapsed,
                   "time_s": time.perf_counter() - self.run_start}
        self._reset()
        return metrics


@dataclass
class TrainResult:
    """What ``train`` returns: the run directory, the final step, the last checkpoint and grid
    written, the (all-process mean) loss of every optimizer step this call ran, and the resolved
    config (the request with the data-dependent model keys filled in)."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    sample_grid: Path | None
    losses: list[float] = field(default_factory=list)
    config: Config = field(default_factory=dict)
    preempted: str | None = None  # the signal (e.g. "SIGTERM") that stopped the run after a checkpoint
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
    """Everything a ``train`` call builds; the named steps read it and update
    ``position``/``result``.

    ``cfg`` is the resolved config; ``model`` the accelerate-prepared (DDP) or FSDP2-sharded model,
    ``unwrapped`` the bare module behind it (the sharded module itself under FSDP); ``vae`` is None
    in pixel space (and on processes that neither encode nor sample); ``ema_shards`` holds the EMA's
    shards under FSDP (``ema`` is then refreshed from them for checkpoints and grids).
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
    transport: Objective  # SiT's Transport or DiT's GaussianDiffusion (transport.objective)
    gates: GateMonitor
    logger: MetricLogger
    position: Position
    result: TrainResult
    ema_shards: fsdp.ShardedEMA | None = None
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler (None in fp32 / bf16)

    @property
    def sharded(self) -> bool:
        return self.ema_shards is not None

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


def build(cfg: Config, resume: str | None) -> Run:
    """Accelerator, data (and VAE), model, EMA, optimizer and logger for ``cfg``; restores the state
    of the checkpoint ``resume`` names (model, EMA, optimizer, position, RNG)."""
    t, o = cfg["train"], cfg["optim"]
    accelerator = _make_accelerator(cfg)
    device, main = accelerator.device, accelerator.is_main_process
    if device.type == "cuda":  # as DiT/SiT: TF32 matmuls in fp32 training
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(t["out_dir"])
    problem = unwritable_dir_reason(run_dir)
    if problem:
        raise ConfigError(f"train.out_dir={t['out_dir']}: cannot write there ({problem})")
    validate_architecture(cfg["model"])
    ckpt_path = resolve_resume(resume, run_dir) if resume else None
    if ckpt_path is None and latest_checkpoint(run_dir / CKPT_DIR) is not None:
        raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume latest to continue "
                          "that run, or choose another train.out_dir")

    # data (and the VAE when images are encoded on the fly or grids need decoding)
    dataset = build_dataset_from_config(cfg)
    with_vae = vae_enabled(cfg["vae"]["name"])
    sampling = t["sample_every"] > 0
    if cfg["data"]["kind"] == "latents" and not with_vae and sampling:
        raise ConfigError("data.kind=latents with vae.name=none cannot decode sample grids: name "
                          "the VAE (vae.name) or set train.sample_every=0")
    needs_vae = with_vae and (cfg["data"]["kind"] != "latents" or (sampling and main))
    vae = load_vae(cfg["vae"]["name"], device=device) if needs_vae else None
    cfg = resolve_data_dependent(cfg, dataset, vae)
    if sampling:
        sample_spec(cfg["sample"])  # a bad sample section fails now, not at the first grid
    world, rank = accelerator.num_processes, accelerator.process_index
    batches = StepBatchSampler(len(dataset), cfg["data"]["global_batch_size"], world, rank,
                               t["grad_accum"], t["seed"])
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=cfg["data"]["num_workers"],
                        pin_memory=device.type == "cuda", generator=torch.Generator())

    # model, EMA, optimizer; Python's and NumPy's global RNGs are seeded too, so that every saved
    # RNG state is a function of the seed and the step (a resumed run's states equal a fresh run's)
    torch.manual_seed(t["seed"])
    random.seed(t["seed"])
    np.random.seed(t["seed"] % 2**32)  # noqa: NPY002  (the legacy global RNG is what others draw from)
    objective = create_objective(cfg["transport"])
    model = objective.prepare(model_from_config(cfg["model"]))
    threads = None
    if device.type == "cpu":
        count, reason = set_cpu_threads(count_params(model), t["cpu_threads"])
        threads = f"{count} ({reason})"
    if t["grad_checkpointing"]:
        model.set_grad_checkpointing(True)
    checkpoint = None
    if ckpt_path is not None:
        checkpoint = read_checkpoint(ckpt_path)
        check_compatible(checkpoint, cfg, ckpt_path)
        model.load_state_dict(checkpoint.pop("model"))  # pop: free each part once used
    ema = create_ema(model).to(device)
    if checkpoint is not None:
        ema.load_state_dict(checkpoint.pop("ema"))
    model.train()
    sharded = t["distributed"] == "fsdp" and world > 1  # one process: nothing to shard
    if sharded:
        model = fsdp.shard_model(model.to(device))
        if t["compile"]:
            model.compile()
    else:
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(param_groups(model, o["weight_decay"]), lr=o["lr"],
                                  betas=tuple(o["betas"]), eps=o["eps"])
    if checkpoint is not None and sharded:
        fsdp.load_optimizer_state(model, optimizer, checkpoint.pop("opt"))
    elif checkpoint is not None:
        optimizer.load_state_dict(checkpoint.pop("opt"))
    ema_shards = fsdp.ShardedEMA(model, ema) if sharded else None
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
                          extra_fields=tuple(gates.keys))
    last = latest_checkpoint(run_dir / CKPT_DIR)
    result = TrainResult(run_dir, position.step, last, None, config=cfg, cpu_threads=threads)
    return Run(cfg, accelerator, run_dir, dataset, batches, loader, vae, model, unwrapped, ema,
               optimizer, objective, gates, logger, position, result,
               ema_shards, scaler)


def describe(run: Run) -> str:
    """One line: model size, processes and backend in use, strategy, data, batch split, step range,
    run directory."""
    cfg, t, b = run.cfg, run.cfg["train"], run.batches
    n_params = sum(p.numel() for p in run.unwrapped.parameters())  # DTensors count their full size
    strategy = "FSDP2" if run.sharded else ("DDP" if b.world_size > 1 else "one process")
    threads = f" ({run.result.cpu_threads} threads)" if run.result.cpu_threads else ""
    precision = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast + loss scaling"}
    return (f"{cfg['model']['name']} ({n_params / 1e6:.2f}M parameters) on "
            f"{describe_group(b.world_size, run.device)}{threads}, {strategy}, "
            f"{precision[t['precision']]}; "
            f"{len(run.dataset)} items, global batch {cfg['data']['global_batch_size']} = "
            f"{b.world_size} × {t['grad_accum']} × "
            f"{b.micro_batch}; steps {run.position.step} → {t['steps']}; run dir {run.run_dir}")


def batches(run: Run) -> Iterator[tuple[Tensor, Tensor]]:
    """This process's (x, y) of each optimizer step from the current position, epoch after epoch."""
    while True:
        run.batches.set_epoch(run.position.epoch, run.position.batch_in_epoch)
        if hasattr(run.dataset, "set_epoch"):
            run.dataset.set_epoch(run.position.epoch)
        yield from run.loader


def train_step(run: Run, x: Tensor, y: Tensor, lr: float) -> tuple[float, float]:
    """One optimizer step on this process's share (x, y) of the global batch; returns the
    all-process mean loss and the global gradient norm (before clipping). Raises NonFiniteLossError
    before stepping."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    t, o, step = run.cfg["train"], run.cfg["optim"], run.position.step
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=run.device)
    accum, micro = t["grad_accum"], run.batches.micro_batch
    world, rank = accelerator.num_processes, accelerator.process_index
    for a, (xs, ys) in enumerate(zip(x.split(micro), y.split(micro))):
        torch.manual_seed(mix_seed(t["seed"], step, a * world + rank, _SALT_NOISE))
        xs, ys = xs.to(run.device, non_blocking=True), ys.to(run.device, non_blocking=True)
        if run.encode_on_the_fly:
            xs = encode(run.vae, xs, scaling_factor=run.cfg["vae"]["scaling_factor"])
        # all-reduce (DDP) or reduce-scatter (FSDP) the gradients once per step, on the last
        # micro-batch; FSDP's model is not accelerate-prepared, so autocast is applied here
        last = a == accum - 1
        if run.sharded:
            model.set_requires_gradient_sync(last)
        sync = nullcontext() if last or run.sharded else accelerator.no_sync(model)
        # accelerate autocasts a prepared (DDP) model in bf16; FSDP's model and fp16 are ours to cast
        ours = run.sharded or run.scaler is not None
        with sync, autocast(run.device, t["precision"]) if ours else nullcontext():
            loss = compute_loss(run.transport, model, xs, ys).mean()
            scaled = loss / accum
            accelerator.backward(run.scaler.scale(scaled) if run.scaler is not None else scaled)
        loss_sum += loss.detach()
    bare_optimizer = getattr(optimizer, "optimizer", optimizer)  # the scaler steps the torch optimizer
    if run.scaler is not None:  # clip and report the true gradient norm
        run.scaler.unscale_(bare_optimizer)
    max_norm = o["grad_clip"] or math.inf
    grad_norm = (fsdp.clip_grad_norm(model, max_norm) if run.sharded
                 else float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
    loss_value = accelerator.reduce(loss_sum / accum, reduction="mean").item()
    # fp16: an overflowing gradient is the scaler's business (it skips the step and lowers the scale)
    overflow_ok = run.scaler is not None and math.isfinite(loss_value)
    if not (math.isfinite(loss_value) and (math.isfinite(grad_norm) or overflow_ok)):
        last = latest_checkpoint(run.ckpt_dir)
        raise NonFiniteLossError(
            f"non-finite loss {loss_value} (grad norm {grad_norm}) at step {step + 1}; stopped "
            f"before the optimizer step. Last good checkpoint: {last or 'none written yet'}. Try a "
            "lower optim.lr, optim.grad_clip, optim.warmup_steps or train.precision=fp32.",
            step + 1)
    if run.scaler is not None:
        run.scaler.step(bare_optimizer)
        run.scaler.update()
    else:
        optimizer.step()
    if run.sharded:
        run.ema_shards.update(o["ema_decay"])
    else:
        update_ema(run.ema, run.unwrapped, o["ema_decay"])
    return loss_value, grad_norm


def log(run: Run, window: _MetricWindow, lr: float, bar: tqdm) -> None:
    """Flush the metric window and the gate statistics of the step's forward to the loggers, the
    progress bar and (main process) the console."""
    step = run.position.step
    metrics = {**window.flush(run.position.epoch, lr), **run.gates.metrics()}
    run.logger.log(step, metrics)
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['img_per_s']:.0f}")
    if run.main:
        gate = (f" | gate attn/mlp {metrics['gate/attn/mean']:.3f}/{metrics['gate/mlp/mean']:.3f}"
                if "gate/attn/mean" in metrics else "")
        tqdm.write(f"step {step:07d} | loss {metrics['loss']:.4f} | grad "
                   f"{metrics['grad_norm']:.3f} | lr {lr:.2e} | "
                   f"{_rate(metrics['steps_per_s'])} | {metrics['img_per_s']:.3g} img/s{gate}")


def _rate(steps_per_s: float) -> str:
    """``12.34 steps/s``, or ``s/step`` for slow steps (an XL/2 step on a CPU would read 0.00 steps/s)."""
    return f"{steps_per_s:.2f} steps/s" if steps_per_s >= 1 else f"{1 / max(steps_per_s, 1e-9):.1f} s/step"


def checkpoint(run: Run) -> None:
    """Save model, EMA, optimizer, config, position and RNG states (all processes take part)."""
    accelerator, t, pos = run.accelerator, run.cfg["train"], run.position
    accelerator.wait_for_everyone()
    if run.sharded:  # full state dicts in the usual layout: resumable under DDP or FSDP, any count
        model_state = fsdp.full_model_state(run.model)
        opt_state = fsdp.full_optimizer_state(run.model, run.optimizer)
        run.ema_shards.gather_into(run.ema)
    else:
        model_state, opt_state = run.unwrapped.state_dict(), run.optimizer.state_dict()
    if run.main:
        milestone = t["milestone_every"] > 0 and pos.step % t["milestone_every"] == 0
        state = {"model": model_state, "ema": run.ema.state_dict(), "opt": opt_state,
                 "args": run.cfg, "step": pos.step, "epoch": pos.epoch,
                 "batch_in_epoch": pos.batch_in_epoch, "rng": rng_state(),
                 "versions": package_versions(), "model_name": run.cfg["model"]["name"]}
        if run.scaler is not None:
            state["scaler"] = run.scaler.state_dict()
        run.result.checkpoint = save_checkpoint(state, run.ckpt_dir, pos.step, milestone,
                                                t["keep_last"])
        tqdm.write(f"saved checkpoint {run.result.checkpoint}")
    accelerator.wait_for_everyone()


def sample(run: Run) -> None:
    """Write the EMA's sample grid ``samples/{step:07d}.png`` (main process) and log it."""
    if run.sharded:
        run.ema_shards.gather_into(run.ema)  # collective
    if run.main:
        path = run.run_dir / "samples" / f"{run.position.step:07d}.png"
        images = grid_images(run.ema, run.transport, run.cfg, run.device, run.vae)
        save_grid(images, path, run.cfg["sample"]["nrow"])
        run.logger.log_image(run.position.step, path)
        run.result.sample_grid = path
    run.accelerator.wait_for_everyone()


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def train(cfg: Config, resume: str | None = None) -> TrainResult:
    """Train as ``cfg`` says (a config from ``load_config``; not modified); ``resume`` = "latest" |
    checkpoint path | run directory restores model, EMA, optimizer, step, data position and RNG
    states.

    Writes ``<train.out_dir>/{config.yaml, checkpoints/, samples/, metrics.jsonl, metrics.csv}``.
    Raises NonFiniteLossError (the last good checkpoint stays ``latest``),
    IncompatibleCheckpointError (resume from another model/config) or ConfigError.
    SIGTERM / SIGINT / SIGUSR1 finish the current step, write a checkpoint of it and return with
    ``result.preempted`` set to the signal's name (see ``preemption.PreemptionGuard``).
    """
    run = build(cfg, resume)
    with PreemptionGuard() as guard:  # from the start line on, a signal always ends in a checkpoint
        return _loop(run, guard)


def _loop(run: Run, guard: PreemptionGuard) -> TrainResult:
    """The steps of ``train`` from the run's position to ``train.steps`` (or to a signal)."""
    t, pos, start_step = run.cfg["train"], run.position, run.position.step
    if run.main:
        print(describe(run))
    window = _MetricWindow(run.cfg["data"]["global_batch_size"])
    bar = tqdm(total=t["steps"], initial=pos.step, unit="step", dynamic_ncols=True,
               disable=None if run.main else True)
    try:
        for x, y in batches(run) if pos.step < t["steps"] else ():
            lr = learning_rate(run.cfg["optim"], pos.step)
            log_now = pos.step + 1 == t["steps"] or _due(pos.step + 1, t["log_every"])
            with run.gates.capture() if log_now else nullcontext():  # read by log() below
                loss, grad_norm = train_step(run, x, y, lr)
            pos.advance(run.batches.batches_per_epoch)
            run.result.step = pos.step
            run.result.losses.append(loss)
            window.add(loss, grad_norm)
            bar.update(1)
            final = pos.step == t["steps"]
            if log_now:
                log(run, window, lr, bar)
            with window.paused():  # checkpoint and sampling time stay out of the throughput
                saved = (final or _due(pos.step, t["ckpt_every"])
                         or _due(pos.step, t["milestone_every"]))
                if saved:
                    checkpoint(run)
                if t["sample_every"] > 0 and (final or _due(pos.step, t["sample_every"])):
                    sample(run)
                if not final and guard.should_stop(run.accelerator):
                    if not saved:
                        checkpoint(run)
                    run.result.preempted = guard.requested or "a signal to another process"
                    break
            if final:
                break
    finally:
        bar.close()
        run.logger.close()
    if start_step == pos.step and run.main and run.result.preempted is None:
        print(f"nothing to do: the checkpoint is at step {pos.step} and train.steps={t['steps']}")
    run.accelerator.wait_for_everyone()
    return run.result
