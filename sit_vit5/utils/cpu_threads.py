"""CPU thread count for CPU runs, instead of torch's default of one thread per core.

On a shared machine default threads spin against other load (demo on 2 busy cores: 0.87 steps/s
with 2 threads, 4.96 with 1). Small models get one thread; larger ones at most the free cores."""

from __future__ import annotations

import math
import os

#: Models below this many parameters run one thread (the demo has 0.33M; SiT-S/2 has 33M).
TINY_MODEL_PARAMS = 5_000_000
#: Environment variables through which a user has already chosen the thread count.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (0 where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def free_cores(load: float | None = None) -> int:
    """Usable cores minus the 1-minute load average (``load``; None: the OS's), at least 1."""
    cores = usable_cores()
    load = load_average() if load is None else load
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def choose_cpu_threads(num_params: int, requested: int | None = None, load: float | None = None,
                       environ: dict[str, str] | None = None) -> tuple[int, str]:
    """(threads, reason) for a CPU run of a ``num_params`` model: ``requested`` wins, then
    OMP_NUM_THREADS / MKL_NUM_THREADS, then 1 for a tiny model, else the free cores."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        return int(requested), "train.cpu_threads"
    for name in THREAD_ENV_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), name
    if num_params < TINY_MODEL_PARAMS:
        return 1, f"tiny model (< {TINY_MODEL_PARAMS / 1e6:g}M parameters)"
    load = load_average() if load is None else load
    return free_cores(load), f"free cores ({usable_cores()} usable, load {load:.1f})"


def set_cpu_threads(num_params: int, requested: int | None = None) -> tuple[int, str]:
    """Apply ``choose_cpu_threads`` to torch (intra-op threads); returns (threads, reason)."""
    import torch

    threads, reason = choose_cpu_threads(num_params, requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads, reason
