"""The fused QK-norm + RoPE (``models/fused_qk.py``, opt-in on the GPU): its Triton kernels, run by
Triton's CPU interpreter, and its torch reference agree with the GPU path's torch ops
(``kernels.qkv_gpu_path`` with the switch off) forward and backward; the switch routes the GPU path
through it and stays off under torch.compile and torch.func."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sit_vit5.models import create_model
from sit_vit5.models.kernels import fused_qk, generic_path, qkv_gpu_path
from sit_vit5.models.rope import RopeTables
from sit_vit5.utils.errors import ConfigError
from tests.helpers import rel

ROOT = Path(__file__).resolve().parents[1]


def _case(dtype: torch.dtype = torch.float32, heads: int = 3, head_dim: int = 12, side: int = 4,
          registers: int = 4, seed: int = 0):
    """A qkv activation (2, N, 3, H, d) whose q / k view the paths read, the two norm weights and
    the Rotation of a RoPE table with registers on their own theta."""
    gen = torch.Generator().manual_seed(seed)
    rotation = RopeTables(head_dim, (side, side), 10000.0, registers, 100.0)(
        (side, side), torch.device("cpu"), dtype)
    n = side * side + registers
    qkv = torch.randn(2, n, 3, heads, head_dim, generator=gen).to(dtype).requires_grad_()
    q_w, k_w = (1 + 0.2 * torch.randn(2, head_dim, generator=gen)).unbind(0)
    return qkv, q_w.requires_grad_(), k_w.requires_grad_(), rotation


def _run_both(dtype: torch.dtype, **kw):
    """(q, k, v stacked, gradients of qkv / q_w / k_w) of the torch ops and of the fused op, same
    upstream gradient."""
    results = []
    for fused in (False, True):
        qkv, q_w, k_w, rotation = _case(dtype, **kw)
        with generic_path(), fused_qk(fused):
            y = torch.stack(qkv_gpu_path(qkv, q_w, k_w, 1e-6, rotation), dim=2)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        results.append((y, torch.autograd.grad(y, (qkv, q_w, k_w), grad)))
    return results


@pytest.mark.parametrize("shape", [dict(), dict(heads=16, head_dim=72, side=2, registers=0)],
                         ids=["3-heads-registers", "xl-heads"])
def test_the_reference_is_the_gpu_paths_torch_ops_in_fp32(shape):
    (y0, g0), (y1, g1) = _run_both(torch.float32, **shape)
    assert y1.shape == y0.shape
    assert rel(y1, y0) < 1e-5
    for ours, theirs in zip(g1, g0):
        assert rel(ours, theirs) < 1e-5


def test_the_reference_in_bf16_rounds_once():
    """bf16 q / k: the fused op normalises and rotates in fp32 and rounds once; the torch ops round
    after the norm too. They agree within bf16 rounding, and the fused one is the closer to fp32."""
    (y0, _), (y1, _) = _run_both(torch.bfloat16)
    (exact, _), _ = _run_both(torch.float32)
    assert y1.dtype == torch.bfloat16 and rel(y1, y0) < 2e-2
    assert rel(y1, exact) <= rel(y0, exact)


def test_a_changed_formula_is_caught():
    """The comparison can fail: a reference without the weight differs from the torch ops."""
    qkv, q_w, k_w, rotation = _case()
    with generic_path():
        want = torch.stack(qkv_gpu_path(qkv, q_w * 1.5, k_w, 1e-6, rotation))
        with fused_qk():
            got = torch.stack(qkv_gpu_path(qkv, q_w, k_w, 1e-6, rotation))
    assert rel(got, want) > 1e-2


_KERNEL_CHECK = r"""
import json, torch
from sit_vit5.models import fused_qk as F
from tests.test_fused_qk import _case
out = {"interpret": F._INTERPRET}
for dtype, kw in ((torch.float32, {}), (torch.bfloat16, {}),
                  (torch.float32, dict(heads=5, head_dim=20, side=3, registers=0))):
    qkv, q_w, k_w, rotation = _case(dtype, **kw)
    cos, sin = rotation.pair_tables
    q_w, k_w = q_w.detach(), k_w.detach()
    big = torch.zeros(*qkv.shape[:2], 4, *qkv.shape[3:], dtype=dtype)  # a strided view of qkv
    big[:, :, :3] = qkv.detach()
    x = big[:, :, :3]
    *qkv_out, rstd = F.qkv_norm_rope(x, q_w, k_w, cos, sin, 1e-6)  # the kernels (interpreted)
    *qkv_ref, rstd_ref = F.reference(x, q_w, k_w, cos, sin, 1e-6)
    y, y_ref = torch.stack(qkv_out, 2), torch.stack(qkv_ref, 2)
    # the gradients of q, k, v as strided views of one tensor (as unbind gives them), v's transposed
    # (heads not contiguous within a token: copied first)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = (*grad[:, :, :2].unbind(2), grad[:, :, 2].transpose(0, 1).contiguous().transpose(0, 1))
    gx, gq, gk = F.qkv_norm_rope_backward(*grads, x, q_w, k_w, cos, sin, rstd)
    gx_ref, gq_ref, gk_ref = F.reference_backward(*grads, x, q_w, k_w, cos, sin, rstd_ref)
    gw, gw_ref = torch.stack((gq, gk)), torch.stack((gq_ref, gk_ref))
    rel = lambda a, b: float((a.double() - b.double()).abs().max() / b.double().abs().max())
    out[f"{dtype} {kw}"] = [rel(y, y_ref), rel(rstd, rstd_ref), rel(gx, gx_ref), rel(gw, gw_ref),
                            all(t.is_contiguous() for t in qkv_out)
                            and torch.equal(qkv_out[2], x[:, :, 2]),
                            gx.shape == x.shape and torch.equal(gx[:, :, 2], grad[:, :, 2])]
    # without a gradient to come back (sampling): q and k alone, v not copied
    q2, k2, v2, _ = F.qkv_norm_rope(x, q_w, k_w, cos, sin, 1e-6, False)
    out[f"{dtype} {kw}"].append(torch.equal(q2, qkv_out[0]) and torch.equal(k2, qkv_out[1])
                                and v2.numel() == 0)
