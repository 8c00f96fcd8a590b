"""Data order: which dataset indices each process takes at each optimizer step (a function of
``train.seed`` and the position in training, whatever the process count)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import Sampler

from ..config import ConfigError
from ..transport.rng import mix_seed

SALT_DATA = 0xDA7A  # keeps the data-order stream apart from the noise stream of the same seed


class StepBatchSampler(Sampler[list[int]]):
    """Yields, for one process, the dataset indices of each optimizer step of an epoch.

    The epoch's order is ``randperm(len)`` seeded by (seed, epoch); global batch b is
    ``perm[b·G:(b+1)·G]``, cut into ``world × accum`` chunks; this process gets chunks
    ``a·world + rank`` for a = 0..accum−1 (its micro-batches). The last partial batch is dropped;
    ``set_epoch(epoch, start_batch)`` skips batches (a resumed run continues mid-epoch)."""

    def __init__(self, num_items: int, global_batch: int, world_size: int = 1, rank: int = 0,
                 grad_accum: int = 1, seed: int = 0) -> None:
        if global_batch % (world_size * grad_accum):
            raise ConfigError(f"data.global_batch_size={global_batch} is not divisible by "
                              f"processes ({world_size}) × train.grad_accum ({grad_accum})")
        if num_items < global_batch:
            raise ConfigError(f"the dataset has {num_items} items, fewer than "
                              f"data.global_batch_size={global_batch}")
        self.num_items, self.global_batch = num_items, global_batch
        self.world_size, self.rank, self.grad_accum, self.seed = world_size, rank, grad_accum, seed
        self.micro_batch = global_batch // (world_size * grad_accum)
        self.batches_per_epoch = num_items // global_batch
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def epoch_permutation(self, epoch: int) -> Tensor:
        """The epoch's order of all ``num_items`` indices (the same on every process)."""
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, SALT_DATA))
        return torch.randperm(self.num_items, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.epoch_permutation(self.epoch)
        m = self.micro_batch
        for b in range(self.start_batch, self.batches_per_epoch):
            base = b * self.global_batch
            chunks = [a * self.world_size + self.rank for a in range(self.grad_accum)]
            yield [i for c in chunks for i in perm[base + c * m: base + (c + 1) * m].tolist()]
