"""Residual-branch diagnostics: how open each block's adaLN gate (times LayerScale ``γ``) is.

A block adds ``gate · γ · f(x)`` to the residual stream: a small ``|gate · γ|`` means the
branch barely contributes; its spread across the batch, how much it depends on class and time.
:class:`GateMonitor` hooks the training forward itself (no extra pass). Under ``torch.compile``
the hooks stay registered from the start: dynamo ignores hooks added after tracing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..models.backbone import Backbone, BackboneBlock

#: Attention and MLP gates among the six adaLN chunks (shift, scale, gate) × (attn, mlp).
_GATES = {"attn": (2, "gamma_1"), "mlp": (5, "gamma_2")}


class GateMonitor:
    """Per-block gate statistics of the last forward run inside :meth:`capture`.

    ``metrics()`` returns, for block i (two digits) and branch b in {attn, mlp}: ``gate/b/i`` =
    mean of ``|gate · γ|``, ``gate_spread/b/i`` = its std across the batch averaged over channels,
    and ``gate/b/mean`` over blocks.
    """

    def __init__(self, model: Backbone, persistent: bool = False) -> None:
        """``persistent``: hook every forward from now on (for a model about to be compiled); else
        only the forwards inside :meth:`capture`."""
        self.blocks: list[BackboneBlock] = list(model.blocks)
        # one slot per block, never resized: a compiled graph guards on the container's keys/length
        self._outputs: list[Tensor | None] = [None] * len(self.blocks)
        self._captured: list[Tensor | None] = []
        self.persistent = persistent
        self._handles = self._register() if persistent else []
        if persistent:  # let dynamo skip the hooks' store in checkpointing's recompute (unneeded)
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True

    @property
    def keys(self) -> list[str]:
        """Metric names ``metrics()`` produces (fixed for a model: usable as CSV columns)."""
        names = [f"gate/{b}/mean" for b in _GATES]
        for i in range(len(self.blocks)):
            names += [f"{kind}/{b}/{i:02d}" for kind in ("gate", "gate_spread") for b in _GATES]
        return names

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Record each block's adaLN output (detached) in the forwards inside (the last counts)."""
        self._outputs[:] = [None] * len(self.blocks)
        handles = [] if self.persistent else self._register()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._captured = list(self._outputs)  # persistent hooks go on recording: keep these

    def _register(self) -> list:
        return [block.adaLN_modulation.register_forward_hook(self._hook(i))
                for i, block in enumerate(self.blocks)]

    def _hook(self, index: int):
        def store(module: nn.Module, args: tuple, output: Tensor) -> None:
            self._outputs[index] = output.detach()

        return store

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """Statistics of the last :meth:`capture` (empty if it saw no forward); clears it."""
        captured, self._captured = self._captured, []
        if not self.blocks or len(captured) != len(self.blocks) or any(o is None for o in captured):
            return {}
        names: list[str] = []
        values: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            chunks = captured[i].float().chunk(6, dim=1)
            for branch, (chunk, gamma_name) in _GATES.items():
                gate = chunks[chunk]  # (B, D)
                gamma = getattr(block, gamma_name)
                if gamma is not None:  # sharded outside the forward under FSDP: gather (collective)
                    gamma = gamma.full_tensor() if hasattr(gamma, "full_tensor") else gamma
                    gate = gate * gamma.detach().float()
                names += [f"gate/{branch}/{i:02d}", f"gate_spread/{branch}/{i:02d}"]
                values += [gate.abs().mean(), gate.std(dim=0, unbiased=False).mean()]
        out = dict(zip(names, torch.stack(values).tolist()))  # one device sync for all blocks
        for branch in _GATES:
            per_block = [out[f"gate/{branch}/{i:02d}"] for i in range(len(self.blocks))]
            out[f"gate/{branch}/mean"] = sum(per_block) / max(1, len(per_block))
        return out
