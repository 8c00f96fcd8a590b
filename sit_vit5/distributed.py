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

from .errors import SitVit5Error

#: Variables that announce the world size, in the order accelerate reads them, and the variables
#: that give this process's rank alongside each.
RANK_VARS = {"WORLD_SIZE": ("RANK", "LOCAL_RANK"), "PMI_SIZE": ("PMI_RANK",),
             "OMPI_COMM_WORLD_SIZE": ("OMPI_COMM_WORLD_RANK",),
             "MV2_COMM_WORLD_SIZE": ("MV2_COMM_WORLD_RANK",)}
WORLD_SIZE_VARS = tuple(RANK_VARS)
_CPU_FLAGS = "train.cpu=true / --device cpu / --cpu"


class LaunchError(SitVit5Error, RuntimeError):
    """The process group does not match what the launcher announced; the message names the variable
    and the fix, in one line."""


def launcher_world_size(environ: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """(world size, the variable that says so) from the launcher's environment, or (1, None)."""
    environ = os.environ if environ is None else environ
    for var in WORLD_SIZE_VARS:
        if var in environ:
            try:
                size = int(environ[var])
            except ValueError:
                raise LaunchError(f"{var}={environ[var]!r} is not an integer; unset it or fix the "
                                  "launcher") from None
            if size < 1:
                raise LaunchError(f"{var}={size} must be >= 1; unset it or fix the launcher")
            return size, var
    return 1, None


def prepare_launch(cpu: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Check the launcher's variables before any group is formed; returns whether this process
    computes on the CPU: when asked (``cpu``), or when no GPU is visible (under a multi-process
    launcher the group is then a gloo group; accelerate would otherwise not form one).

    A world size without a rank (``WORLD_SIZE=2 python train.py``) is a LaunchError: accelerate
    would wait forever for the other processes, or fail with a message about ``MASTER_ADDR``.
    """
    environ = os.environ if environ is None else environ
    size, var = launcher_world_size(environ)
    if size > 1 and not any(rank in environ for rank in RANK_VARS[var]):
        if var == "WORLD_SIZE":
            raise LaunchError(f"WORLD_SIZE={size} is set but RANK/LOCAL_RANK are not: start the "
                              "processes with torchrun or accelerate launch (or "
                              "examples/slurm/task.sh), or unset WORLD_SIZE")
        raise LaunchError(f"{var}={size} is set but {RANK_VARS[var][0]} is not: start the "
                          "processes with your MPI launcher, torchrun or accelerate launch, or "
                          f"unset {var}")
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
