"""Reproducible random draws for samplers and losses, and the project's seed hashes (the one home
for both: training noise, data order, per-item augmentation and per-sample sampling seeds all come
from here).

A ``generator`` argument may be ``None`` (global RNG), a ``torch.Generator`` or an ``int`` seed (one
stream for the whole batch), or a sequence of generators / seeds with one entry per batch row. With
a sequence, row ``i`` draws only from its own stream, so a sample depends on its own seed, not on
the rest of the batch. Draws happen on the generator's device and are then moved to the data's
device: a CPU generator gives the same numbers whatever device the model runs on. A CPU draw bound
for a GPU is staged in pinned memory and copied without blocking, so a sampler or a training step
does not wait for the GPU at each draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1

GeneratorLike = torch.Generator | int | Sequence[torch.Generator | int] | None
Resolved = torch.Generator | list[torch.Generator] | None


# ----------------------------------------------------------------------------- seed hashes


def mix_seed(*values: int) -> int:
    """A 63-bit seed that depends on all ``values`` (NumPy SeedSequence hashing; nearby tuples
    differ)."""
    words = np.random.SeedSequence([int(v) for v in values]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def sample_seed(global_seed: int, index: int, stream: int = 0) -> int:
    """Seed of stream ``stream`` of sample ``index`` in a run seeded ``global_seed``: ``mix_seed``
    of the three, after checking that the seed and index are >= 0."""
    if global_seed < 0 or index < 0:
        raise ValueError(
            f"seeds and indices must be >= 0, got global_seed={global_seed}, index={index}")
    return mix_seed(global_seed, index, stream)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def item_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed that depends on (seed, epoch, index) only (a splitmix64 chain: nearby triples
    differ). Data items use it rather than ``mix_seed``: ~7x cheaper, and one is made per item per
    epoch."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))
    return _splitmix64(mixed ^ (index & _MASK64))


# ----------------------------------------------------------------------------- generators and draws


def _as_generator(g: torch.Generator | int) -> torch.Generator:
    if isinstance(g, torch.Generator):
        return g
    if isinstance(g, int):
        return torch.Generator().manual_seed(g)
    raise TypeError(
        f"generator entries must be torch.Generator or int seeds, got {type(g).__name__}")


def resolve_generator(generator: GeneratorLike, batch: int) -> Resolved:
    """Turn seeds into generators once (so a seeded stream advances across calls); check per-row
    length."""
    if generator is None:
        return None
    if isinstance(generator, torch.Generator | int):
        return _as_generator(generator)
    gens = [_as_generator(g) for g in generator]
    if len(gens) != batch:
        raise ValueError(f"generator: got {len(gens)} per-row generators for a batch of {batch}")
    return gens


def _draw_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def to_device(t: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` on ``device`` (in ``dtype``, if given). From the CPU to CUDA it goes through pinned
    memory, non-blocking: a copy from pageable memory synchronises the stream (CUDA runtime API,
    "API synchronization behavior"), which would drain the GPU at every sampler step."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        staged = torch.empty_like(t, pin_memory=True).copy_(t)  # held by the allocator until copied
        t = staged.to(device, non_blocking=True)
    return t.to(device=device, dtype=dtype)


def _one_device(rows: list[Tensor], like: Tensor) -> list[Tensor]:
    """Per-row draws ready to join: as drawn when they share a device (joined there, then moved in
    one copy; row by row, a GPU batch waits on one blocking transfer per row), else each on
    ``like``'s device."""
    return rows if len({r.device for r in rows}) <= 1 else [r.to(like.device) for r in rows]


def randn_like(x: Tensor, generator: Resolved) -> Tensor:
    """Standard normal noise shaped like ``x`` (dtype/device of ``x``)."""
    if generator is None:
        return torch.randn_like(x)
    dtype = _draw_dtype(x)
    if isinstance(generator, torch.Generator):
        return to_device(torch.randn(x.shape, generator=generator, device=generator.device,
                                     dtype=dtype), x.device, x.dtype)
    rows = [torch.randn(x.shape[1:], generator=g, device=g.device, dtype=dtype) for g in generator]
    return to_device(torch.stack(_one_device(rows, x)), x.device, x.dtype)


def rademacher_like(x: Tensor, generator: Resolved) -> Tensor:
    """Random signs +-1 shaped like ``x``."""
    if generator is None:
        return torch.randint_like(x, 0, 2) * 2 - 1
    if isinstance(generator, torch.Generator):
        bits = torch.randint(0, 2, x.shape, generator=generator, device=generator.device)
        return to_device(bits, x.device, x.dtype) * 2 - 1
    rows = [torch.randint(0, 2, x.shape[1:], generator=g, device=g.device) for g in generator]
    return to_device(torch.stack(_one_device(rows, x)), x.device, x.dtype) * 2 - 1


def uniform(batch: int, generator: Resolved, like: Tensor) -> Tensor:
    """``U[0, 1)`` of shape ``(batch,)`` on ``like``'s device/dtype. With no generator it draws from
    the *CPU* global RNG, as SiT does (``th.rand((B,))``), so a seeded training run draws the same
    times."""
    if generator is None:
        return to_device(torch.rand(batch), like.device, like.dtype)  # on cpu: SiT's global RNG
    if isinstance(generator, torch.Generator):
        return to_device(torch.rand(batch, generator=generator, device=generator.device),
                         like.device, like.dtype)
    rows = [torch.rand(1, generator=g, device=g.device) for g in generator]
    return to_device(torch.cat(_one_device(rows, like)), like.device, like.dtype)
