"""The training loop: one function, ``train(cfg, resume)``, that runs unchanged on one CPU, one GPU,
``accelerate launch`` and ``torchrun`` (DDP by default, FSDP as an option).

Reproducibility. All randomness is a pure function of ``train.seed`` and the position in training:

* model init: the global RNG seeded with ``seed`` (same on every process);
* data order: a permutation per epoch from a generator seeded by (seed, epoch) (:class:`StepBatchSampler`);
  augmentation: per (seed, epoch, item) inside the dataset;
* noise, t, class dropout, VAE posterior samples: before each micro-batch the global RNG is re-seeded from
  (seed, step, chunk) with ``chunk = accumulation index × world size + rank``.

So a run resumed at step k continues exactly as the uninterrupted run (bit-identical on CPU), and the same
global batch cut into the same number of micro-batches gives the same update however those are spread over
processes and accumulation steps (e.g. 2 processes × 1 = 1 process × 2 accumulation steps, up to the order of
the gradient sums). The saved RNG states are restored too, for anything outside this scheme.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from ..config import Config, ConfigError, model_kwargs, save_config
from ..objective import (
    SAMPLE_METHODS,
    DiffusionSampler,
    create_objective,
    guided_channels,
    prepare_model,
    training_loss,
)
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

_SALT_DATA, _SALT_NOISE = 0xDA7A, 0x5EED  # separate the data-order and noise streams of one seed


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; ``step`` is the optimizer step that produced it."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def mix_seed(*values: int) -> int:
    """A 63-bit seed that depends on all ``values`` (NumPy SeedSequence hashing; nearby tuples differ)."""
    words = np.random.SeedSequence([int(v) for v in values]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


# ----------------------------------------------------------------------------- data order


class StepBatchSampler(Sampler[list[int]]):
    """Yields, for one process, the dataset indices of each optimizer step of an epoch.

    The epoch's order is ``randperm(len)`` from a generator seeded by (seed, epoch); global batch b is
    ``perm[b·G:(b+1)·G]``, cut into ``world × accum`` chunks of ``G / (world × accum)``; this process gets chunks
    ``a·world + rank`` for a = 0..accum−1, concatenated in that order (its ``accum`` micro-batches). The last
    partial global batch of an epoch is dropped. ``set_epoch(epoch, start_batch)`` skips the first batches,
    which is how a resumed run continues mid-epoch.
    """

    def __init__(self, num_items: int, global_batch: int, world_size: int = 1, rank: int = 0,
                 grad_accum: int = 1, seed: int = 0) -> None:
        if global_batch % (world_size * grad_accum):
            raise ConfigError(f"data.global_batch_size={global_batch} is not divisible by processes ({world_size}) "
                              f"× train.grad_accum ({grad_accum})")
        if num_items < global_batch:
            raise ConfigError(f"the dataset has {num_items} items, fewer than data.global_batch_size={global_batch}")
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


def build_model(cfg_model: dict[str, Any]) -> nn.Module:
    """``create_model(name, **overrides)`` from a resolved ``model`` section."""
    from ..models import create_model

    return create_model(cfg_model["name"], **model_kwargs(cfg_model))


def build_transport(cfg_transport: dict[str, Any]):
    """The training objective of the ``transport`` section: a Transport (sit) or a GaussianDiffusion (ddpm)."""
    return create_objective(cfg_transport)


def vae_enabled(cfg: Config) -> bool:
    name = cfg["vae"]["name"]
    return name is not None and str(name).lower() != "none"


def build_dataset_from_config(cfg: Config) -> Dataset:
    """The dataset of the ``data`` section (each kind reads only its own keys), seeded with ``train.seed``."""
    from ..data import DATASETS, build_dataset

    if cfg["data"]["kind"] not in DATASETS:
        raise ConfigError(f"data.kind={cfg['data']['kind']!r}; valid: {', '.join(DATASETS)}")
    return build_dataset({**cfg["data"], "seed": cfg["train"]["seed"]})


def resolve_data_dependent(cfg: Config, dataset: Dataset, vae: nn.Module | None) -> None:
    """Fill ``model.input_size / in_channels / num_classes`` from the data (in place); check what was given."""
    channels, height, _ = dataset.sample_shape
    if vae is not None and cfg["data"]["kind"] != "latents":  # images encoded on the fly
        if channels != 3:
            raise ConfigError(f"vae.name={cfg['vae']['name']!r} encodes RGB images, but data.kind="
                              f"{cfg['data']['kind']!r} gives {channels}-channel images; set vae.name=none")
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        channels, height = vae.config.latent_channels, height // factor
    if cfg["data"]["kind"] == "latents" and vae_enabled(cfg):
        if not math.isclose(dataset.scaling_factor, cfg["vae"]["scaling_factor"], rel_tol=1e-6):
            raise ConfigError(f"vae.scaling_factor={cfg['vae']['scaling_factor']} but the latent cache was made "
                              f"with {dataset.scaling_factor}")
    derived = {"input_size": height, "in_channels": channels, "num_classes": dataset.num_classes}
    for key, value in derived.items():
        given = cfg["model"].get(key)
        if given is None:
            cfg["model"][key] = value
        elif key == "num_classes" and given < value:
            raise ConfigError(f"model.num_classes={given} but the dataset has {value} classes")
        elif key != "num_classes" and given != value:
            raise ConfigError(f"model.{key}={given} but the data gives {value}; leave it unset (null) to derive it")


def compute_loss(transport, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-sample training loss (B,) of either objective. A module-level function so that tests can wrap it."""
    return training_loss(transport, model, x, y)


