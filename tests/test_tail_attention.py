"""Issue 56: attention over main + tail tokens (ViT-5's patches + registers) with flash attention at the
main block's tiles (``sit_vit5/models/tail_attention.py``), checked against SDPA on the CPU: the Triton kernels in
Triton's interpreter, the fallback, the dispatch rule, the fake-CUDA trace and the cost model's view of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sit_vit5.models import kernels
from sit_vit5.models import tail_attention as ta
from tests.helpers import OpNames, rel

ROOT = Path(__file__).resolve().parent.parent


def views(b: int, h: int, n: int, d: int, dtype=torch.float32, seed: int = 0):
    """q, k, v (B, H, N, d) as the model passes them: strided views of one (B, N, 3, H, d) activation."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, n, 3, h, d, generator=gen).to(dtype).requires_grad_()
    return qkv, [t.transpose(1, 2) for t in qkv.unbind(2)]


def sdpa_and_grad(fn, b, h, n, d, dtype=torch.float32):
    qkv, (q, k, v) = views(b, h, n, d, dtype)
    out = fn(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    return out, torch.autograd.grad(out, qkv, grad)[0]


_KERNEL_CHECK = r"""
import json, torch
import torch.nn.functional as F
from sit_vit5.models import tail_attention as ta
from tests.helpers import rel
from tests.test_tail_attention import sdpa_and_grad, views
out = {"interpret": ta._INTERPRET}
# (B, H, N, main, d): tails of 1, 4 and 16 tokens; head dims 8, 12 (masked block) and 16; main 32 / 48 / 64
for b, h, n, main, d in ((2, 2, 36, 32, 8), (1, 3, 33, 32, 12), (2, 1, 64, 48, 8), (1, 2, 80, 64, 16)):
    want, want_g = sdpa_and_grad(F.scaled_dot_product_attention, b, h, n, d)
    got, got_g = sdpa_and_grad(lambda q, k, v: ta.tail_attention(q, k, v, main)[0], b, h, n, d)
    _, (q, k, v) = views(b, h, n, d)
    lse = ta.tail_attention(q, k, v, main)[1]
    out[f"{(b, h, n, main, d)}"] = [rel(got, want), rel(got_g, want_g), rel(lse, ta.reference(q, k, v)[1])]
exact, exact_g = sdpa_and_grad(F.scaled_dot_product_attention, 2, 2, 36, 8)
errors = []
for fn in (F.scaled_dot_product_attention, lambda q, k, v: ta.tail_attention(q, k, v, 32)[0]):
    o, g = sdpa_and_grad(fn, 2, 2, 36, 8, torch.bfloat16)
    errors.append([rel(o, exact), rel(g, exact_g), o.dtype == torch.bfloat16])
out["bf16"] = errors
_, (q, k, v) = views(2, 2, 36, 8)
o, lse = ta.tail_attention(q, k, v, 32)
grads = ta.tail_attention_backward(torch.ones_like(o), q, k, v, o, lse, 32)
out["token_major"] = [t.transpose(1, 2).is_contiguous() for t in (o, *grads)]
print(json.dumps(out))
"""


def test_the_kernels_match_sdpa_in_the_interpreter():
    """Flash attention (CPU) on the main block + the Triton kernels (interpreted) for the tail rows and columns:
    output, log-sum-exp and the gradients equal SDPA's within fp32 rounding on strided views (tails of 1, 4 and
    16 tokens, masked head dims). bf16: no further from fp32 than SDPA's own bf16 result, to 2x. Every output
    is laid out (B, N, H, d) underneath."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("interpret") is True
    assert out.pop("token_major") == [True] * 4  # out, dq, dk, dv: (B, N, H, d) underneath
    (sdpa_out, sdpa_grad, _), (tail_out, tail_grad, is_bf16) = out.pop("bf16")
    assert is_bf16 and tail_out <= 2 * sdpa_out and tail_grad <= 2 * sdpa_grad, (sdpa_out, tail_out)
    assert len(out) == 4
    for case, errors in out.items():
        assert max(errors) < 1e-5, (case, errors)


def test_the_fallback_is_the_definition_and_its_gradient():
    """Off CUDA (no interpreter) the op computes the whole softmax in fp32: SDPA's output, and through its
    registered backward SDPA's gradients."""
    want, want_g = sdpa_and_grad(F.scaled_dot_product_attention, 2, 3, 20, 8)
    got, got_g = sdpa_and_grad(lambda q, k, v: ta.tail_attention(q, k, v, 16)[0], 2, 3, 20, 8)
    assert rel(got, want) < 1e-6 and rel(got_g, want_g) < 1e-5
    # laid out as the kernels' (and flash attention's) outputs: the projection's reshape is a view
    assert got.transpose(1, 2).is_contiguous() and not got.is_contiguous()
    # under autocast (the model's bf16 runs) the definition still runs in fp32: its lse stays fp32
    _, (q, k, v) = views(2, 3, 20, 8, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = ta.tail_attention(q, k, v, 16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # the comparison can fail: another split's scale is another function
    wrong, _ = sdpa_and_grad(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), 2, 3, 20, 8)
    assert rel(wrong, want) > 1e-2


def test_a_split_outside_the_kernels_range_is_named():
    _, (q, k, v) = views(1, 1, 40, 8)
    for main in (0, 20, 16):  # no main block, main not a multiple of 16, a tail of 24 tokens
        with pytest.raises(ValueError, match=f"40 tokens = main {main}"):
            ta.tail_attention(q, k, v, main)


def test_the_switch_takes_the_split_only_where_flash_would_pad(monkeypatch):
    """128·m + r tokens with 0 < r <= 16, half precision, switch on: the split (main = 128·m); everything else,
    and the switch off, plain SDPA."""
    calls = []
    monkeypatch.setattr(ta, "tail_attention", lambda q, k, v, main: calls.append((q.shape[-2], main))
                        or (F.scaled_dot_product_attention(q, k, v), None))
    for n, dtype, on in ((132, torch.bfloat16, True), (260, torch.float16, True), (128, torch.bfloat16, True),
                         (150, torch.bfloat16, True), (100, torch.bfloat16, True), (132, torch.float32, True),
                         (132, torch.bfloat16, False)):
        _, (q, k, v) = views(1, 1, n, 8, dtype)
        with kernels.tail_attention(on):
            out = kernels.attention(q, k, v)
        assert out.shape == q.shape
    assert calls == [(132, 128), (260, 256)]


def test_vit5_takes_the_split_on_fake_cuda_and_the_cost_model_sees_the_patch_tiles():
    """ViT5 at 32 x 32 latents (256 patches + 4 registers) in bf16 on fake CUDA: the forward goes through the
    op, once per block, and no SDPA kernel runs (a fake backward needs a CUDA context). The cost model's trace
    (the GPU path on fake CPU tensors, bf16 autocast) takes the op both ways, prices its flash kernel at 256
    tokens' tiles and predicts a shorter step than flash over 260."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench import cost_model as cm
    from sit_vit5.models import create_model

    torch.manual_seed(0)
    model = create_model("ViT5-S/2", depth=2, hidden_size=64, num_heads=2, input_size=32, num_classes=10)
    with FakeTensorMode(allow_non_fake_inputs=True), kernels.tail_attention():
        net = model.to("cuda", torch.bfloat16).train()
        x = torch.randn(2, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
        with OpNames() as ops:
            out = net(x, torch.rand(2, device="cuda"), torch.tensor([1, 2], device="cuda"))
    assert out.device.type == "cuda" and out.shape[-2:] == (32, 32)
    assert ops.names.count("tail_attention") == 2
    assert not [name for name in ops.names if "scaled_dot_product" in name]

    plain = cm.trace("ViT5", "S", 4, train=True, input_size=32, depth=2)
    split = cm.trace("ViT5", "S", 4, train=True, input_size=32, depth=2, tail=True)
    q256 = torch.empty(4, 6, 256, 64)
    names = [op.name for op in split.ops]
    assert names.count("tail_attention") == names.count("tail_attention_backward") == 4  # 2 kernels each
    assert not [name for name in names if "scaled_dot_product" in name]
    flash = [op for op in split.ops if op.name == "tail_attention"][::2]
    assert len(flash) == 2 and all(op.padding == cm.flash_padding(q256, q256, cm.FLASH_FWD_TILE) for op in flash)
    assert cm.predict(split, "eager").device < cm.predict(plain, "eager").device
    # its output is (B, N, H, d) underneath: the projection's reshape copies nothing
    assert "clone" not in {op.name for op in split.ops if op.group == "attention" and op.phase == "fwd"}


def test_compiled_fullgraph_keeps_the_op():
    """torch.compile(fullgraph=True) captures the op without a graph break (dynamo sees a torch operator with
    a fake version and a registered backward); forward and gradients match eager (CPU: the fallback)."""
    from sit_vit5.models import create_model

    torch.manual_seed(0)
    model = create_model("ViT5-S/2", depth=1, hidden_size=64, num_heads=2, input_size=32, num_classes=10).eval()
    with torch.no_grad():  # away from adaLN-Zero's exact 0 output
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, t, y = torch.randn(2, 4, 32, 32), torch.rand(2), torch.tensor([1, 2])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def run(net):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x, t, y).float()
        return out, torch.autograd.grad(out.square().mean(), list(model.parameters()))

    torch._dynamo.reset()
    with kernels.generic_path(), kernels.tail_attention():
        want, want_g = run(model)
        got, got_g = run(torch.compile(model, backend=backend, fullgraph=True))
    assert len(graphs) == 1 and "tail_attention" in graphs[0] and "scaled_dot_product" not in graphs[0]
    assert rel(got, want) < 1e-6
    for a, b in zip(got_g, want_g):
        assert rel(a, b) < 1e-5


_COMPILE_CHECK = r"""
import inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sit_vit5.models import tail_attention as ta
activations = {"Q", "K", "V", "O1", "OUT", "DO", "DQ1", "DQ", "DK1", "DV1", "DK", "DV"}
blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_R=ta.MAX_TAIL, BLOCK_D=128)  # XL/2: 256 + 4 tokens, d 72
out = {}
for arch, dtype in ((80, "bf16"), (90, "bf16"), (90, "fp16")):  # the split runs in half precision only
    for kernel in (ta._forward_kernel, ta._main_rows_backward_kernel, ta._keys_backward_kernel):
        names = inspect.signature(kernel.fn).parameters
        signature = {n: "constexpr" if n in blocks else f"*{dtype}" if n in activations
                     else "fp32" if n == "scale" else "*fp32" if n.isupper() else "i32" for n in names}
        src = ASTSource(fn=kernel, signature=signature,
                        constexprs={n: v for n, v in blocks.items() if n in names})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
        out[f"sm_{arch} {dtype} {kernel.fn.__name__}"] = len(compiled.asm["cubin"])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_kernels_compile_for_ampere_and_hopper():
    """Triton compiles the three kernels to CUDA binaries (bf16 for sm_80 and sm_90, fp16 for sm_90: the split
    runs in half precision) at XL/2's blocks without a GPU: what the interpreter cannot check (dot operand types,
    layouts, a name typed differently in two branches, which this caught)."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("this triton has no ptxas to assemble CUDA binaries")
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out) == 9 and all(size > 0 for size in out.values()), out


def test_the_cuda_flash_calls_match_atens_signatures_on_fake_cuda():
    """The two aten calls the CUDA path makes (flash forward returning its log-sum-exp; flash backward given an
    output, lse and the rng state it does not read without dropout), run on fake CUDA tensors through their meta
    kernels at XL/2's shape: argument order and types as this torch takes them, and outputs laid out as flash's,
    (B, N, H, d) underneath. What the interpreter tests cannot reach (they take the CPU flash op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        qkv = torch.empty(2, 260, 3, 16, 72, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        main = (slice(None), slice(None), slice(None, 256))
        out, lse = ta._flash(q[main], k[main], v[main], 72**-0.5)
        assert out.shape == (2, 16, 256, 72) and out.dtype == torch.bfloat16 and out.transpose(1, 2).is_contiguous()
        assert lse.shape == (2, 16, 256) and lse.dtype == torch.float32
        merged, merged_lse = ta._empty(q), torch.empty(2, 16, 260, device="cuda")
        grads = ta._flash_backward(torch.empty_like(merged)[main], q[main], k[main], v[main], merged[main],
                                   merged_lse[main].contiguous(), 72**-0.5)
        assert [g.shape for g in grads] == [(2, 16, 256, 72)] * 3 and all(g.is_cuda for g in grads)
