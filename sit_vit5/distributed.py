"""Joining the process group a launcher asked for, or stopping with one line that says why.

torchrun, ``accelerate launch``, ``examples/slurm/task.sh`` and MPI launchers give each process the
world size in the environment (``WORLD_SIZE``, or MPI's ``PMI_SIZE`` / ``OMPI_COMM_WORLD_SIZE`` /
``MV2_COMM_WORLD_SIZE``: the variables accelerate reads). accelerate forms a CPU (gloo) group only
when told ``cpu=True``; on a machine without a visible GPU it otherwise leaves every process alone,
and N copies of the same run write the same files. Training, latent caching and bulk sampling
therefore all go through :func:`prepare_launch` and :func:`check_group` (:func:`join_launcher_group`
does both around accelerate's PartialState): the CPU path (gloo) when no GPU is visible or when
asked, NCCL on GPUs, and the group joined must be the one the launcher announced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .launcher import RANK_VARS, WORLD_SIZE_VARS, LaunchError, check_launcher_env, launcher_world_size

__all__ = ["RANK_VARS", "WORLD_SIZE_VARS", "LaunchError", "launcher_world_size", "prepare_launch",
           "check_group", "join_launcher_group", "describe_group", "backend_in_use"]

_CPU_FLAGS = "train.cpu=true / --device cpu / --cpu"


def prepare_launch(cpu: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Check the launcher's variables before any group is formed (``check_launcher_env``); returns
    whether this process computes on the CPU: when asked (``cpu``), or when no GPU is visible (under a
    multi-process launcher the group is then a gloo group; accelerate would otherwise not form one)."""
    check_launcher_env(environ)
    return cpu or not torch.cuda.is_available()


def backend_in_use() -> str:
    """The torch.distributed backend of the default group, or "none" (one process, no group)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "none"


def check_group(num_processes: int, cpu: bool, environ: Mapping[str, str] | None = None) -> None:
    """Raise LaunchError unless the group has the size the launcher announced (and, on GPUs, every
    local rank has a GPU of its own)."""
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


def join_launcher_group(cpu: bool = False):
    """accelerate's PartialState for this process, in the launcher's group (gloo on the CPU, NCCL on
    GPUs). ``cpu`` forces the CPU even when GPUs are visible. Raises LaunchError on a mismatch."""
    from accelerate import PartialState  # ~0.3 s: only the CLIs that launch pay it

    cpu = prepare_launch(cpu)
    state = PartialState(cpu=cpu)
    check_group(state.num_processes, cpu)
    return state


def describe_group(num_processes: int, device: torch.device | str) -> str:
    """What the run headers print: "2 process(es) (backend gloo), cpu"."""
    return f"{num_processes} process(es) (backend {backend_in_use()}), {device}"
