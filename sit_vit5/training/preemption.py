"""Graceful pre-emption: SIGTERM / SIGINT / SIGUSR1 (Slurm, Kubernetes, Ctrl-C) during training
finish the current step, write a checkpoint and stop; ``--resume latest`` continues bit-identically.
The handler only records the signal; a second SIGINT raises KeyboardInterrupt at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class PreemptionGuard:
    """Context manager that records the first pre-emption signal (``requested``: its name, e.g.
    "SIGTERM", else None). Handlers go in the main thread only; the previous ones come back on exit.
    """

    def __init__(self, signals: tuple[str, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(s for s in signals if hasattr(signal, s))
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested == "SIGINT" and name == "SIGINT":
            raise KeyboardInterrupt
        self.requested = self.requested or name

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for name in self.signals:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def should_stop(self, accelerator: Any | None = None) -> bool:
        """Whether any process got a signal (an all-reduce with several processes, so all stop after
        the same step)."""
        local = self.requested is not None
        if accelerator is None or accelerator.num_processes == 1:
            return local
        import torch

        flag = torch.tensor([1.0 if local else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
