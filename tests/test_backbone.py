"""The backbone interface (``sit_vit5.models.backbone``): SiT and ViT-5 implement it, and a third,
toy backbone that implements only it trains, samples with guidance, reports its gates and feeds
REPA's hook, with no other attribute looked up."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sit_vit5.models import create_model
from sit_vit5.models.backbone import Backbone, BackboneBlock
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.sampling import SamplingPipeline
from sit_vit5.training.diagnostics import GateMonitor
from sit_vit5.training.repa import HiddenCapture

TINY = dict(input_size=8, in_channels=1, num_classes=10, depth=2, hidden_size=64, num_heads=4)


class ToyBlock(nn.Module):
    """A residual MLP block with adaLN gates: the BackboneBlock names and nothing else shared."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.mlp = nn.Linear(dim, dim)
        self.gamma_1 = self.gamma_2 = None

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale, gate, *_ = self.adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)
        return x + gate * self.mlp(x * (1 + scale) + shift)


class ToyBackbone(nn.Module):
    """Patches of 2×2 as tokens, a label table with a null row, a time MLP, residual blocks."""

    def __init__(self, input_size: int = 8, in_channels: int = 1, num_classes: int = 10,
                 hidden_size: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.input_size, self.patch_size, self.in_channels = input_size, 2, in_channels
        self.out_channels, self.num_classes, self.hidden_size = in_channels, num_classes, hidden_size
        self.num_registers, self.grid = 0, (input_size // 2, input_size // 2)
        self.embed = nn.Linear(4 * in_channels, hidden_size)
        self.labels = nn.Embedding(num_classes + 1, hidden_size)
        self.time = nn.Linear(1, hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(hidden_size) for _ in range(depth))
        self.head = nn.Linear(hidden_size, 4 * in_channels)

    @property
    def has_null_class(self) -> bool:
        return True

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        pass

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = x.unfold(2, 2, 2).unfold(3, 2, 2).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 4 * c)
        cond = self.time(t.float()[:, None]) + self.labels(y)
        tokens = self.embed(tokens)
        for block in self.blocks:
            tokens = block(tokens, cond)
        out = self.head(tokens).reshape(b, h // 2, w // 2, c, 2, 2)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def test_sit_and_vit5_implement_the_interface():
    for name in ("SiT-S/2", "ViT5-S/2"):
        model = create_model(name, **TINY)
        assert isinstance(model, Backbone), name
        assert all(isinstance(block, BackboneBlock) for block in model.blocks), name
        assert model.hidden_size == 64 and model.has_null_class
        assert model.num_registers == (4 if name.startswith("ViT5") else 0)
    assert not create_model("SiT-S/2", **TINY, class_dropout_prob=0.0).has_null_class


def test_a_toy_backbone_with_only_the_interface_trains_and_samples():
    torch.manual_seed(0)
    model = ToyBackbone()
    assert isinstance(model, Backbone) and not isinstance(nn.Linear(2, 2), Backbone)
    objective = create_objective({})
    x, y = torch.randn(4, 1, 8, 8), torch.randint(10, (4,))
    monitor, capture = GateMonitor(model), HiddenCapture(model, depth=2)
    with monitor.capture(), capture.armed():
        loss = objective.loss(model, x, y).mean()
    loss.backward()
    assert torch.isfinite(loss) and model.embed.weight.grad is not None
    assert capture.take().shape == (4, 16, 32)  # the patch tokens of block 2
    gates = monitor.metrics()
    assert set(gates) >= {"gate/attn/mean", "gate/mlp/00", "gate_spread/mlp/01"}
    spec = SampleSpec(method="ode", sampling_method="euler", num_steps=4, cfg_scale=2.0)
    pipe = SamplingPipeline(model, objective, spec, (1, 8, 8), num_classes=10)
    out = pipe.generate(range(3), global_seed=0)
    assert out.images.shape == (3, 8, 8, 1) and out.images.dtype.name == "uint8"
    assert out.nfe == 3
