"""FSDP for the training loop: PyTorch's FSDP2 (``fully_shard``), on gloo (CPU) as on NCCL.

accelerate's FSDP plugin is ignored on CPU groups, so the loop shards the model itself: one unit
per transformer block plus the root. Checkpoints keep the DDP layout (full ``model`` / ``ema``,
integer-keyed ``opt``), so a run resumes under DDP or FSDP with any process count. The EMA is kept
as fp32 shards (:class:`ShardedEMA`), gathered only for checkpoints and sample grids."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# torch.distributed.{fsdp, tensor, checkpoint} are imported where used: ~1.6 s non-FSDP runs skip


def _full_options(cpu_offload: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)  # offload: rank 0, CPU


def shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place: one FSDP2 unit per block of ``model.blocks``, the rest the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters ``optimizer`` holds, in ``state_dict()``'s numbering (by group)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The full state dict on rank 0 (CPU tensors), {} elsewhere. Collective (every rank calls)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options())


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's full, integer-keyed state on rank 0, {} elsewhere (collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    state = get_optimizer_state_dict(model, optimizer, options=_full_options())
    if not state:
        return {}
    index = {name: i for i, name in enumerate(optimizer_param_names(model, optimizer))}
    groups = [{**g, "params": [index[name] for name in g["params"]]}
              for g in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": groups}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Load a full, integer-keyed optimizer state (DDP or FSDP checkpoint) into the sharded one."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)
    names = optimizer_param_names(model, optimizer)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    by_name = {"state": {names[i]: value for i, value in state["state"].items()},
               "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=_full_options(cpu_offload=False))


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global gradient norm over all shards (before clipping); clips to ``max_norm`` (inf: no)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


class ShardedEMA:
    """EMA of a sharded model as fp32 shards laid out like the parameters'. ``update``: ``ema ←
    decay·ema + (1 − decay)·p`` on the local shards (as ``update_ema``); ``gather_into(module)``
    writes the full EMA into a module (collective)."""

    def __init__(self, model: nn.Module, ema: nn.Module) -> None:
        from torch.distributed.tensor import distribute_tensor

        self.params = dict(model.named_parameters())
        start = dict(ema.named_parameters())
        if start.keys() != self.params.keys():
            differ = sorted(start.keys() ^ self.params.keys())[:5]
            raise KeyError(f"EMA and model parameters differ: {differ}")
        self.shards = {}
        for name, p in self.params.items():
            full = start[name].detach().to(device=p.device, dtype=torch.float32)
            shard = distribute_tensor(full, p.device_mesh, p.placements)  # collective
            self.shards[name] = shard.to_local().clone()

    @torch.no_grad()
    def update(self, decay: float) -> None:
        targets = list(self.shards.values())
        sources = [self.params[n].to_local().detach().to(torch.float32) for n in self.shards]
        torch._foreach_mul_(targets, decay)  # the same two kernels as update_ema
        torch._foreach_add_(targets, sources, alpha=1.0 - decay)

    @torch.no_grad()
    def gather_into(self, ema: nn.Module) -> nn.Module:
        """Copy the full EMA into ``ema`` (an unsharded copy of the model) on every rank."""
        from torch.distributed.tensor import DTensor

        targets = dict(ema.named_parameters())
        for name, shard in self.shards.items():
            p = self.params[name]
            full = DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride())
            targets[name].copy_(full.full_tensor())
        return ema


class Sharded:
    """The FSDP2 side of a run, as the loop calls it (the loop imports nothing of FSDP): the sharded
    ``model``, its fp32 EMA shards (``ema``), the global gradient norm and full state dicts."""

    def __init__(self, model: nn.Module, ema: nn.Module) -> None:
        self.model, self.ema = model, ShardedEMA(model, ema)

    def clip_grad_norm(self, max_norm: float) -> float:
        """:func:`clip_grad_norm` of the sharded model."""
        return clip_grad_norm(self.model, max_norm)

    def full_states(self, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """(model, optimizer) full state dicts on rank 0, {} elsewhere (collective)."""
        return full_model_state(self.model), full_optimizer_state(self.model, optimizer)
