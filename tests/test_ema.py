"""EMA: closed form over several updates, DiT's exact arithmetic, fp32 storage, buffers."""

import pytest
import torch
from torch import nn

from sit_vit5.training.ema import create_ema, update_ema


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.register_buffer("counter", torch.zeros(()))


def test_closed_form_after_k_updates():
    torch.manual_seed(0)
    model, decay = Tiny(), 0.9
    ema = create_ema(model)
    p0 = {k: v.double().clone() for k, v in model.named_parameters()}
    history = []
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        history.append({k: v.double().clone() for k, v in model.named_parameters()})
        update_ema(ema, model, decay)
    k = len(history)
    for name, value in ema.named_parameters():
        # ema_k = d^k p0 + (1 - d) Σ_i d^(k-i) p_i, i = 1..k
        expected = decay**k * p0[name] + sum((1 - decay) * decay ** (k - i) * history[i - 1][name]
                                             for i in range(1, k + 1))
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6)


def test_matches_dit_update_bit_for_bit():
    torch.manual_seed(1)
    model, decay = Tiny(), 0.9999
    ema, reference = create_ema(model), create_ema(model)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        update_ema(ema, model, decay)
        ref = dict(reference.named_parameters())
        with torch.no_grad():  # DiT train.py update_ema
            for name, param in model.named_parameters():
                ref[name].mul_(decay).add_(param.data, alpha=1 - decay)
    for (name, a), (_, b) in zip(ema.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_fp32_copy_without_grads_and_buffers_follow():
    model = Tiny().to(torch.bfloat16)
    ema = create_ema(model)
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in ema.parameters())
    assert not ema.training
    model.counter.fill_(7)
    update_ema(ema, model, 0.5)
    assert ema.counter.item() == 7  # buffers are copied, not averaged
    assert all(p.dtype == torch.float32 for p in ema.parameters())


def test_frozen_parameter_is_averaged():
    model = Tiny()
    with torch.no_grad():
        model.frozen.zero_()
    ema = create_ema(model)
    with torch.no_grad():
        model.frozen.fill_(1.0)
    update_ema(ema, model, 0.75)
    assert torch.equal(ema.frozen, torch.full((4,), 0.25))


def test_mismatched_models_raise():
    with pytest.raises(KeyError):
        update_ema(create_ema(Tiny()), nn.Linear(3, 2), 0.9)
