"""Per-row noise reaches the data's device in one transfer, with the values drawn row by row.

A sampler's per-sample generators draw on the CPU; row by row, each ``.to(device)`` of a GPU batch is one
blocking transfer (issue 56's cost model: the GPU idles on the host every SDE step). The meta device stands
in for the GPU here: a transfer is an aten ``_to_copy`` whose output lands on it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sit_vit5.transport.rng import rademacher_like, randn_like, uniform


class CountTransfers(TorchDispatchMode):
    """Counts copies that land on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.device.type == "meta":
            self.count += 1
        return out


def _gens(batch: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + i) for i in range(batch)]


@pytest.mark.parametrize("draw", [
    lambda x, g: randn_like(x, g),
    lambda x, g: rademacher_like(x, g),
    lambda x, g: uniform(len(g), g, x),
])
@pytest.mark.parametrize("batch", [1, 7])
def test_per_row_draws_move_in_one_transfer(draw, batch):
    x = torch.empty(batch, 3, 4, 4, device="meta")
    with CountTransfers() as mode:
        out = draw(x, _gens(batch))
    assert out.device.type == "meta"
    assert mode.count == 1  # was one per row


def test_per_row_values_are_each_rows_own_draw():
    x = torch.empty(5, 2, 3)
    noise, signs, times = randn_like(x, _gens(5)), rademacher_like(x, _gens(5)), uniform(5, _gens(5), x)
    for i, g in enumerate(_gens(5)):
        torch.testing.assert_close(noise[i], torch.randn(2, 3, generator=g), rtol=0, atol=0)
    for i, g in enumerate(_gens(5)):
        torch.testing.assert_close(signs[i], torch.randint(0, 2, (2, 3), generator=g).float() * 2 - 1,
                                   rtol=0, atol=0)
    for i, g in enumerate(_gens(5)):
        torch.testing.assert_close(times[i:i + 1], torch.rand(1, generator=g), rtol=0, atol=0)
