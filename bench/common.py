"""Shared pieces of the benchmarks: arguments, clocks, interleaved timing, models, tables and JSON.

Timing protocol: every variant of a comparison (SiT, ViT5, the timm reference, ...) is built up front, warmed
up, then timed in rounds that run each variant in turn (alternating the order); the median over rounds is
reported, and the minimum too (noise from other processes only ever adds time). A ratio is the median of the
per-round ratios: the two variants ran back to back, so a machine load that drifts during the run cancels.

Clocks: ``wall`` (perf_counter, with CUDA synchronisation) is what a GPU run reports; ``cpu`` (process CPU
time) is the default on CPU, because on a shared machine wall time also measures the neighbours. CPU rows are
for ratios only; absolute numbers belong to the GPU tables.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sit_vit5.models import count_params, create_model, flops
from sit_vit5.models.registry import SIZES
from sit_vit5.utils.precision import PRECISIONS, autocast  # noqa: F401 (the bench scripts import them here)

BACKBONE_NAMES = ("SiT", "ViT5", "Timm")  # Timm: SiT built from timm's Attention/Mlp (the official layers)
MODES = ("eager", "compile")
# stabilityai/sd-vae-ft-ema's architecture (its config.json); "tiny" keeps the 8x downsampling only.
SD_VAE_ARCH = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                   up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                   layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=256)
TINY_VAE_ARCH = {**SD_VAE_ARCH, "block_out_channels": (8,) * 4, "layers_per_block": 1, "norm_num_groups": 8}
BUILT_VAES = {"sd-arch": SD_VAE_ARCH, "tiny": TINY_VAE_ARCH}
#: Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; H100 = SXM, the PCIe card is 756).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def add_common_args(parser: argparse.ArgumentParser, *, steps: int = 5, warmup: int = 2,
                    rounds: int = 3) -> None:
    """--device, --threads, --clock, --warmup/--steps/--rounds, --seed, --json, --depth, --init."""
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add("--clock", choices=("wall", "cpu"), default=None,
        help="wall time, or process CPU time (default: wall on cuda, cpu on cpu)")
    add("--warmup", type=int, default=warmup, help="untimed calls per variant (compilation happens here)")
    add("--steps", type=int, default=steps, help="timed calls per variant and round")
    add("--rounds", type=int, default=rounds, help="interleaved rounds; medians are reported")
    add("--seed", type=int, default=0)
    add("--json", default=None, help="write the rows and the settings here")
    add("--depth", type=int, default=None, help="override the blocks per model (smoke tests)")
    add("--init", choices=("perturbed", "dit"), default="perturbed",
        help="perturbed: zero-init weights drawn from N(0, 0.02), gates open as mid-training (default)")


def setup(args: argparse.Namespace) -> torch.device:
    """Apply --threads/--seed, resolve --clock, allow TF32 matmuls on CUDA (as DiT/SiT's scripts do)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.clock = args.clock or ("wall" if args.device == "cuda" else "cpu")
    for name, low in (("warmup", 0), ("steps", 1), ("rounds", 1)):
        if getattr(args, name) < low:
            raise SystemExit(f"--{name} must be >= {low}, got {getattr(args, name)}")
    torch.manual_seed(args.seed)
    args.malloc_tuned = args.device == "cpu" and keep_freed_memory()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return torch.device(args.device)


def keep_freed_memory() -> bool:
    """glibc: keep freed memory in the heap (no trimming, no per-block mmap), so that the activations freed
    after one step are not page-faulted in again by the next. A CPU-only cost, and an uneven one: ViT-5 saves
    more activations and took ~4x SiT's page faults (0.1 s system time per S/2 step). False if not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(clock: str) -> float:
    return time.perf_counter() if clock == "wall" else time.process_time()


def interleaved_timings(
    fns: dict[str, Callable[[], Any]], *, rounds: int, steps: int, clock: str, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each fn in each of ``rounds`` rounds of ``steps`` calls, the fns taking turns."""
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # alternate the order: no fixed position bias
            sync(device)
            start = now(clock)
            for _ in range(steps):
                fns[name]()
            sync(device)
            per_call[name].append((now(clock) - start) / steps)
    return per_call


def ratios(times: dict[str, list[float]], num: str, den: str, name: str) -> dict[str, float | None]:
    """``name``: median over rounds of the per-round ratio times[num] / times[den] (the two ran back to back,
    so a drifting machine load cancels); ``name_min``: ratio of the minima. None if either is missing."""
    if num not in times or den not in times:
        return {name: None, f"{name}_min": None}
    paired = [a / b for a, b in zip(times[num], times[den])]
    return {name: statistics.median(paired), f"{name}_min": min(times[num]) / min(times[den])}


def build_backbone(backbone: str, size: str, *, patch: int = 2, input_size: int = 32, num_classes: int = 1000,
                   depth: int | None = None, init: str = "perturbed") -> nn.Module:
    """``SiT``/``ViT5`` from the registry, or ``Timm`` (bench.timm_reference.TimmSiT) of that size;
    ``depth`` overrides the size's block count (smoke tests); ``init`` see :func:`perturb_zero_init`."""
    if backbone not in BACKBONE_NAMES:
        raise SystemExit(f"unknown backbone {backbone!r}; valid: {', '.join(BACKBONE_NAMES)}")
    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    kw = dict(input_size=input_size, num_classes=num_classes, depth=depth or SIZES[size][0])  # learn_sigma on
    if backbone != "Timm":
        model = create_model(f"{backbone}-{size}/{patch}", **kw)
    else:
        from bench.timm_reference import TimmSiT  # needs timm (the dev extra)

        _, hidden, heads = SIZES[size]
        model = TimmSiT(patch_size=patch, hidden_size=hidden, num_heads=heads, **kw)
    return perturb_zero_init(model) if init == "perturbed" else model


def build_for(args: argparse.Namespace, backbone: str, size: str) -> nn.Module:
    """:func:`build_backbone` with the script's --patch, --input-size, --num-classes, --depth and --init."""
    return build_backbone(backbone, size, patch=args.patch, input_size=args.input_size,
                          num_classes=args.num_classes, depth=args.depth, init=args.init)


def perturb_zero_init(model: nn.Module, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Draw every all-zero weight matrix (adaLN, output layer) from N(0, std), in place.

    At the exact DiT init the gates are 0, the blocks pass no gradient and, with ViT-5's LayerScale 1e-4, the
    first steps leave subnormal floats in Adam's moments, which an x86 CPU processes ~10x slower (a GPU does
    not). Timing with open gates measures the regime of a running training instead.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def model_counts(backbone: str, size: str, patch: int, input_size: int,
                 depth: int | None = None) -> tuple[float, float]:
    """(parameters in millions, forward GFLOPs per image; multiply-add = 1). Timm counts as the equal SiT."""
    name = f"{'SiT' if backbone == 'Timm' else backbone}-{size}/{patch}"
    with torch.device("meta"):
        model = create_model(name, input_size=input_size, depth=depth or SIZES[size][0])
    return count_params(model) / 1e6, flops(model)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """Dense bf16 peak in TFLOP/s: ``override``, else by GPU name (H100/H200 989, A100 312), else None."""
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def peak_memory_gb(device: torch.device, baseline: int) -> float | None:
    """Peak allocated CUDA memory above ``baseline`` bytes, in GiB (None on CPU)."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - baseline) / 2**30


def memory_baseline(device: torch.device) -> int:
    """Reset the CUDA peak counter; returns the bytes allocated now (0 on CPU)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def maybe_compile(model: nn.Module, mode: str) -> nn.Module:
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    return torch.compile(model) if mode == "compile" else model


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, hardware and commit, so a JSON file says where its numbers come from."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    env = dict(torch=torch.__version__, python=platform.python_version(), cpu=platform.processor() or None,
               cpu_count=os.cpu_count(), threads=torch.get_num_threads(), commit=commit)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str | None = None) -> None:
    """Plain fixed-width table of ``columns`` (missing values print as '-')."""
    if title:
        print(f"\n{title}")
    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def write_json(path: str | None, bench: str, args: argparse.Namespace, device: torch.device,
               **payload: Any) -> None:
    """``{"bench", "settings", "env", **payload}`` to ``path`` (nothing if path is None)."""
    if path is None:
        return
    out = dict(bench=bench, settings=vars(args), env=environment(device), **payload)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
