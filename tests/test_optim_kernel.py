"""Issue 56: AdamW's implementation follows the parameters' device (``training.optim.adamw_kernel``): fused on
CUDA, torch's default elsewhere and under FSDP; and the fused kernel is the same AdamW, also behind the loop's
GradScaler sequence (unscale_, step, update; a step with an inf gradient skipped), checked on the CPU, where torch
has a fused kernel too."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sit_vit5.training.optim import adamw_kernel, param_groups


def _on(*kinds: str) -> list[dict]:
    return [{"params": [SimpleNamespace(device=torch.device(k)) for k in kinds]}]


def test_fused_only_when_every_parameter_is_on_cuda_and_not_sharded():
    model = torch.nn.Linear(3, 2)
    assert adamw_kernel(param_groups(model, 0.0)) == {}  # the CPU: today's optimizer, bit for bit
    assert adamw_kernel(param_groups(model, 0.01)) == {}
    assert adamw_kernel(_on("cuda", "cuda")) == {"fused": True}
    assert adamw_kernel(_on("cuda", "cpu")) == {}
    assert adamw_kernel(_on("cuda"), sharded=True) == {}
    assert adamw_kernel([{"params": []}]) == {}


def _train(fused: bool, scaled: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    groups = param_groups(model, 0.01)
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, **({"fused": True} if fused else {}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(5, 8, generator=gen)
        loss = model(x).square().mean()
        if step == 3:
            loss = loss * float("inf")  # an overflow: the scaler must skip this step
        if scaler is None:
            if step == 3:
                continue
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_is_the_same_adamw_with_and_without_the_grad_scaler():
    plain = _train(fused=False, scaled=False)
    for fused, scaled in ((True, False), (True, True), (False, True)):
        got = _train(fused, scaled)
        for a, b in zip(got, plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