def learning_rate(cfg_optim: dict[str, Any], step: int) -> float:
    """lr of optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``, then constant."""
    warmup = cfg_optim["warmup_steps"]
    return cfg_optim["lr"] * (min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)


def grid_classes(cfg_sample: dict[str, Any], num_classes: int) -> list[int]:
    """Class of each grid image: ``sample.classes`` cycled to ``num_images``, or 0, 1, 2, ... mod num_classes."""
    n, classes = cfg_sample["num_images"], cfg_sample["classes"]
    if classes is None:
        return [i % num_classes for i in range(n)]
    if not classes or any(not 0 <= int(c) < num_classes for c in classes):
        raise ConfigError(f"sample.classes={classes!r}: need class ids in [0, {num_classes})")
    return [int(classes[i % len(classes)]) for i in range(n)]


@torch.no_grad()
def sample_images(ema: nn.Module, transport, cfg: Config, device: torch.device,
                  vae: nn.Module | None = None) -> Tensor:
    """Grid images (N, C, H, W) in [0, 1] from the EMA model, with fixed noise (``sample.seed``) and classes.

    Pixel models map [-1, 1] → [0, 1]; latent models are decoded with the VAE first.
    """
    from ..guidance import ClassifierFreeGuidance
    from ..transport import Sampler

    s, m = cfg["sample"], cfg["model"]
    labels = torch.tensor(grid_classes(s, m["num_classes"]), device=device)
    generator = torch.Generator().manual_seed(s["seed"])
    z = torch.randn(len(labels), m["in_channels"], m["input_size"], m["input_size"], generator=generator)
    if s["method"] in SAMPLE_METHODS["ddpm"]:
        sample_fn = DiffusionSampler(transport).build(s["method"], s["num_steps"])
    elif s["method"] == "ode":
        sample_fn = Sampler(transport).sample_ode(sampling_method=s["sampling_method"], num_steps=s["num_steps"])
    else:
        sample_fn = Sampler(transport).sample_sde(sampling_method=s["sampling_method"], num_steps=s["num_steps"])
    model_fn = ema
    if s["cfg_scale"] != 1.0:
        if m.get("class_dropout_prob", 0.1) <= 0:
            raise ConfigError("sample.cfg_scale != 1 needs a null class: the model has class_dropout_prob = 0")
        channels = guided_channels(cfg["transport"], None, m["in_channels"])
        model_fn = ClassifierFreeGuidance(ema, s["cfg_scale"], null_class=m["num_classes"], cfg_channels=channels)
    was_training = ema.training
    ema.eval()
    x = sample_fn(z.to(device), model_fn, generator=torch.Generator().manual_seed(s["seed"] + 1), y=labels)[-1]
    ema.train(was_training)
    if vae is not None:
        from ..vae import decode

        x = decode(vae, x, scaling_factor=cfg["vae"]["scaling_factor"])
    return ((x.float().clamp(-1, 1) + 1) / 2).cpu()


