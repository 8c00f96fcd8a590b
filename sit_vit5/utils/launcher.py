"""The launcher's environment, read without torch: the announced world size and whether this
process was given its rank (a bad launch is reported before the heavy imports)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import SitVit5Error

#: World-size variables, in accelerate's order, and the rank variables alongside each.
RANK_VARS = {"WORLD_SIZE": ("RANK", "LOCAL_RANK"), "PMI_SIZE": ("PMI_RANK",),
             "OMPI_COMM_WORLD_SIZE": ("OMPI_COMM_WORLD_RANK",),
             "MV2_COMM_WORLD_SIZE": ("MV2_COMM_WORLD_RANK",)}
WORLD_SIZE_VARS = tuple(RANK_VARS)


class LaunchError(SitVit5Error, RuntimeError):
    """The process group does not match the launcher's; names the variable and the fix."""


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


def check_launcher_env(environ: Mapping[str, str] | None = None) -> int:
    """The world size the launcher announced (1 without one); one without a rank
    (``WORLD_SIZE=2 python train.py``) is a LaunchError (accelerate would wait forever)."""
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
    return size


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher announced it (its first rank variable set, e.g.
    torchrun's RANK), 0 without a launcher."""
    environ = os.environ if environ is None else environ
    _, var = launcher_world_size(environ)
    for rank_var in RANK_VARS.get(var or "", ()):
        if environ.get(rank_var, "").strip().isdigit():
            return int(environ[rank_var])
    return 0
