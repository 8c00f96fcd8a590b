"""Metric logging: JSONL and CSV in the run directory, TensorBoard and wandb when asked for."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ..utils.atomic_files import atomic_write_text

#: CSV columns (a JSONL row may hold more keys).
CSV_FIELDS = ("step", "epoch", "loss", "grad_norm", "lr", "steps_per_s", "img_per_s", "time_s")
WANDB_ID_FILE = "wandb_run_id"  # in the run directory: the wandb run a resumed training continues


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _truncate_jsonl(path: Path, after_step: int) -> None:
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= after_step]
    path.write_text("".join(line + "\n" for line in kept))


def _truncate_csv(path: Path, after_step: int, fields: tuple[str, ...]) -> None:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(row for row in rows if int(row["step"]) <= after_step)


def tensorboard_installed() -> bool:
    """Whether ``torch.utils.tensorboard`` can be used (it needs the ``tensorboard`` package)."""
    return importlib.util.find_spec("tensorboard") is not None


class MetricLogger:
    """One row per ``log`` call in ``run_dir``'s ``metrics.jsonl`` and ``metrics.csv`` (main process
    only: ``enabled=False`` elsewhere), mirrored to TensorBoard (``run_dir/tb``) and wandb if asked.

    ``tensorboard``: True (warns if not installed), False, or None = when installed. On resume from
    ``resume_step``, later rows and TensorBoard events are dropped; wandb continues the run whose id
    is in ``run_dir/wandb_run_id``. ``extra_fields``: CSV columns after the standard ones.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True,
                 tensorboard: bool | None = None, wandb: bool = False,
                 config: dict[str, Any] | None = None, wandb_project: str = "sit-vit5",
                 resume_step: int | None = None, extra_fields: tuple[str, ...] = ()) -> None:
        self.enabled = enabled
        self.fields = (*CSV_FIELDS, *extra_fields)
        self.tb_writer = None
        self.wandb_run = None
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.csv_path = self.run_dir / "metrics.csv"
        if resume_step is not None:
            if self.jsonl_path.is_file():
                _truncate_jsonl(self.jsonl_path, resume_step)
            if self.csv_path.is_file():
                _truncate_csv(self.csv_path, resume_step, self.fields)
        new_csv = not self.csv_path.is_file()
        self.csv_file = open(self.csv_path, "a", newline="")
        self.csv_writer = csv.DictWriter(self.csv_file, fieldnames=self.fields,
                                         extrasaction="ignore")
        if new_csv:
            self.csv_writer.writeheader()
        self.jsonl_file = open(self.jsonl_path, "a")
        if tensorboard is None:
            tensorboard = tensorboard_installed()  # default: on when available, no warning
        if tensorboard:
            self._open_tensorboard(resume_step)
        if wandb:
            self._open_wandb(config, wandb_project, resume_step)

    def _open_tensorboard(self, resume_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            _warn("train.tensorboard=true but tensorboard is not installed "
                  "(pip install tensorboard); metrics go to metrics.jsonl/csv only")
            return
        # events after resume_step come from the interrupted run: purge them
        purge = None if resume_step is None else resume_step + 1
        self.tb_writer = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)

    def _open_wandb(self, config: dict[str, Any] | None, project: str,
                    resume_step: int | None) -> None:
        try:
            import wandb as wandb_lib
        except ImportError:
            _warn("train.wandb=true but wandb is not installed (pip install wandb)")
            return
        id_path = self.run_dir / WANDB_ID_FILE
        run_id = id_path.read_text().strip() if resume_step and id_path.is_file() else None
        # wandb's history is monotonic: it drops re-logged steps; the local files are the record
        self.wandb_run = wandb_lib.init(project=project, dir=str(self.run_dir), config=config,
                                        name=self.run_dir.name, id=run_id, resume="allow")
        if self.wandb_run is not None and self.wandb_run.id != run_id:
            atomic_write_text(id_path, f"{self.wandb_run.id}\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one row: ``{"step": step, **metrics}`` (non-finite floats as null in JSON)."""
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}
        self.jsonl_file.write(json.dumps(clean) + "\n")
        self.jsonl_file.flush()
        self.csv_writer.writerow(row)
        self.csv_file.flush()
        for key, value in metrics.items():
            if self.tb_writer is not None:
                self.tb_writer.add_scalar(f"train/{key}", value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def log_image(self, step: int, path: str | os.PathLike) -> None:
        """Mirror a saved sample grid (PNG) to TensorBoard/wandb."""
        if not self.enabled or (self.tb_writer is None and self.wandb_run is None):
            return
        import numpy as np
        from PIL import Image

        with Image.open(path) as im:  # closed at once: no ResourceWarning, no handle per grid
            image = np.asarray(im.convert("RGB"))
        if self.tb_writer is not None:
            self.tb_writer.add_image("samples", image, step, dataformats="HWC")
        if self.wandb_run is not None:
            import wandb as wandb_lib

            self.wandb_run.log({"samples": wandb_lib.Image(image)}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.jsonl_file.close()
        self.csv_file.close()
        if self.tb_writer is not None:
            self.tb_writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
