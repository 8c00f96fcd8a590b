"""Joining the process group a launcher asked for, or stopping with one line that says why.

Launchers (torchrun, ``accelerate launch``, Slurm, MPI) announce the world size in the environment;
without a GPU, accelerate forms no group unless told ``cpu=True``, and N copies of a run would write
the same files. So training, latent caching and bulk sampling use :func:`prepare_launch` and
:func:`check_group` (gloo on the CPU, NCCL on GPUs, and the group must be the announced one)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .launcher import (
    RANK_VARS,
    WORLD_SIZE_VARS,
    LaunchError,
    check_launcher_env,
    launcher_world_size,
)

if TYPE_CHECKING:
    from accelerate import PartialState

__all__ = ["RANK_VARS", "WORLD_SIZE_VARS", "LaunchError", "launcher_world_size", "prepare_launch",
           "check_group", "join_launcher_group", "describe_group", "backend_in_use"]

_CPU_FLAGS = "train.cpu=true / --device cpu / --cpu"


def prepare_launch(cpu: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Check the launcher's variables (``check_launcher_env``); returns whether this process runs on
    the CPU: when asked (``cpu``) or when no GPU is visible (then a gloo group)."""
    check_launcher_env(environ)
    return cpu or not torch.cuda.is_available()


def backend_in_use() -> str:
    """The torch.distributed backend of the default group, or "none" (one process, no group)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "none"


def check_group(num_processes: int, cpu: bool, environ: Mapping[str, str] | None = None) -> None:
    """Raise LaunchError unless the group has the announced size (and, on GPUs, one GPU per local
    rank)."""
    environ = os.environ if environ is None else environ
    size, var = launcher_world_size(environ)
    local_rank, gpus = int(environ.get("LOCAL_RANK", "0") or 0), torch.cuda.device_count()
    if not cpu and size > 1 and local_rank >= gpus:
        raise LaunchError(f"LOCAL_RANK={local_rank} but {gpus} GPU(s) are visible: start at most "
                          f"{gpus} processes per node, or run on the CPU ({_CPU_FLAGS})")
    if num_processes == size:
        return
    if var is None:
        raise LaunchError(f"this process is in a group of {num_processes} but no launcher variable "
                          f"({', '.join(WORLD_SIZE_VARS)}) is set; start it with torchrun or "
                          "accelerate launch")
    prepare_launch(cpu, environ)  # a missing rank variable is the likeliest cause: say so
    raise LaunchError(f"{var}={size} (set by the launcher) but this process joined a group of "
                      f"{num_processes} (backend {backend_in_use()}); check the launcher's "
                      "variables (RANK, LOCAL_RANK, MASTER_ADDR)")


def join_launcher_group(cpu: bool = False) -> PartialState:
    """accelerate's PartialState in the launcher's group (gloo on CPU, NCCL on GPUs; ``cpu``
    forces the CPU). Raises LaunchError on a mismatch."""
    from accelerate import PartialState  # ~0.3 s: only the CLIs that launch pay it

    cpu = prepare_launch(cpu)
    state = PartialState(cpu=cpu)
    check_group(state.num_processes, cpu)
    return state


def describe_group(num_processes: int, device: torch.device | str) -> str:
    """What the run headers print: "2 process(es) (backend gloo), cpu"."""
    return f"{num_processes} process(es) (backend {backend_in_use()}), {device}"
