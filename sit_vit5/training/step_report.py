"""What a logged step reports: loss and grad-norm means over a window of steps, the throughput with
checkpoint and sampling pauses left out, and the console line that shows them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class MetricWindow:
    """Means of loss and grad norm since the last flush, and the throughput with pauses left out;
    ``global_batch``: images per optimizer step (all processes)."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch, self.run_start = global_batch, time.perf_counter()
        self._reset()

    def _reset(self) -> None:
        self.loss = self.grad_norm = self.idle = 0.0
        self.extra: dict[str, float] = {}
        self.steps, self.start = 0, time.perf_counter()

    def add(self, loss: float, grad_norm: float, extra: dict[str, float] | None = None) -> None:
        """One optimizer step's all-process mean loss and global gradient norm; ``extra``: more
        per-step values whose window means are reported too (REPA's two loss parts)."""
        self.loss, self.grad_norm = self.loss + loss, self.grad_norm + grad_norm
        for key, value in (extra or {}).items():
            self.extra[key] = self.extra.get(key, 0.0) + value
        self.steps += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count towards the throughput."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.idle += time.perf_counter() - start

    def flush(self, epoch: int, lr: float) -> dict[str, float]:
        """The window's metrics (``time_s``: seconds since construction), then a fresh window."""
        elapsed = max(time.perf_counter() - self.start - self.idle, 1e-9)
        steps = max(self.steps, 1)
        metrics = {"epoch": epoch, "loss": self.loss / steps, "grad_norm": self.grad_norm / steps,
                   "lr": lr, "steps_per_s": self.steps / elapsed,
                   "img_per_s": self.steps * self.global_batch / elapsed,
                   "time_s": time.perf_counter() - self.run_start,
                   **{key: total / steps for key, total in self.extra.items()}}
        self._reset()
        return metrics


def rate(steps_per_s: float) -> str:
    """``12.34 steps/s``, or ``s/step`` for slow steps (instead of 0.00 steps/s)."""
    if steps_per_s >= 1:
        return f"{steps_per_s:.2f} steps/s"
    return f"{1 / max(steps_per_s, 1e-9):.1f} s/step"


def console_line(step: int, metrics: dict[str, float], lr: float) -> str:
    """The console's line for a logged step: loss, grad norm, lr, speed, REPA's two loss parts and
    the mean attention/MLP gates when ``metrics`` has them."""
    repa = (f" | diffusion {metrics['loss_diffusion']:.4f} | repa {metrics['loss_repa']:.4f}"
            if "loss_repa" in metrics else "")
    gate = (f" | gate attn/mlp {metrics['gate/attn/mean']:.3f}/{metrics['gate/mlp/mean']:.3f}"
            if "gate/attn/mean" in metrics else "")
    return (f"step {step:07d} | loss {metrics['loss']:.4f} | grad {metrics['grad_norm']:.3f} | "
            f"lr {lr:.2e} | {rate(metrics['steps_per_s'])} | "
            f"{metrics['img_per_s']:.3g} img/s{repa}{gate}")
