"""REPA in the training loop (``repa`` config section; the pieces: ``sit_vit5/repa.py``).

:class:`RepaTraining` holds what REPA adds to a run and does its share of each optimizer step:

* the frozen encoder (features of each micro-batch's clean images, no gradient), the hook that reads
  the backbone's hidden state after block ``repa.depth`` from the training forward, and the
  projector with its own AdamW (the optimizer's settings; AdamW is per parameter, so this equals
  REPA's single optimizer over both);
* the loss ``diffusion.mean() + coeff * alignment.mean()`` (REPA's ``loss_mean + proj_loss_mean *
  proj_coeff``), the two parts kept for the log (``loss_diffusion``, ``loss_repa``);
* the projector's gradients averaged over processes once per step (it is replicated, under DDP and
  FSDP alike), clipped together with the model's (REPA clips ``model.parameters()``, which hold its
  projectors), then stepped;
* its checkpoint state: projector weights, AdamW state and the encoder weights' SHA-256, so that a
  resumed run continues exactly and refuses another encoder.

The projector is initialised from its own generator (seeded by ``train.seed``), so the model's init
and every RNG stream of the run are those of the same run without REPA: with ``repa.coeff=0`` the
model trains bit for bit as without REPA (tests/test_repa.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..config import Config
from ..precision import autocast
from ..repa import FrozenEncoder, HiddenCapture, Projector, RepaError, alignment_loss, load_encoder
from ..transport.rng import mix_seed
from .checkpoint import IncompatibleCheckpointError
from .optim import param_groups

SALT_REPA = 0x4E9A  # the projector's init stream, apart from the model's (the global RNG)
METRICS = ("loss_diffusion", "loss_repa")  # the log's columns: diffusion loss, alignment loss


class RepaTraining:
    """REPA's state and step pieces for ``model`` (the bare backbone, before DDP / FSDP wrapping:
    the hook goes on its block ``repa.depth``); ``channels``: the channels of the data's images."""

    def __init__(self, cfg: Config, model: nn.Module, channels: int, device: torch.device) -> None:
        r, o = cfg["repa"], cfg["optim"]
        self.device, self.precision = device, cfg["train"]["precision"]
        self.coeff, self.depth = float(r["coeff"]), r["depth"]
        self.capture = HiddenCapture(model, r["depth"])
        self.encoder: FrozenEncoder = load_encoder(r, cfg["data"]["image_size"], model.grid,
                                                   channels, device)
        generator = torch.Generator().manual_seed(mix_seed(cfg["train"]["seed"], SALT_REPA))
        hidden = model.x_embedder.proj.out_channels  # D
        self.projector = Projector(hidden, r["projector_dim"], self.encoder.feature_dim)
        self.projector.reset_parameters(generator).to(device).train()
        self.optimizer = torch.optim.AdamW(param_groups(self.projector, o["weight_decay"]),
                                           lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
        self.encoder_sha256 = self.encoder.weights_sha256()
        self._sums = torch.zeros(2, device=device)  # diffusion, alignment: sums over micro-batches
        self.last_metrics: dict[str, float] = {}

    def describe(self) -> str:
        n = sum(p.numel() for p in self.projector.parameters())
        return (f"REPA: {self.encoder.name} ({self.encoder.feature_dim}-d) at block {self.depth}, "
                f"coeff {self.coeff:g}, projector {n / 1e6:.2f}M parameters")

    def features(self, images: Tensor) -> Tensor:
        """The encoder's patch features (B, T, E) of clean images (B, C, H, W) in [-1, 1]: no
        gradient, under the run's autocast (REPA encodes under ``accelerator.autocast()``)."""
        with torch.no_grad(), autocast(self.device, self.precision):
            return self.encoder(images)

    def loss(self, per_sample_loss, features: Tensor) -> Tensor:
        """``per_sample_loss()`` (the objective's (B,) loss, one model forward) plus ``coeff`` times
        the alignment of its hidden state with ``features``; returns the scalar to backpropagate."""
        with self.capture.armed():
            diffusion = per_sample_loss()
        with autocast(self.device, self.precision):
            projected = self.projector(self.capture.take())
        alignment = alignment_loss(projected, features)
        d, a = diffusion.mean(), alignment.mean()
        self._sums += torch.stack([d.detach().float(), a.detach()])
        return d + self.coeff * a

    def parameters(self) -> list[nn.Parameter]:
        return list(self.projector.parameters())

    def zero_grad(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def sync_gradients(self, world_size: int) -> None:
        """Average the projector's gradients over the processes (DDP's semantics), in one call."""
        if world_size == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.parameters()]
        flat = _flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat)
        flat /= world_size
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    def clip_jointly(self, model_grads: list[Tensor], model_norm: float, max_norm: float) -> float:
        """Clip the model's gradients (``model_grads``: local tensors, DTensors' shards included)
        and the projector's to one global norm, ``hypot(model_norm, projector norm)``, with the
        arithmetic of ``torch.nn.utils.clip_grad_norm_``; returns that norm. With a zero projector
        gradient it is ``model_norm`` exactly, and the model's update is unchanged."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        own = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        total = math.sqrt(model_norm * model_norm + own * own)  # float64: sqrt(m*m) == m, fp32 m
        total_t = torch.tensor(total, dtype=torch.float32, device=self.device)
        coef = torch.clamp(max_norm / (total_t + 1e-6), max=1.0)  # clip_grads_with_norm_'s formula
        if model_grads:
            torch._foreach_mul_(model_grads, coef.to(model_grads[0].device))
        if grads:
            torch._foreach_mul_(grads, coef)
        return float(total_t)

    def step(self, scaler: torch.amp.GradScaler | None) -> None:
        if scaler is not None:
            scaler.step(self.optimizer)
        else:
            self.optimizer.step()

    def step_metrics(self, reduce, accum: int) -> dict[str, float]:
        """The step's all-process means of the two loss parts (``reduce``: accelerate's; resets)."""
        means = reduce(self._sums / accum, reduction="mean").tolist()
        self._sums.zero_()
        self.last_metrics = dict(zip(METRICS, means))
        return self.last_metrics

    def state_dict(self) -> dict[str, Any]:
        return {"projector": self.projector.state_dict(), "opt": self.optimizer.state_dict(),
                "encoder_sha256": self.encoder_sha256}

    def load_state_dict(self, state: dict[str, Any] | None, path: Any) -> None:
        """Restore a checkpoint's ``repa`` entry (IncompatibleCheckpointError: none, or another
        encoder's)."""
        if state is None:
            raise IncompatibleCheckpointError(f"cannot resume from {path} with repa.encoder set: "
                                              "it holds no REPA projector (trained without REPA)")
        if state.get("encoder_sha256") != self.encoder_sha256:
            raise IncompatibleCheckpointError(
                f"cannot resume from {path}: repa.encoder={self.encoder.name} has other weights "
                f"(SHA-256 {self.encoder_sha256[:12]}) than the encoder the run was trained with "
                f"({str(state.get('encoder_sha256'))[:12]})")
        try:
            self.projector.load_state_dict(state["projector"])
        except RuntimeError as err:
            raise RepaError(f"cannot resume from {path}: its REPA projector does not fit "
                            f"({str(err).splitlines()[0]})") from None
        self.optimizer.load_state_dict(state["opt"])
