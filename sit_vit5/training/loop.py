"""The training loop: ``train(cfg, resume)``, unchanged on one CPU, one GPU, ``accelerate launch``
and ``torchrun`` (DDP, or FSDP2: ``training/fsdp.py``). ``build.build`` makes the :class:`Run`;
this module steps it: ``train_step``, logging, checkpoints and sample grids.

All randomness is a function of ``train.seed`` and the position in training: model init (global
RNG seeded with ``seed``), data order (per (seed, epoch), ``batching.StepBatchSampler``),
augmentation (per (seed, epoch, item)), and noise, t, class dropout and VAE samples (global RNG
re-seeded per (seed, step, chunk), ``chunk = accumulation index × world size + rank``). So a
resumed run continues exactly (bit-identical on CPU), and a global batch gives the same update
however its micro-batches are spread over processes and accumulation steps."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..config import Config, check_out_dir
from ..latent_norm import LatentNorm
from ..transport.rng import mix_seed
from ..utils.errors import SitVit5Error
from ..utils.launcher import launcher_rank
from ..utils.precision import autocast
from ..utils.run_files import hold_run_dir
from ..vae import encode
from .build import LossFn, Run, TrainResult, build, describe, objective_loss
from .checkpoint import latest_checkpoint, package_versions, rng_state, save_checkpoint
from .ema import update_ema
from .grids import write_grid
from .optim import learning_rate
from .preemption import PreemptionGuard
from .step_report import MetricWindow, console_line

SALT_NOISE = 0x5EED  # keeps the noise stream apart from the data-order stream (batching.SALT_DATA)


class NonFiniteLossError(SitVit5Error, RuntimeError):
    """The loss or gradient norm became NaN/inf; ``step`` is the optimizer step that produced it."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def batches(run: Run) -> Iterator[tuple[Tensor, ...]]:
    """This process's (x, y) of each optimizer step from the current position, epoch after epoch;
    (x, y, images) when a latent cache is read with its images (for REPA)."""
    while True:
        run.batches.set_epoch(run.position.epoch, run.position.batch_in_epoch)
        if hasattr(run.dataset, "set_epoch"):
            run.dataset.set_epoch(run.position.epoch)
        yield from run.loader


def train_step(run: Run, x: Tensor, y: Tensor, lr: float,
               images: Tensor | None = None) -> tuple[float, float]:
    """One optimizer step on this process's (x, y); returns the all-process mean loss and the
    global gradient norm before clipping. ``images``: (B, 3, H, W) in [-1, 1] beside cached latents,
    for REPA's encoder. Raises NonFiniteLossError before stepping."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    t, o, step = run.cfg["train"], run.cfg["optim"], run.position.step
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    if run.repa is not None:
        run.repa.zero_grad(lr)
    loss_sum = torch.zeros((), device=run.device)
    accum, micro = t["grad_accum"], run.batches.micro_batch
    world, rank = accelerator.num_processes, accelerator.process_index
    pixels = images.split(micro) if images is not None else (None,) * accum
    for a, (xs, ys, ims) in enumerate(zip(x.split(micro), y.split(micro), pixels)):
        torch.manual_seed(mix_seed(t["seed"], step, a * world + rank, SALT_NOISE))
        xs, ys = xs.to(run.device, non_blocking=True), ys.to(run.device, non_blocking=True)
        features = None
        if run.repa is not None:  # the clean images' features (no RNG drawn)
            clean = xs if ims is None else ims.to(run.device, non_blocking=True)
            features = run.repa.features(clean)
        if run.encode_on_the_fly:
            xs = encode(run.vae, xs, norm=LatentNorm.from_section(run.cfg["vae"]))
        # all-reduce (DDP) or reduce-scatter (FSDP) the gradients once per step, on the last
        # micro-batch; FSDP's model is not accelerate-prepared, so autocast is applied here
        last = a == accum - 1
        if run.sharded:
            model.set_requires_gradient_sync(last)
        sync = nullcontext() if last or run.sharded else accelerator.no_sync(model)
        # accelerate autocasts a prepared (DDP) model in bf16; FSDP's model and fp16 are ours
        ours = run.sharded or run.scaler is not None
        with sync, autocast(run.device, t["precision"]) if ours else nullcontext():
            if run.repa is None:
                loss = run.loss_fn(run.objective, model, xs, ys).mean()
            else:  # the same forward also gives the hidden state REPA aligns
                loss = run.repa.loss(partial(run.loss_fn, run.objective, model, xs, ys), features)
            scaled = loss / accum
            accelerator.backward(run.scaler.scale(scaled) if run.scaler is not None else scaled)
        loss_sum += loss.detach()
    bare_optimizer = getattr(optimizer, "optimizer", optimizer)  # the scaler steps torch's own
    if run.scaler is not None:  # clip and report the true gradient norm
        run.scaler.unscale_(bare_optimizer)
        if run.repa is not None:
            run.scaler.unscale_(run.repa.optimizer)
    grad_norm = clip_gradients(run, o["grad_clip"] or math.inf)
    loss_value = accelerator.reduce(loss_sum / accum, reduction="mean").item()
    if run.repa is not None:
        run.repa.step_metrics(accelerator.reduce, accum)
    # fp16: an overflowing gradient is the scaler's business (it skips the step, lowers the scale)
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
        if run.repa is not None:
            run.repa.step(run.scaler)
        run.scaler.update()
    else:
        optimizer.step()
        if run.repa is not None:
            run.repa.step(None)
    if run.sharded:
        run.sharding.ema.update(o["ema_decay"])
    else:
        update_ema(run.ema, run.unwrapped, o["ema_decay"])
    return loss_value, grad_norm


def clip_gradients(run: Run, max_norm: float) -> float:
    """Clip the gradients to ``max_norm`` (inf: none); returns their global norm before clipping.
    With REPA the projector's gradients count in the norm, as in REPA."""
    model = run.model
    if run.repa is None:
        return (run.sharding.clip_grad_norm(max_norm) if run.sharded
                else float(run.accelerator.clip_grad_norm_(model.parameters(), max_norm)))
    run.repa.sync_gradients(run.accelerator.num_processes)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if run.sharded:  # the full norm over the shards, then the local shards scaled in place
        model_norm = run.sharding.clip_grad_norm(math.inf)
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    else:  # what accelerate's clip_grad_norm_ computes (torch's, gradients already unscaled)
        model_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    return run.repa.clip_jointly(grads, model_norm, max_norm)


