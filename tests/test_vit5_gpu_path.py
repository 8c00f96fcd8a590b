"""Issue 56: ViT-5's GPU (device-generic) path, checked on the CPU inside ``kernels.generic_path()``.

* ``kernels.qk_norm_rope`` (q and k normalised together in their dtype; weight and rotation in fp32:
  a complex multiply eager, the real form compiled), the RMSNorm without no-op casts and the LayerScale
  gate + residual stay within 1e-5 relative (fp32, forward and gradients) of the previous
  generic code, kept here as reference functions; in fp64 the fused form is the defining formula
  (``apply_rope`` of ``F.rms_norm``) to 1e-12.
* bf16: the fused form is no further from the fp64 truth than the previous chain (it rounds less often).
* The CPU (default) path does not take any of it.
* The RoPE tables of the training grid are non-persistent buffers: out of the state dict, moved and
  copied with the model, and read by a compiled forward without rebuilding them on the host.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sit_vit5.models import create_model
from sit_vit5.models.kernels import Rotation, generic_path, qk_norm_rope, swap_pairs
from sit_vit5.models.layers import Block, RMSNorm, gated_residual
from sit_vit5.models.rope import RopeTables, apply_rope
from tests.helpers import OpNames, rel

TINY = dict(input_size=8, in_channels=4, depth=2, hidden_size=64, num_heads=4, num_classes=10)


# ------------------------------------------------------------------ the previous generic code, as it was


def ref_rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm.forward's generic branch before issue 56: fp32 in, F.rms_norm, cast back."""
    return F.rms_norm(x.float(), (norm.dim,), norm.weight, norm.eps).to(x.dtype)


def ref_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotation's real form before issue 56 (x (B, N, H, d), cos/sin (N, d))."""
    folded = torch.stack((-sin[:, 0::2], sin[:, 1::2]), dim=-1).flatten(-2).unsqueeze(-2)
    return x * cos.unsqueeze(-2) + swap_pairs(x) * folded