def save_grid(images: Tensor, path: str | os.PathLike, nrow: int | None = None, min_side: int = 64) -> None:
    """Save images (N, C, H, W) in [0, 1] as one PNG; tiny images are upscaled (nearest) to ≥ ``min_side``."""
    from torchvision.utils import save_image

    factor = max(1, math.ceil(min_side / images.shape[-1]))
    if factor > 1:
        images = F.interpolate(images, scale_factor=factor, mode="nearest")
    nrow = nrow or math.ceil(math.sqrt(len(images)))
    save_image(images, path, nrow=nrow, padding=max(2, factor // 2), pad_value=1.0)


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
        self.loss, self.grad_norm, self.steps = self.loss + loss, self.grad_norm + grad_norm, self.steps + 1

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
        metrics = {"epoch": epoch, "loss": self.loss / steps, "grad_norm": self.grad_norm / steps, "lr": lr,
                   "steps_per_s": self.steps / elapsed, "img_per_s": self.steps * self.global_batch / elapsed,
                   "time_s": time.perf_counter() - self.run_start}
        self._reset()
        return metrics


@dataclass
class TrainResult:
    """What ``train`` returns: the run directory, the final step, the last checkpoint and grid written, and
    the (all-process mean) loss of every optimizer step this call ran."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    sample_grid: Path | None
    losses: list[float] = field(default_factory=list)


def _make_accelerator(cfg: Config):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state; forget the previous train() call's precision/plugins so that
    # several runs with different settings can share a process (tests, notebooks). The process group stays.
    AcceleratorState._reset_state(reset_partial_state=False)
    t = cfg["train"]
    fsdp_plugin = None
    if t["distributed"] == "fsdp":  # minimal FSDP: full shard per transformer block; not tested on this machine
        from accelerate import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=1, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"], use_orig_params=True, state_dict_type="FULL_STATE_DICT")
    return Accelerator(cpu=t["cpu"], mixed_precision="bf16" if t["precision"] == "bf16" else "no",
                       fsdp_plugin=fsdp_plugin, dynamo_backend="inductor" if t["compile"] else "no")


def _is_fsdp(accelerator) -> bool:
    return accelerator.distributed_type.name == "FSDP"


def _full_params(accelerator, model: nn.Module):
    """Context in which the unwrapped model's parameters are full tensors (FSDP gathers them; else a no-op)."""
    if _is_fsdp(accelerator):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.summon_full_params(model, writeback=False)
    return nullcontext()


def _optimizer_state(accelerator, model: nn.Module, optimizer) -> dict[str, Any]:
    if _is_fsdp(accelerator):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.optim_state_dict(model, optimizer.optimizer)
    return optimizer.state_dict()


def _load_optimizer_state(accelerator, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
    if _is_fsdp(accelerator):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        state = FSDP.optim_state_dict_to_load(model, optimizer, state)
    optimizer.load_state_dict(state)


def train(cfg: Config, resume: str | None = None) -> TrainResult:
    """Train as ``cfg`` says (a resolved config from ``load_config``); ``resume`` = "latest" | checkpoint path |
    run directory restores model, EMA, optimizer, step, data position and RNG states.

    Writes ``<train.out_dir>/{config.yaml, checkpoints/, samples/, metrics.jsonl, metrics.csv}``.
    Raises NonFiniteLossError (the last good checkpoint stays ``latest``), IncompatibleCheckpointError
    (resume from another model/config) or ConfigError.
    """
    t, o = cfg["train"], cfg["optim"]
    accelerator = _make_accelerator(cfg)
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    main = accelerator.is_main_process
    if device.type == "cuda":  # as DiT/SiT: TF32 matmuls in fp32 training
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(t["out_dir"])
    ckpt_dir = run_dir / CKPT_DIR

    ckpt_path = resolve_resume(resume, run_dir) if resume else None
    if ckpt_path is None and latest_checkpoint(ckpt_dir) is not None:
        raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume latest to continue that run, or "
                          "choose another train.out_dir")

    # data (and the VAE when images are encoded on the fly or grids need decoding)
    dataset = build_dataset_from_config(cfg)
    encode_on_the_fly = vae_enabled(cfg) and cfg["data"]["kind"] != "latents"
    needs_vae = encode_on_the_fly or (vae_enabled(cfg) and t["sample_every"] > 0 and main)
    if cfg["data"]["kind"] == "latents" and not vae_enabled(cfg) and t["sample_every"] > 0:
        raise ConfigError("data.kind=latents with vae.name=none cannot decode sample grids: name the VAE "
                          "(vae.name) or set train.sample_every=0")
    vae = None
    if needs_vae:
        from ..vae import encode, load_vae

        vae = load_vae(cfg["vae"]["name"], device=device)
    resolve_data_dependent(cfg, dataset, vae)
    sampler = StepBatchSampler(len(dataset), cfg["data"]["global_batch_size"], world, rank, t["grad_accum"],
                               t["seed"])
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=cfg["data"]["num_workers"],
                        pin_memory=device.type == "cuda", generator=torch.Generator())

    # model, EMA, optimizer
    torch.manual_seed(t["seed"])
    model = prepare_model(build_model(cfg["model"]), cfg["transport"])
    if t["grad_checkpointing"]:
        model.set_grad_checkpointing(True)
    transport = build_transport(cfg["transport"])
    checkpoint = None
    if ckpt_path is not None:
        checkpoint = read_checkpoint(ckpt_path)
        check_compatible(checkpoint, cfg, ckpt_path)
        model.load_state_dict(checkpoint["model"])
    ema = create_ema(model).to(device)
    if checkpoint is not None:
        ema.load_state_dict(checkpoint["ema"])
    model.train()
    model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(param_groups(model, o["weight_decay"]), lr=o["lr"], betas=tuple(o["betas"]),
                                  eps=o["eps"])
    if checkpoint is not None:
        _load_optimizer_state(accelerator, model, optimizer, checkpoint["opt"])
    optimizer = accelerator.prepare(optimizer)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    step = epoch = batch_in_epoch = 0
    if checkpoint is not None:
        step, epoch, batch_in_epoch = checkpoint["step"], checkpoint["epoch"], checkpoint["batch_in_epoch"]
        set_rng_state(checkpoint["rng"])
        del checkpoint
    start_step = step

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    gates = GateMonitor(unwrapped)  # residual-branch strength, read from the logged step's own forward
    logger = MetricLogger(run_dir, enabled=main, tensorboard=t["tensorboard"], wandb=t["wandb"], config=cfg,
                          wandb_project=t["wandb_project"], resume_step=step, extra_fields=tuple(gates.keys))
    n_params = sum(p.numel() for p in unwrapped.parameters())
    if main:
        print(f"{cfg['model']['name']} ({n_params / 1e6:.2f}M parameters) on {world} process(es), {device}; "
              f"{len(dataset)} items, global batch {cfg['data']['global_batch_size']} = {world} × "
              f"{t['grad_accum']} × {sampler.micro_batch}; steps {step} → {t['steps']}; run dir {run_dir}")

    result = TrainResult(run_dir, step, latest_checkpoint(ckpt_dir), None)

    def checkpoint_now(at_step: int) -> None:
        accelerator.wait_for_everyone()
        model_state = accelerator.get_state_dict(model) if _is_fsdp(accelerator) else unwrapped.state_dict()
        opt_state = _optimizer_state(accelerator, model, optimizer)
        if main:
            milestone = t["milestone_every"] > 0 and at_step % t["milestone_every"] == 0
            state = {"model": model_state, "ema": ema.state_dict(), "opt": opt_state, "args": cfg,
                     "step": at_step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "rng": rng_state(),
                     "versions": package_versions(), "model_name": cfg["model"]["name"]}
            result.checkpoint = save_checkpoint(state, ckpt_dir, at_step, milestone, t["keep_last"])
            tqdm.write(f"saved checkpoint {result.checkpoint}")
        accelerator.wait_for_everyone()

    def grid_now(at_step: int) -> None:
        if main:
            (run_dir / "samples").mkdir(parents=True, exist_ok=True)
            path = run_dir / "samples" / f"{at_step:07d}.png"
            save_grid(sample_images(ema, transport, cfg, device, vae), path, cfg["sample"]["nrow"])
            logger.log_image(at_step, path)
            result.sample_grid = path
        accelerator.wait_for_everyone()

    def train_step(x: Tensor, y: Tensor, lr: float) -> tuple[float, float]:
        """One optimizer step on this process's share (x, y) of the global batch; returns the all-process
        mean loss and the global gradient norm (before clipping). Raises NonFiniteLossError before stepping."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        accum = t["grad_accum"]
        for a, (xs, ys) in enumerate(zip(x.split(sampler.micro_batch), y.split(sampler.micro_batch))):
            torch.manual_seed(mix_seed(t["seed"], step, a * world + rank, _SALT_NOISE))
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            if encode_on_the_fly:
                xs = encode(vae, xs, scaling_factor=cfg["vae"]["scaling_factor"])
            with accelerator.no_sync(model) if a < accum - 1 else nullcontext():  # all-reduce once per step
                loss = compute_loss(transport, model, xs, ys).mean()
                accelerator.backward(loss / accum)
            loss_sum += loss.detach()
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), o["grad_clip"] or math.inf))
        loss_value = accelerator.reduce(loss_sum / accum, reduction="mean").item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            last = latest_checkpoint(ckpt_dir)
            raise NonFiniteLossError(
                f"non-finite loss {loss_value} (grad norm {grad_norm}) at step {step + 1}; stopped before the "
                f"optimizer step. Last good checkpoint: {last or 'none written yet'}. Try a lower optim.lr, "
                "optim.grad_clip, optim.warmup_steps or train.precision=fp32.", step + 1)
        optimizer.step()
        with _full_params(accelerator, model):
            update_ema(ema, unwrapped, o["ema_decay"])
        return loss_value, grad_norm

    window = _MetricWindow(cfg["data"]["global_batch_size"])
    bar = tqdm(total=t["steps"], initial=step, unit="step", dynamic_ncols=True, disable=None if main else True)
    try:
        while step < t["steps"]:
            sampler.set_epoch(epoch, batch_in_epoch)
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            for x, y in loader:
                lr = learning_rate(o, step)
                log_now = (step + 1) % t["log_every"] == 0 or step + 1 == t["steps"]
                with gates.capture() if log_now else nullcontext():
                    loss_value, grad_norm = train_step(x, y, lr)
                step, batch_in_epoch = step + 1, batch_in_epoch + 1
                if batch_in_epoch == sampler.batches_per_epoch:
                    epoch, batch_in_epoch = epoch + 1, 0
                result.step = step
                result.losses.append(loss_value)
                window.add(loss_value, grad_norm)
                bar.update(1)
                final = step == t["steps"]
                if step % t["log_every"] == 0 or final:
                    metrics = {**window.flush(epoch, lr), **gates.metrics()}
                    logger.log(step, metrics)
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['img_per_s']:.0f}")
                    if main:
                        gate = (f" | gate attn/mlp {metrics['gate/attn/mean']:.3f}/{metrics['gate/mlp/mean']:.3f}"
                                if "gate/attn/mean" in metrics else "")
                        tqdm.write(f"step {step:07d} | loss {metrics['loss']:.4f} | grad {metrics['grad_norm']:.3f} "
                                   f"| lr {lr:.2e} | {metrics['steps_per_s']:.2f} steps/s | "
                                   f"{metrics['img_per_s']:.0f} img/s{gate}")
                with window.paused():  # checkpoint and sampling time stay out of the throughput
                    milestone = t["milestone_every"] > 0 and step % t["milestone_every"] == 0
                    if final or step % t["ckpt_every"] == 0 or milestone:
                        checkpoint_now(step)
                    if t["sample_every"] > 0 and (final or step % t["sample_every"] == 0):
                        grid_now(step)
                if final:
                    break
    finally:
        bar.close()
        logger.close()
    if start_step == step and main:
        print(f"nothing to do: the checkpoint is at step {step} and train.steps={t['steps']}")
    accelerator.wait_for_everyone()
    return result