def log(run: Run, window: MetricWindow, lr: float, bar: tqdm) -> None:
    """Flush the metrics and gate statistics to the loggers, progress bar and console."""
    step = run.position.step
    metrics = {**window.flush(run.position.epoch, lr), **run.gates.metrics()}
    run.logger.log(step, metrics)
    bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['img_per_s']:.0f}")
    if run.main:
        tqdm.write(console_line(step, metrics, lr))


def checkpoint(run: Run) -> None:
    """Save model, EMA, optimizer, config, position and RNG states (all processes take part)."""
    accelerator, t, pos = run.accelerator, run.cfg["train"], run.position
    accelerator.wait_for_everyone()
    if run.sharded:  # full state dicts in the usual layout: resumable under DDP or FSDP, any count
        model_state, opt_state = run.sharding.full_states(run.optimizer)
        run.sharding.ema.gather_into(run.ema)
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
        if run.repa is not None:  # the projector and its AdamW: training-only, not in the EMA
            state["repa"] = run.repa.state_dict()
        run.result.checkpoint = save_checkpoint(state, run.ckpt_dir, pos.step, milestone,
                                                t["keep_last"], every=t["ckpt_every"])
        tqdm.write(f"saved checkpoint {run.result.checkpoint}")
    accelerator.wait_for_everyone()


def sample(run: Run) -> None:
    """Write the EMA's sample grid ``samples/{step:07d}.png`` (main process) and log it."""
    if run.sharded:
        run.sharding.ema.gather_into(run.ema)  # collective
    if run.main:
        path = write_grid(run.ema, run.objective, run.cfg, run.device, run.vae, run.position.step)
        run.logger.log_image(run.position.step, path)
        run.result.sample_grid = path
    run.accelerator.wait_for_everyone()


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def train(cfg: Config, resume: str | None = None, loss_fn: LossFn = objective_loss
          ) -> TrainResult:
    """Train as ``cfg`` says (from ``load_config``; not modified); ``resume`` = "latest" |
    checkpoint path | run directory restores model, EMA, optimizer, step, data position and RNG.
    ``loss_fn(objective, model, x, y)``: the per-sample loss (B,) of a micro-batch.

    Writes ``<train.out_dir>/{config.yaml, checkpoints/, samples/, metrics.jsonl, metrics.csv}``.
    Raises NonFiniteLossError (the last good checkpoint stays ``latest``),
    IncompatibleCheckpointError, ConfigError, or SettingError when another living run holds
    ``train.out_dir`` (``run_files.hold_run_dir``). SIGTERM / SIGINT / SIGUSR1 finish the step,
    write a checkpoint and return with ``result.preempted`` set to the signal's name."""
    check_out_dir(cfg)  # a file in the way is named before the lock below creates the folder
    # rank 0 holds train.out_dir while the run lives: a second run into it is refused
    with hold_run_dir(cfg["train"]["out_dir"], main=launcher_rank() == 0):
        run = build(cfg, resume, loss_fn)
        with PreemptionGuard() as guard:  # from the start line on, a signal ends in a checkpoint
            return _loop(run, guard)


def _loop(run: Run, guard: PreemptionGuard) -> TrainResult:
    """The steps of ``train`` from the run's position to ``train.steps`` (or to a signal)."""
    t, pos, start_step = run.cfg["train"], run.position, run.position.step
    if run.main:
        print(describe(run))
    window = MetricWindow(run.cfg["data"]["global_batch_size"])
    bar = tqdm(total=t["steps"], initial=pos.step, unit="step", dynamic_ncols=True,
               disable=None if run.main else True)
    try:
        for x, y, *images in batches(run) if pos.step < t["steps"] else ():
            lr = learning_rate(run.cfg["optim"], pos.step)
            log_now = pos.step + 1 == t["steps"] or _due(pos.step + 1, t["log_every"])
            with run.gates.capture() if log_now else nullcontext():  # read by log() below
                loss, grad_norm = train_step(run, x, y, lr, *images)
            pos.advance(run.batches.batches_per_epoch)
            run.result.step = pos.step
            run.result.losses.append(loss)
            window.add(loss, grad_norm, run.repa.last_metrics if run.repa is not None else None)
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