def ref_qk(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k of Attention.forward's generic branch before issue 56: norm, then rotation, each apart."""
    q, k, _ = qkv.unbind(2)
    return ref_rotate(ref_rms_norm(q, q_norm), cos, sin), ref_rotate(ref_rms_norm(k, k_norm), cos, sin)


def ref_residual(x: torch.Tensor, gate: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + gate.unsqueeze(1) * branch


# ------------------------------------------------------------------ helpers


def _norms(d: int, dtype: torch.dtype = torch.float32, seed: int = 3) -> tuple[RMSNorm, RMSNorm]:
    gen = torch.Generator().manual_seed(seed)
    norms = RMSNorm(d).to(dtype), RMSNorm(d).to(dtype)
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(torch.rand(d, generator=gen, dtype=dtype) + 0.5)
    return norms


def _tables(dtype: torch.dtype, grid=(4, 4), regs: int = 4, d: int = 16, complex_tables: bool = True):
    rope = RopeTables(d, grid, 10000.0, regs, 100.0)
    rotation = rope(grid, torch.device("cpu"), dtype)
    if not complex_tables:  # as a compiled forward builds it: the real form
        rotation = Rotation(*rotation.source, rope.tables(grid, torch.device("cpu"), torch.float32),
                            complex_tables=False)
        assert rotation.wide_cis is None
    return rotation


def _qkv(dtype: torch.dtype, seed: int = 0, n: int = 20, heads: int = 2, d: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(2, n, 3, heads, d, generator=gen)).to(dtype).requires_grad_()


# ------------------------------------------------------------------ fp32 within 1e-5 of the previous code


@pytest.mark.parametrize("complex_tables", [True, False], ids=["complex", "real"])
def test_fused_qk_norm_rope_is_the_previous_chain_within_1e5_fp32_forward_and_gradients(complex_tables):
    rotation, (qn, kn) = _tables(torch.float32, complex_tables=complex_tables), _norms(16)
    cos, sin = rotation.source
    qkv = _qkv(torch.float32)
    grad_out = torch.randn(2, 20, 2, 2, 16, generator=torch.Generator().manual_seed(9))
    want_q, want_k = ref_qk(qkv, qn, kn, cos, sin)
    want = torch.stack((want_q, want_k), dim=2)
    inputs = (qkv, qn.weight, kn.weight)
    g_want = torch.autograd.grad(want, inputs, grad_out)
    got = qk_norm_rope(qkv[:, :, :2], qn.weight, kn.weight, qn.eps, rotation)
    g_got = torch.autograd.grad(got, inputs, grad_out)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel(got, want) < 1e-5
    for a, b in zip(g_got, g_want):
        assert rel(a, b) < 1e-5
    assert g_got[0][:, :, 2].abs().max() == 0  # v untouched


def test_fused_qk_norm_rope_is_the_defining_formula_in_fp64():
    """Independent of the code above: ``apply_rope`` (rotate_half form) of ``F.rms_norm`` times the weight."""
    rotation, (qn, kn) = _tables(torch.float64), _norms(16, torch.float64)
    cos, sin = rotation.source
    qkv = _qkv(torch.float64)
    got = qk_norm_rope(qkv[:, :, :2], qn.weight, kn.weight, qn.eps, rotation)
    for i, norm in enumerate((qn, kn)):
        x = qkv[:, :, i]  # (B, N, H, d)
        normed = F.rms_norm(x, (16,), eps=norm.eps) * norm.weight
        want = apply_rope(normed.transpose(1, 2), cos, sin).transpose(1, 2)
        assert rel(got[:, :, i], want) < 1e-12
    assert torch.autograd.gradcheck(
        lambda x, wq, wk: qk_norm_rope(x, wq, wk, 1e-6, rotation),
        (qkv[:1, :, :2, :1].detach().clone().requires_grad_(), qn.weight, kn.weight))


def test_fused_qk_norm_rope_in_bf16_is_no_less_accurate_than_the_previous_chain():
    rot16, rot64 = _tables(torch.bfloat16), _tables(torch.float64)
    qn, kn = _norms(16)
    qkv = _qkv(torch.bfloat16).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = qk_norm_rope(qkv[:, :, :2], qn.weight, kn.weight, qn.eps, rot16)
    assert got.dtype == torch.bfloat16
    old = torch.stack(ref_qk(qkv, qn, kn, *rot16.source), dim=2)
    truth = qk_norm_rope(qkv[:, :, :2].double(), qn.weight.double(), kn.weight.double(), qn.eps, rot64)
    assert rel(got, truth) <= rel(old, truth) + 1e-3  # bf16 eps is 2**-8 = 4e-3
    assert rel(got, truth) < 1e-2


def test_rmsnorm_and_layerscale_residual_are_the_previous_code_within_1e5():
    torch.manual_seed(0)
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 20, 64, requires_grad=True)
    with generic_path():
        got = norm(x)
    want = ref_rms_norm(x, norm)
    g = torch.randn_like(want)
    assert rel(got, want) < 1e-5
    for a, b in zip(torch.autograd.grad(got, (x, norm.weight), g), torch.autograd.grad(want, (x, norm.weight), g)):
        assert rel(a, b) < 1e-5

    # a block with LayerScale on the generic path against the same weights with the residual as before
    block = Block(64, 4, norm="rmsnorm", qk_norm=True, qkv_bias=False, layer_scale_init=1.0)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    c = torch.randn(2, 64)
    rotation = _tables(torch.float32)
    with generic_path():
        got = block(x, c, rotation)
        mod = block.adaLN_modulation(c).chunk(6, dim=1)
        gate_msa, gate_mlp = mod[2] * block.gamma_1, mod[5] * block.gamma_2
        h = ref_residual(x, gate_msa, block.attn(block.norm1(x) * (1 + mod[1].unsqueeze(1)) + mod[0].unsqueeze(1),
                                                 rotation))
        want = ref_residual(h, gate_mlp, block.mlp(block.norm2(h) * (1 + mod[4].unsqueeze(1)) + mod[3].unsqueeze(1)))
    params = (x, *block.parameters())
    assert rel(got, want) < 1e-5
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        assert rel(a, b) < 1e-5


def test_generic_model_within_1e5_of_the_cpu_path_and_the_cpu_path_takes_none_of_it(monkeypatch):
    """The whole model: the generic path (GPU ops) against the CPU path (whose ops did not change), fp32."""
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", **TINY).train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([1, 2])

    def run():
        torch.manual_seed(1)
        out = model(x, t, y)
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
        return out, grads

    calls = []
    import sit_vit5.models.kernels as kernels

    monkeypatch.setattr(kernels, "qk_norm_rope", lambda *a: calls.append(1) or qk_norm_rope(*a))
    cpu, g_cpu = run()
    assert not calls  # the CPU path keeps its nodes
    with generic_path():
        gen, g_gen = run()
    assert len(calls) == TINY["depth"]
    assert rel(gen, cpu) < 1e-5
    for a, b in zip(g_gen, g_cpu):
        assert rel(a, b) < 1e-5


# ------------------------------------------------------------------ RoPE table buffers


def test_rope_buffers_stay_out_of_the_state_dict_and_travel_with_the_model():
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", **TINY)
    assert not [k for k in model.state_dict() if "rope" in k]
    names = dict(model.named_buffers())
    assert set(names) == {"rope.train_cos", "rope.train_sin"}
    ang = model.rope.angles(model.grid)  # float64 angles: the tables the eager cache builds
    assert torch.equal(names["rope.train_cos"], ang.cos().float())
    assert torch.equal(names["rope.train_sin"], ang.sin().float())
    # cast to bf16 from the fp32 buffer = cast from float64 (the eager cache's tables)
    assert torch.equal(names["rope.train_cos"].bfloat16(), ang.cos().bfloat16())
    # a state dict of a model without the buffers (every checkpoint so far) loads strictly
    fresh = create_model("ViT5-S/2", **TINY)
    fresh.load_state_dict(model.state_dict(), strict=True)
    ema = copy.deepcopy(model)
    assert torch.equal(ema.rope.train_sin, model.rope.train_sin)
    assert ema.rope.train_sin.data_ptr() != model.rope.train_sin.data_ptr()
    cpu = torch.device("cpu")
    assert model.rope._buffered(model.grid, cpu, torch.bfloat16)
    assert not model.rope._buffered((8, 8), cpu, torch.float32)  # another grid: built as before
    model.to(torch.bfloat16)  # rounds the buffers: they are no longer used
    assert not model.rope._buffered(model.grid, cpu, torch.bfloat16)


def _graphs_of(model, *inputs, generic: bool) -> list[str]:
    """The FX code of every graph dynamo captures for a fullgraph forward + backward (no graph break)."""
    graphs: list[str] = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with generic_path() if generic else nullcontext():
        compiled(*inputs).square().mean().backward()
    return graphs


@pytest.mark.parametrize("generic", [False, True], ids=["cpu-path", "gpu-path"])
def test_compiled_forward_reads_the_buffers_not_host_built_tables(generic):
    """The previous code rebuilt the angles from float64 aranges inside the graph and copied cos/sin over
    (a host-to-device copy per step on a GPU); now the graph casts the buffers."""
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", **TINY).train()
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([1, 2])
    (code,) = _graphs_of(model, x, t, y, generic=generic)
    assert "float64" not in code and "train_cos" in code
    if generic:  # compiled: the real form of the rotation (Inductor generates no complex code)
        assert "addcmul" in code and "rms_norm" in code and "complex" not in code
    model.zero_grad()
    # another grid still compiles in one graph (tables built in the graph, as before)
    (code,) = _graphs_of(model, torch.randn(2, 4, 12, 12), t, y, generic=generic)
    assert "float64" in code


@pytest.mark.slow
@pytest.mark.parametrize("generic", [False, True], ids=["cpu-path", "gpu-path"])
def test_inductor_fullgraph_forward_and_backward_match_eager(generic):
    """torch.compile(fullgraph=True) with Inductor (CPU C++ codegen): no graph break in the forward, the
    backward compiles, and loss and gradients match eager within fp32 fusion rounding."""
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", **{**TINY, "depth": 1}).eval()  # eval: no label dropout, whose draws
    # Inductor makes with its own generator
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([1, 2])

    def run(net):
        torch.manual_seed(1)
        loss = net(x, t, y).square().mean()
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with generic_path() if generic else nullcontext():
        loss, grads = run(compiled)
        want_loss, want_grads = run(model)
    assert rel(loss, want_loss) < 1e-5
    for a, b in zip(grads, want_grads):
        assert rel(a, b) < 1e-4


def test_gated_residual_is_one_addcmul_only_when_sampling_on_the_gpu_path():
    """``x + gate * branch``: the CPU path keeps its two ops (its bits), and so does training on the GPU path
    (the backward then runs in the gate's and branch's dtype); sampling on the GPU path adds the product in one
    ``addcmul`` (no (B, N, D) product written). The three agree within fp32 rounding."""

    torch.manual_seed(0)
    x, gate, branch = torch.randn(2, 5, 8), torch.randn(2, 1, 8), torch.randn(2, 5, 8, requires_grad=True)
    results = {}
    for name, generic, grad in (("cpu", False, False), ("gpu-train", True, True), ("gpu-sample", True, False)):
        with generic_path() if generic else nullcontext(), torch.set_grad_enabled(grad), OpNames() as ops:
            results[name] = gated_residual(x, gate, branch)
        results[name + " ops"] = ops.names
    assert results["cpu ops"] == results["gpu-train ops"] == ["mul", "add"]
    assert results["gpu-sample ops"] == ["addcmul"]
    assert torch.equal(results["cpu"], results["gpu-train"]) and rel(results["gpu-sample"], results["cpu"]) < 1e-6


def test_layer_scale_gate_leaves_in_the_modulations_dtype():
    """ViT-5's gate times gamma (fp32) goes back to the modulation's dtype: under bf16 autocast the two residual
    products (gate (B, 1, D) times branch (B, N, D)) run in bf16, as SiT's, and so their backward does."""

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            if func.__name__.startswith("mul") and shapes == [(2, 1, 16), (2, 4, 16)]:
                self.dtypes.append((args[0].dtype, args[1].dtype, out.dtype))
            return out

    torch.manual_seed(0)
    x, c = torch.randn(2, 4, 16, requires_grad=True), torch.randn(2, 16)
    for layer_scale in (1.0, None):  # ViT-5's gate, then SiT's
        block = Block(16, 2, norm="rmsnorm", qk_norm=True, qkv_bias=False, layer_scale_init=layer_scale)
        with generic_path(), torch.autocast("cpu", dtype=torch.bfloat16), Products() as products:
            block(x, c)
        assert products.dtypes == [(torch.bfloat16,) * 3] * 2, (layer_scale, products.dtypes)