print(json.dumps(out))
"""


def test_the_triton_kernels_match_the_reference_in_the_interpreter():
    """The forward and backward kernels, run by Triton's CPU interpreter on a strided qkv view
    (registers, 3 and 5 heads, head dims 12 and 20: masked blocks), give the reference's values,
    v and its gradient passed through unchanged (the gradients of q, k, v as strided views); with
    ``copy_v`` off, the same q and k and no v."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("interpret") is True
    assert len(out) == 3
    for case, (y, rstd, gx, gw, contiguous, shaped, without_v) in out.items():
        tol = 1e-2 if "bfloat16" in case else 1e-5  # bf16: the stored outputs are rounded
        assert max(y, gx) < tol and max(rstd, gw) < 1e-5, (case, y, rstd, gx, gw)
        assert contiguous and shaped and without_v, case


def test_the_switch_routes_vit5_through_the_fused_op_and_keeps_its_output(monkeypatch):
    """A ViT-5 forward on the GPU path with the switch on calls the fused op once per block (q, k
    and v together; v not copied without a gradient) and matches the torch ops within fp32
    rounding; compiled code and torch.func
    transforms keep the torch ops (Inductor fuses those; the op has no forward-mode rule)."""
    from sit_vit5.models import fused_qk as fused_module

    model = create_model("ViT5-S/2", depth=2, hidden_size=96, num_heads=4, input_size=8,
                         in_channels=3, num_classes=10, learn_sigma=False).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # away from adaLN-Zero's exact 0 output
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    x, t, y = torch.randn(2, 3, 8, 8), torch.rand(2), torch.tensor([1, 2])
    calls = []
    op = fused_module.qkv_norm_rope
    monkeypatch.setattr(fused_module, "qkv_norm_rope", lambda *a: (calls.append(a[6]), op(*a))[1])
    with generic_path():
        want = model(x, t, y)
        with fused_qk():
            got = model(x, t, y)
            with torch.no_grad():  # sampling: v read in place, not copied; the same output (the
                assert rel(model(x, t, y), got) < 1e-6  # residuals' addcmul rounds once less)
            assert calls == [True, True, False, False]  # copy_v per block
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            model(x, t, y)
            monkeypatch.undo()
            monkeypatch.setattr(fused_module, "qkv_norm_rope",
                                lambda *a: (calls.append(a[6]), op(*a))[1])
            torch.func.jvp(lambda z: model(z, t, y), (x,), (torch.ones_like(x),))
    assert len(calls) == 4
    assert rel(got, want) < 1e-5


_COMPILE_CHECK = r"""
import inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sit_vit5.models import fused_qk as F
pointers = dict(qw_ptr="*fp32", kw_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", rstd_ptr="*fp32",
                gw_ptr="*fp32", n_pos="i32", stride_tok="i32", stride_gq="i32", stride_gk="i32",
                stride_gv="i32", heads="i32", half="i32", eps="fp32", per_token="i32")
out = {}
for arch in (80, 90):
    for dtype in ("bf16", "fp16", "fp32"):
        for kernel in (F._forward_kernel, F._backward_kernel):
            types = {**pointers, **{k: f"*{dtype}" for k in ("qkv_ptr", "q_ptr", "k_ptr", "v_ptr", "gq_ptr",
                                                              "gk_ptr", "gv_ptr", "gx_ptr")}}
            names = inspect.signature(kernel.fn).parameters
            src = ASTSource(fn=kernel, signature={n: types.get(n, "constexpr") for n in names},
                            constexprs={"BLOCK_H": 16, "BLOCK_P": 64})
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
            out[f"sm_{arch} {dtype} {kernel.fn.__name__}"] = len(compiled.asm["cubin"])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_kernels_compile_for_ampere_and_hopper():
    """Triton compiles both kernels to CUDA binaries (sm_80 and sm_90, bf16 / fp16 / fp32 activations,
    XL/2's 16 heads × 72 channels) without a GPU: what the interpreter cannot check (types across
    branches, layouts). This caught a variable that changed dtype in one branch."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("this triton has no ptxas to assemble CUDA binaries")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out) == 12 and all(size > 0 for size in out.values()), out


def test_the_switch_names_itself_when_it_cannot_work(monkeypatch):
    """A value other than 0 / 1 is refused at import, naming the variable; switched on without
    Triton, the GPU path stops with one line naming the switch instead of an ImportError."""
    env = {**os.environ, "SIT_VIT5_FUSED_QK": "yes"}
    run = subprocess.run([sys.executable, "-c", "import sit_vit5.models.kernels"], env=env,
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode != 0 and "SIT_VIT5_FUSED_QK='yes'; valid: 0, 1" in run.stderr
    qkv, q_w, k_w, rotation = _case()
    monkeypatch.setitem(sys.modules, "sit_vit5.models.fused_qk", None)  # as if Triton were missing
    with generic_path(), fused_qk(), pytest.raises(ConfigError, match="SIT_VIT5_FUSED_QK=1.*Triton"):
        qkv_gpu_path(qkv, q_w, k_w, 1e-6, rotation)
