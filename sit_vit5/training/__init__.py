"""Training: the loop (``train``), EMA, atomic checkpoints with exact resume, metric logging."""

from .batching import StepBatchSampler
from .build import TrainResult
from .checkpoint import (
    CheckpointError,
    IncompatibleCheckpointError,
    latest_checkpoint,
    read_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from .ema import create_ema, update_ema
from .loop import NonFiniteLossError, train

__all__ = [
    "CheckpointError",
    "IncompatibleCheckpointError",
    "NonFiniteLossError",
    "StepBatchSampler",
    "TrainResult",
    "create_ema",
    "latest_checkpoint",
    "read_checkpoint",
    "resolve_resume",
    "save_checkpoint",
    "train",
    "update_ema",
]
