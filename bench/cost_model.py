"""A GPU cost model that runs on a CPU: ViT-5's and SiT's XL/2 step times predicted from their traced aten ops.

    python -m bench.cost_model                          # calibration table, breakdowns (H200)
    python -m bench.cost_model --device H100 --out cost.json
    python -m bench.cost_model --fit                    # refit the six constants to the H200 table
    python -m bench.cost_model --write-doc              # regenerate docs/gpu-cost-model.md

**Trace.** One training step (transport loss forward under bf16 autocast, backward) and one sampling call
(one CFG forward on the doubled batch, as ``guidance.ClassifierFreeGuidance`` runs it) are executed on fake CPU
tensors (``FakeTensorMode``: shapes and dtypes, no values, about a second at XL/2) inside
``sit_vit5.models.kernels.generic_path()``, so ViT-5 takes the ops a GPU runs (``F.rms_norm``, the unfused
QK-norm + RoPE chain), not the CPU autograd nodes. A ``TorchDispatchMode`` records every aten op with its
tensors; a ``TorchFunctionMode`` labels each torch call with the component it belongs to (module path and
source frame) and tags the autograd nodes it creates, so backward ops inherit their forward's label.

**Cost per op.** FLOPs for matmuls (``2·M·K·N``) and attention (``4·B·H·L·S·D`` forward, 2.5x that backward: flash
recomputes the scores; the kernel executes whole tiles, :func:`flash_padding`); bytes read + written for everything
else (distinct elements x itemsize; views free). Eager: one kernel per aten op, except each ``F.rms_norm`` call,
which CUDA runs as one fused kernel per direction (CPU traces its composite). Compiled: Inductor-like fusion, every
maximal chain of non-matmul ops between two matmul/attention ops is one kernel that moves only its external inputs
and outputs (an output is external when an op outside the chain reads it, or nothing does: gradients, the loss).
In training, the backward recomputes a forward chain's products from their sources where saving those is fewer
bytes, as AOTAutograd's min-cut partitioner does (:func:`rematerialize`; checked against its choices).

**Time.** Device: ``Σ_kernel max(FLOPs / (peak·e_kind), bytes / (bandwidth·e_mem))``, with the datasheet peak
and bandwidth of the card. Host: ``python_us`` per torch call an eager forward makes from Python (a tensor
attribute read or write such as ``x.dtype`` or ``p.grad = None`` is not counted: C, no dispatch, no kernel) and
``launch_us`` per kernel the autograd engine, a foreach optimizer or Inductor launches; the step takes the
longer of the two (:func:`predict`). Six constants (``Efficiency``) are fitted once to the H200 table
(``TARGETS``, ``results/bench/h200/``). The optimizer is modelled, not traced: torch's AdamW on CUDA defaults
to ``foreach`` (7 passes over fp32 state, 72 B per parameter at weight decay 0), ``fused=True`` is 1 pass
(28 B); the EMA update (``training/ema.py``: ``_foreach_mul_`` + ``_foreach_add_``) is 20 B per parameter
and is not in the bench's step (nor in the targets).

What it leaves out: host time apart from torch calls (``nn.Module.__call__``, plain Python), which the fit folds
into ``python_us``; cuBLAS tile effects (one matmul efficiency for every shape with M >= 256); the partitioner's
global min cut (modelled chain by chain) and the one graph break of ViT-5 under torch 2.11; the sampler's own
elementwise ops (a few dozen (B, 4, 32, 32) kernels per NFE).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import linecache
import math
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "gpu-cost-model.md"
PACKAGE = str(ROOT / "sit_vit5")


# ----------------------------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Device:
    """A card's datasheet peaks: dense bf16 tensor-core FLOP/s (no sparsity) and HBM bytes/s."""

    name: str
    peak_flops: float
    bandwidth: float


DEVICES = {
    # NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 4.8 TB/s HBM3e, 141 GB
    "H200": Device("NVIDIA H200 SXM", 989e12, 4.8e12),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB (the PCIe card: 756, 2.0)
    "H100": Device("NVIDIA H100 SXM", 989e12, 3.35e12),
}


@dataclass(frozen=True)
class Efficiency:
    """The model's constants: achievable fractions of the datasheet peaks, and host costs.

    Device: ``matmul`` of peak FLOP/s in a GEMM; ``attention`` in flash attention (head dim 72);
    ``memory`` of peak bandwidth in an elementwise/reduction kernel; ``short_rows`` in an eager norm kernel
    over rows shorter than ``SHORT_ROW`` (QK-norm).
    Host: ``python_us`` per torch call made from Python (the eager forward); ``launch_us`` per kernel
    launched by the autograd engine, a foreach optimizer or Inductor's wrapper.
    """

    matmul: float
    attention: float
    memory: float
    short_rows: float
    python_us: float
    launch_us: float


#: Fitted to TARGETS (``python -m bench.cost_model --fit``, H200), rounded; see FIT_NOTE.
FITTED = Efficiency(matmul=0.75, attention=0.0616, memory=0.766, short_rows=1.0, python_us=45.7, launch_us=17.5)
FIT_NOTE = ("6 constants fitted to 8 measured times (rms log error 0.0195; refitted 2026-12-07 when the compiled "
            "backward's recomputation was modelled, 0.018 before it and 0.06 before flash attention's tiles were). "
            "Every time within 3.2 % and every ratio within 0.05, sampling by a margin of 0.002 (+0.048). Six refits "
            "from random starts end at one of two optima: this one, with `short_rows` at its bound 1.0 (no eager "
            "short-row penalty), and rms 0.0246 with `short_rows` 0.54 and `launch_us` anywhere in 0-16; `matmul` "
            "sits at its ceiling (`CEILING`) in both. The opt-in kernels' predicted ratios differ by at most 0.015 "
            "between the two.")

# ----------------------------------------------------------------------------------------------- tracing

#: aten ops costed as matmuls (FLOPs from the operand shapes)
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "linear", "matmul", "convolution",
           "convolution_backward", "_convolution"}
#: allocations and metadata: no kernel, no bytes
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
        "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "device", "_to_copy_noop"}


@dataclass
class Op:
    """One recorded aten op (a kernel in eager mode).

    ``reads``/``writes``: (storage key, bytes) of each tensor argument / output; ``region``: the id of the
    ``F.rms_norm`` call it belongs to (CUDA fuses the call), else None.
    """

    name: str
    phase: str  # "fwd" | "bwd"
    group: str
    kind: str  # "matmul" | "attention" | "memory"
    flops: float
    reads: list[tuple[int, int]] = field(default_factory=list)
    writes: list[tuple[int, int]] = field(default_factory=list)
    region: int | None = None
    stamp: int = 0  # torch calls made from Python so far (forward host work done before this op launches)
    row: int = 0  # last-dim length of its first input (the row a norm/reduction kernel works along)
    padding: float = 1.0  # FLOPs the kernel executes / ``flops`` (flash attention's tiles: :func:`flash_padding`)

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.reads) + sum(b for _, b in self.writes)


@dataclass
class Trace:
    """The ops of one step of one model, and what the optimizer model needs."""

    name: str
    ops: list[Op]
    params: int  # trainable parameters (AdamW state is 2 fp32 tensors of this size)
    param_tensors: int
    fwd_macs: float  # sit_vit5.models.flops: forward multiply-adds per image
    batch: int  # images per step (sampling: before CFG doubles them)
    train: bool
    host_calls: dict[str, int] = field(default_factory=dict)  # torch calls from Python; aten ops by direction
    cache: dict = field(default_factory=dict, repr=False)  # mode -> kernels


def distinct_bytes(t: Tensor) -> int:
    """Bytes a kernel touches in ``t``: its distinct elements (stride-0 broadcast dims once) x itemsize."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def matmul_flops(name: str, args: tuple, out: object) -> float:
    """FLOPs (2 per multiply-add) of a matmul-like aten op from its operand shapes."""
    if name in ("mm", "matmul"):
        (m, k), n = args[0].shape, args[1].shape[-1]
        return 2.0 * m * k * n
    if name == "addmm":
        (m, k), n = args[1].shape, args[2].shape[-1]
        return 2.0 * m * k * n
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name in ("mv", "addmv"):
        mat = args[0] if name == "mv" else args[1]
        return 2.0 * mat.numel()
    if name == "linear":
        return 2.0 * args[0].numel() / args[0].shape[-1] * args[1].numel()
    if name in ("convolution", "_convolution"):
        w = args[1]
        return 2.0 * out.numel() * w[0].numel()  # each output: Cin/groups x kh x kw multiply-adds
    if name == "convolution_backward":  # grad input + grad weight: twice the forward
        w = args[2]
        return 4.0 * args[0].numel() * w[0].numel()
    raise KeyError(name)


def attention_flops(q: Tensor, k: Tensor, v: Tensor) -> float:
    """Forward FLOPs of softmax(q kᵀ) v for q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv): QKᵀ and PV."""
    b, h, L, d = q.shape
    s, dv = k.shape[-2], v.shape[-1]
    return 2.0 * b * h * L * s * (d + dv)


#: eager CUDA norm kernels (LayerNorm's, which F.rms_norm reuses) give each row a block: a row shorter than
#: this leaves most of a block idle
SHORT_ROW = 128
#: flash attention's backward recomputes QKᵀ: 5 matmuls of the forward's 2
ATTENTION_BACKWARD = 2.5
#: (query rows, key rows) per tile of torch's FlashAttention-2 kernels for head dims 65-96 on sm80/sm90: forward
#: 128 x 64 (``run_mha_fwd_hdim96``), backward 64 x 128 (``run_mha_bwd_hdim96``, >= 116 KB shared memory)
FLASH_FWD_TILE = (128, 64)
FLASH_BWD_TILE = (64, 128)


def flash_padding(q: Tensor, k: Tensor, tile: tuple[int, int]) -> float:
    """Executed / useful FLOPs of a flash attention kernel on q (B, H, L, D), k (B, H, S, D): every tile is
    computed whole, L and S round up to the tile and D up to a multiple of 32 (flash_api's
    ``head_size_rounded`` for D <= 128). SiT-XL/2's 256 tokens fill whole tiles; ViT-5's 260 (4 registers)
    start a partly empty third query tile and fifth key tile: 1.875x the work, head-dim padding aside."""
    L, d, s = q.shape[-2], q.shape[-1], k.shape[-2]

    def up(n: int, m: int) -> int:
        return -(-n // m) * m

    return up(L, tile[0]) * up(s, tile[1]) * up(d, 32) / (L * s * d)


#: the component of the opt-in Triton QK-norm + RoPE op, both directions
FUSED_GROUP = "QK-norm + RoPE (Triton)"


def tail_attention_ops(name: str, args: tuple, outs: list[Tensor], phase: str, group: str, key, stamp: int
                       ) -> list[Op]:
    """The opt-in ``sit_vit5::tail_attention`` op (either direction) as its two kernels: flash attention on the
    ``main x main`` block (at its tiles), and the Triton kernel(s) for the tail rows and columns: FLOPs of their
    16-row dots at the flash rate (head dim padded to a power of 2, as ``BLOCK_D``), bytes of the activations they
    pass over (flash's own outputs among them, which no other op sees: keys -1 to -3)."""
    from sit_vit5.models.tail_attention import MAX_TAIL  # loaded: its op is being traced

    backward = name.endswith("_backward")
    q, k, v = args[1:4] if backward else args[:3]
    main = args[6] if backward else args[3]
    b, h, n, d = q.shape
    qm, km = q[:, :, :main], k[:, :, :main]
    rows, width = MAX_TAIL, 2 ** math.ceil(math.log2(max(d, 16)))  # the kernels' BLOCK_R, BLOCK_D
    tail_flops = 2.0 * b * h * (main * rows + rows * n) * 2 * width  # q·kᵀ and p·v, main rows and tail rows
    size = distinct_bytes(q)
    if backward:
        flash = Op(name, phase, group, "attention", ATTENTION_BACKWARD * attention_flops(qm, km, v[:, :, :main]),
                   padding=flash_padding(qm, km, FLASH_BWD_TILE), stamp=stamp)
        # main rows: q, dO, O, flash's dq -> dq; keys: every k, v and flash's dk, dv -> dk, dv
        reads = [(key(t), distinct_bytes(t)) for t in args[:6]] + [(-i, size) for i in (1, 2, 3)]
        tail = Op(name, phase, group, "attention", 2.5 * tail_flops, reads,
                  [(key(t), distinct_bytes(t)) for t in outs], stamp=stamp)
    else:
        flash = Op(name, phase, group, "attention", attention_flops(qm, km, v[:, :, :main]),
                   padding=flash_padding(qm, km, FLASH_FWD_TILE), stamp=stamp)
        reads = [(key(t), distinct_bytes(t)) for t in (q, k, v)] + [(-1, size)]  # flash's output
        tail = Op(name, phase, group, "attention", tail_flops, reads, [(key(t), distinct_bytes(t)) for t in outs],
                  stamp=stamp)
    return [flash, tail]


def classify(module: str, frames: list[tuple[str, str]], func: str) -> str:
    """The component a torch call belongs to, from the module path (``blocks.3.attn.q_norm``), the model
    frames on the stack (innermost last: (qualname, source line)) and the torch function's name."""
    names = [q for q, _ in frames]
    line = frames[-1][1] if frames else ""
    if "qk_norm_rope" in names:  # the GPU path's fused QK-norm + RoPE: the norm, then the weight and rotation
        return "QK-norm" if func == "rms_norm" else "RoPE"
    if any(q.startswith(("Rotation.", "RopeTables.")) or q in ("swap_pairs", "rotate_half") for q in names):
        return "RoPE"
    if module.endswith(("q_norm", "k_norm")):
        return "QK-norm"
    if module.endswith(("norm1", "norm2", "norm_final")):
        return "block norm"
    if ".attn" in module:  # qkv and proj included
        return "attention"
    if ".mlp" in module:
        return "MLP"
    if "adaLN_modulation" in module or "modulate" in names:
        return "adaLN"
    if "gated_residual" in names:
        return "gate + residual"
    if names and names[-1] == "Block.forward":
        return "LayerScale" if "gamma" in line else "gate + residual"
    if "register" in line:
        return "registers"
    if module.startswith(("x_embedder", "t_embedder", "y_embedder")) or "pos_embed" in line:
        return "embedding"
    if module.startswith("final_layer") or "unpatchify" in " ".join(names) or "final_layer" in line:
        return "final layer"
    return "loss, CFG, other"


class _Recorder(TorchDispatchMode):
    """Records every aten op below autograd (forward and backward) as an :class:`Op`."""

    def __init__(self, labeler: _Labeler, params: set[int]) -> None:
        super().__init__()
        self.labeler, self.params = labeler, params
        self.ops: list[Op] = []
        self.calls: dict[str, int] = defaultdict(int)  # every aten op, views included, by direction
        self.keys: dict[StorageWeakRef, int] = {}
        self.alive: list[Tensor] = []  # keeps every storage alive: a freed key must not be reused

    def key(self, t: Tensor) -> int:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in self.keys:
            self.keys[ref] = len(self.keys)
            self.alive.append(t)
        return self.keys[ref]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls["bwd" if torch._C._current_autograd_node() is not None else "fwd"] += 1
        name = func.__name__.split(".")[0]
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if name in NO_KERNEL or func.namespace == "prim" or not outs:
            return out
        in_keys = {self.key(t) for t in ins}
        if not func._schema.is_mutable and all(self.key(t) in in_keys for t in outs):
            return out  # a view: no kernel
        node = torch._C._current_autograd_node()
        if node is None:
            phase, (group, region) = "fwd", self.labeler.current
        else:
            phase, (group, region) = "bwd", self.labeler.tags.get(node, ("loss, CFG, other", None))
        kind, flops, padding = "memory", 0.0, 1.0
        if name in MATMULS:
            kind, flops = "matmul", matmul_flops(name, args, out)
        elif "scaled_dot_product" in name:
            kind = "attention"
            if name.endswith("_backward"):  # (grad_out, q, k, v, ...)
                flops = ATTENTION_BACKWARD * attention_flops(args[1], args[2], args[3])
                padding = flash_padding(args[1], args[2], FLASH_BWD_TILE)
            else:
                flops = attention_flops(args[0], args[1], args[2])
                padding = flash_padding(args[0], args[1], FLASH_FWD_TILE)
        elif name in ("qkv_norm_rope", "qkv_norm_rope_backward"):  # the opt-in Triton op (fused_qk.py)
            group = FUSED_GROUP
        elif name in ("tail_attention", "tail_attention_backward"):  # the opt-in split (tail_attention.py)
            self.ops += tail_attention_ops(name, args, outs, phase, group, self.key, self.labeler.calls)
            return out
        elif name in ("_to_copy", "copy_") and outs[0].dtype != ins[-1].dtype:
            src = ins[-1]
            weight = id(src) in self.params or (node is not None and any(
                type(n).__name__ == "AccumulateGrad" for n, _ in node.next_functions if n is not None))
            group = "weight casts" if weight else "fp32 casts"
        self.ops.append(Op(name, phase, group, kind, flops,
                           [(self.key(t), distinct_bytes(t)) for t in ins],
                           [(self.key(t), distinct_bytes(t)) for t in outs], region, self.labeler.calls,
                           ins[0].shape[-1] if ins and ins[0].dim() else 1, padding))
        return out


class _Labeler(TorchFunctionMode):
    """Labels each torch call with its component (:func:`classify`) and tags the autograd nodes it creates
    with that label, which the backward's ops inherit."""

    def __init__(self, module_names: dict[int, str]) -> None:
        super().__init__()
        self.module_names = module_names
        self.stack: list[str] = []  # module paths, innermost last
        self.current: tuple[str, int | None] = ("loss, CFG, other", None)
        self.tags: dict[object, tuple[str, int | None]] = {}
        self.regions = 0
        self.calls = 0  # torch calls from Python (the forward's host work)

    def frames(self) -> list[tuple[str, str]]:
        f, found = sys._getframe(2), []
        while f is not None:
            if f.f_code.co_filename.startswith(PACKAGE):
                found.append((f.f_code.co_qualname, linecache.getline(f.f_code.co_filename, f.f_lineno)))
            f = f.f_back
        return found[::-1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("__get__", "__set__"):  # a tensor attribute (x.dtype, p.grad = None): C, no dispatch
            return func(*args, **(kwargs or {}))
        label = classify(self.stack[-1] if self.stack else "", self.frames(), name)
        self.calls += 1
        region = None
        if func is F.rms_norm:  # CUDA: one fused kernel forward, one backward (CPU traces the composite)
            region = self.regions = self.regions + 1
        previous, self.current = self.current, (label, region)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.current = previous
        todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, Tensor) and t.grad_fn is not None]
        while todo:  # every node this call created: the walk stops at nodes of earlier calls
            node = todo.pop()
            if node is None or node in self.tags:
                continue
            self.tags[node] = (label, region)
            todo.extend(n for n, _ in node.next_functions)
        return out

    @contextmanager
    def modules(self) -> Iterator[None]:
        """Track the module path of the running forward (global module hooks)."""

        def pre(module: nn.Module, _args: object) -> None:
            self.stack.append(self.module_names.get(id(module), type(module).__name__))

        def post(_module: nn.Module, _args: object, _out: object) -> None:
            self.stack.pop()

        hooks = (nn.modules.module.register_module_forward_pre_hook(pre),
                 nn.modules.module.register_module_forward_hook(post))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def build_fake(backbone: str, size: str, package: str = "sit_vit5", **overrides) -> nn.Module:
    """The model with fake (shape-only) weights: call inside FakeTensorMode. Initialisation is skipped: it
    reads values (``trunc_normal_``), and a cost does not depend on them. ``package``: the models' package
    (``sit_vit5_ref``: the code at an earlier commit, :func:`import_ref`)."""
    models = importlib.import_module(f"{package}.models")
    sit = importlib.import_module(f"{package}.models.sit").SiT

    with mock.patch.object(sit, "initialize_weights", lambda self: None):
        return models.create_model(f"{backbone}-{size}/2", **overrides)


def trace(backbone: str, size: str = "XL", batch: int = 32, train: bool = True, cfg: bool = True,
          package: str = "sit_vit5", fused: bool = False, tail: bool = False, **overrides) -> Trace:
    """Trace one bf16-autocast step on fake CPU tensors along the GPU's code path.

    ``train``: transport loss (Linear, velocity) forward + backward on latents (batch, 4, s, s), s =
    ``input_size`` (default 32); otherwise one Euler-Maruyama SDE step of ``Sampler.sample_sde`` with CFG
    4.0 (``cfg``): the model on the doubled batch (2·batch) under ``torch.no_grad``, the CFG mix, the
    step. ``fused``: ViT-5's QK-norm + RoPE as the opt-in Triton op (``kernels.fused_qk``: one op each
    way, its bytes in and out). ``overrides``: create_model keywords (switches,
    depth, input_size ...). A warm-up call runs untraced first (it builds the RoPE tables once, as on a GPU).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sit_vit5.guidance import ClassifierFreeGuidance
    from sit_vit5.transport import Sampler, create_transport

    flops = importlib.import_module(f"{package}.models").flops
    kernels_module = importlib.import_module(f"{package}.models.kernels")
    generic_path = kernels_module.generic_path
    fused_qk = kernels_module.fused_qk if fused else lambda: contextlib.nullcontext()
    tail_attention = kernels_module.tail_attention if tail else lambda: contextlib.nullcontext()

    num_classes = overrides.get("num_classes", 1000)
    side = overrides.get("input_size", 32)
    transport = create_transport()
    # one Euler-Maruyama step of the bench's SDE (2 grid points, no last step): 1 NFE; its host-side time
    # grid is built here, outside the fake mode
    sde = Sampler(transport).sample_sde(num_steps=2, last_step=None)
    with FakeTensorMode(), generic_path(), fused_qk(), tail_attention():
        model = build_fake(backbone, size, package, **overrides).train(train)
        macs = float(flops(model)) * 1e9  # flops() is GFLOPs (multiply-adds) per image
        params = [p for p in model.parameters() if p.requires_grad]
        x = torch.randn(batch, model.in_channels, side, side)
        y = torch.randint(0, num_classes, (batch,))

        def model_fn(xt: Tensor, t: Tensor, labels: Tensor) -> Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(xt, t, labels).float()

        guided = ClassifierFreeGuidance(model_fn, 4.0 if cfg else 1.0, null_class=num_classes)
        guided.checked = True  # its first-call check reads values

        def step() -> None:
            if train:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = transport.training_losses(model, x, dict(y=y))["loss"].mean()
                loss.backward()
                for p in params:
                    p.grad = None
            else:
                sde(x, guided, y=y)

        step()
        labeler = _Labeler({id(m): n for n, m in model.named_modules()})
        recorder = _Recorder(labeler, {id(p) for p in model.parameters()})
        with labeler.modules(), labeler, recorder:
            step()
    name = f"{backbone}-{size}/2 {'train' if train else 'sample'} b{batch}"
    calls = dict(python=labeler.calls, **{f"aten_{k}": v for k, v in recorder.calls.items()})
    return Trace(name, recorder.ops, sum(p.numel() for p in params), len(params), macs, batch, train, calls)


# ----------------------------------------------------------------------------------------------- kernels


@dataclass
class Kernel:
    """One GPU kernel of the model: the FLOPs it executes (tile padding included), bytes moved, kind and
    component."""

    group: str
    kind: str
    flops: float
    bytes: float
    phase: str
    ops: int = 1  # aten ops it runs (> 1: fused)
    stamp: int = 0  # Python torch calls made before it launches (its last op's)
    short_rows: bool = False  # an eager norm over rows shorter than SHORT_ROW (QK-norm: head dim 72)
    shares: dict[str, float] | None = None  # fused: each member component's fraction (of unfused bytes)


def readers(ops: list[Op]) -> dict[int, list[int]]:
    """Storage key -> indices of the ops that read it."""
    found: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        for k, _ in op.reads:
            found[k].append(i)
    return found


def backward_reads(ops: list[Op]) -> set[int]:
    """Storage keys the backward reads."""
    return {k for op in ops if op.phase == "bwd" for k, _ in op.reads}


#: aten ops AOTAutograd's min-cut partitioner may recompute in the backward instead of saving them (those of
#: its default allowlist, ``torch._functorch.partitioners.get_default_op_list``, that the traces run): pointwise
#: ops, casts and copies; reductions among them only when their output is at least 1/4 of their input
#: (``ban_recompute_reductions``). Not in it: native_layer_norm, cat, stack, embedding, padding, random draws.
RECOMPUTABLE = frozenset({"_to_copy", "add", "add_", "addcmul", "arange", "clone", "cos", "div", "exp", "gelu",
                          "lt", "mean", "mul", "neg", "pow", "rsqrt", "rsub", "scalar_tensor", "silu", "sin", "sub",
                          "sum", "where"})


def recomputable(op: Op) -> bool:
    """Whether the partitioner may recompute ``op`` in the backward: in its allowlist and not a reduction."""
    return op.name in RECOMPUTABLE and 4 * sum(b for _, b in op.writes) >= sum(b for _, b in op.reads)


def rematerialize(ops: list[Op], runs: list[list[int]]) -> list[Op]:
    """The ops with the compiled backward's reads as AOTAutograd's partitioner arranges them (training).

    A forward chain (one fused kernel) writes out what the backward reads of its products. Where recomputing
    those products from what they derive from (the chain's inputs, and its products that are saved anyway:
    read by the forward outside the chain or by a backward matmul, or not recomputable) saves fewer bytes
    than saving them, the backward reads those sources instead and recomputes inside its own fused kernels:
    a per-chain form of the partitioner's min cut (the bytes saved between the passes). Checked against its
    choices on small models in tests/test_cost_model.py."""
    read_by, read_back, out = readers(ops), backward_reads(ops), list(ops)
    for run in runs:
        if ops[run[0]].phase != "fwd" or ops[run[0]].kind != "memory":
            continue
        inside = set(run)
        made = {k: i for i in run for k, _ in ops[i].writes}  # product -> its (last) writer in the chain
        kept = {k for k, i in made.items() if not recomputable(ops[i]) or any(
            (ops[j].phase == "fwd" and j not in inside) or (ops[j].phase == "bwd" and ops[j].kind != "memory")
            for j in read_by.get(k, []))}
        saved = {k: b for i in run for k, b in ops[i].writes if k in read_back and k not in kept}
        if not saved:
            continue
        sources, todo, seen = {}, [made[k] for k in saved], set()
        while todo:
            i = todo.pop()
            if i not in seen:
                seen.add(i)
                for k, b in ops[i].reads:
                    if k in made and made[k] < i and k not in kept:
                        todo.append(made[k])
                    else:
                        sources[k] = b
        if sum(b for k, b in sources.items() if k not in read_back) >= sum(saved.values()):
            continue  # saving the products is cheaper
        for j in {j for k in saved for j in read_by[k] if ops[j].phase == "bwd"}:
            out[j] = replace(out[j], reads=[r for r in out[j].reads if r[0] not in saved] + list(sources.items()))
    return out


def fused_kernel(ops: list[Op], members: list[int], read_by: dict[int, list[int]]) -> Kernel:
    """One kernel running ``ops[members]``: it reads the tensors they read that none of them wrote, and writes
    those they wrote that an op outside reads, or that nothing reads (gradients, the loss); each once."""
    inside = set(members)
    written: dict[int, int] = {}
    reads: dict[int, int] = {}
    for i in members:
        for k, b in ops[i].reads:
            if k not in written:
                reads[k] = max(reads.get(k, 0), b)
        for k, b in ops[i].writes:
            written[k] = max(written.get(k, 0), b)
    writes = {k: b for k, b in written.items()
              if not read_by.get(k) or any(j not in inside for j in read_by[k])}
    groups: dict[str, float] = defaultdict(float)  # its time is split in proportion to unfused bytes
    for i in members:
        groups[ops[i].group] += ops[i].bytes + 1e-9
    total = sum(groups.values())
    first = ops[members[0]]
    return Kernel(max(groups, key=groups.get), first.kind, sum(ops[i].flops * ops[i].padding for i in members),
                  sum(reads.values()) + sum(writes.values()), first.phase, len(members),
                  stamp=max(ops[i].stamp for i in members),
                  short_rows=first.region is not None and first.row < SHORT_ROW,
                  shares={g: b / total for g, b in groups.items()} if len(groups) > 1 else None)


def chains(ops: list[Op]) -> list[list[int]]:
    """Inductor-like fusion: each matmul/attention op alone, and every maximal run of memory ops between them
    (within one direction) as one kernel; lists of op indices, in order."""
    runs: list[list[int]] = []
    chain: list[int] = []
    for i, op in enumerate(ops):
        if chain and (op.kind != "memory" or op.phase != ops[chain[-1]].phase):
            runs.append(chain)
            chain = []
        if op.kind == "memory":
            chain.append(i)
        else:
            runs.append([i])
    if chain:
        runs.append(chain)
    return runs


def saved_bytes(ops: list[Op]) -> int:
    """Bytes the forward writes that the backward reads (activations saved between the passes)."""
    read_back = backward_reads(ops)
    written = {k: b for op in ops if op.phase == "fwd" for k, b in op.writes}
    return sum(b for k, b in written.items() if k in read_back)


def kernels(tr: Trace, mode: str = "eager") -> list[Kernel]:
    """The step's GPU kernels. eager: one per op, each ``F.rms_norm`` call one per direction. compile:
    :func:`chains`, the backward reading what :func:`rematerialize` leaves saved (training)."""
    ops, read_by = tr.ops, readers(tr.ops)
    runs: list[list[int]] = []
    if mode == "eager":
        regions: dict[tuple[int, str], list[int]] = {}
        for i, op in enumerate(ops):
            if op.region is not None and op.kind == "memory":
                key = (op.region, op.phase)
                if key not in regions:
                    regions[key] = []
                    runs.append(regions[key])
                regions[key].append(i)
            else:
                runs.append([i])
    elif mode == "compile":
        runs = chains(ops)
        if tr.train:
            ops = rematerialize(ops, runs)
            read_by = readers(ops)
    else:
        raise ValueError(f"mode {mode!r}: eager or compile")
    ks = [fused_kernel(ops, run, read_by) for run in runs]
    if mode == "compile":  # Inductor generates its own (persistent) reductions for short rows
        for k in ks:
            k.short_rows = False
    return ks


CLIP = "grad clip"


def optimizer_kernels(tr: Trace, optimizer: str = "foreach", ema: bool = False, clip: bool = False
                      ) -> list[Kernel]:
    """AdamW (weight decay 0, as the bench), optionally gradient clipping before it and the EMA update after
    it, as bytes and kernel counts.

    foreach (torch's CUDA default): lerp_(m, g) 12 B, mul_(v) 8, addcmul_(v, g, g) 12, sqrt(v) 8, div_ 8,
    add_(eps) 8, addcdiv_(p, m, d) 16 = 72 B per fp32 parameter; one launch per 320 chunks of 65536 elements
    (``multi_tensor_apply``). fused: one pass reading p, g, m, v and writing p, m, v: 28 B. ``clip``: torch's
    ``clip_grad_norm_``, a foreach norm of the gradients (4 B) and their scaling, which it always applies (8 B).
    """
    chunks = tr.params / 65536 + tr.param_tensors / 2  # the last chunk of each tensor is partial
    launches = max(1, math.ceil(chunks / 320))
    passes = {"foreach": [12, 8, 12, 8, 8, 8, 16], "fused": [28], "none": []}[optimizer]
    out = [Kernel(CLIP, "memory", 0.0, b * tr.params, "opt", launches) for b in ((4, 8) if clip else ())]
    out += [Kernel("optimizer (AdamW)", "memory", 0.0, b * tr.params, "opt", launches) for b in passes]
    if ema:
        out += [Kernel("EMA", "memory", 0.0, b * tr.params, "opt", launches) for b in (8, 12)]
    return out


# ----------------------------------------------------------------------------------------------- time


def kernel_time(k: Kernel, dev: Device, eff: Efficiency) -> float:
    """Seconds of one kernel (launch excluded): the slower of its FLOPs and its bytes at achievable rates."""
    rate = {"matmul": eff.matmul, "attention": eff.attention, "memory": 1.0}[k.kind] * dev.peak_flops
    memory = eff.short_rows if k.short_rows else eff.memory
    return max(k.flops / rate, k.bytes / (dev.bandwidth * memory))


@dataclass
class Prediction:
    """Predicted seconds of one step: ``device`` (Σ kernel times), ``host`` (Python calls and launches),
    ``seconds`` (the step), ``groups[name] = (seconds, kernels)`` (device time by component, plus
    "host-bound" for the time the GPU waits on the host), ``kinds`` (device seconds by kernel kind)."""

    seconds: float
    device: float
    host: float
    kernels: int
    groups: dict[str, tuple[float, int]]
    kinds: dict[str, float]

    def ms(self) -> float:
        return self.seconds * 1e3


def cached_kernels(tr: Trace, mode: str) -> list[Kernel]:
    """:func:`kernels`, computed once per trace and mode."""
    if mode not in tr.cache:
        tr.cache[mode] = kernels(tr, mode)
    return tr.cache[mode]


def predict(tr: Trace, mode: str = "eager", dev: Device = DEVICES["H200"], eff: Efficiency = FITTED,
            optimizer: str = "foreach", ema: bool = False, nfe_sync: bool = False, clip: bool = False,
            loop_sync: bool = False) -> Prediction:
    """The step time of ``tr`` on ``dev``.

    Device time: Σ_kernel max(FLOPs / (peak·e), bytes / (bandwidth·e_mem)) over the model's kernels
    (training: and the optimizer's). Host time: ``python_us`` per Python torch call (eager forward) and
    ``launch_us`` per kernel the engine / foreach / Inductor launches. With no sync the host runs ahead of
    the GPU: ``max(device, host)`` (training, and sampling since the SDE's noise and times stopped blocking:
    tests/test_fake_cuda.py). ``nfe_sync``: each NFE starts from an idle GPU, as in the measured code
    (:data:`NFE_SYNC_MEASURED`), so the GPU waits wherever the host falls behind: ``max_k (host until kernel
    k launches + device time from k on)``. ``loop_sync``: the same for a training step that reads the loss
    and the gradient norm before its optimizer step, as ``training/loop.py`` does: from that read to the next
    one the host launches the optimizer (and ``ema``), the next forward and backward, and ``clip``.
    """
    model = cached_kernels(tr, mode)
    opt = optimizer_kernels(tr, optimizer, ema, clip) if tr.train else []
    lead = [k for k in opt if k.group != CLIP] if loop_sync else []  # launched right after the read
    ks = lead + model + ([k for k in opt if k.group == CLIP] if loop_sync else opt)
    times = [kernel_time(k, dev, eff) for k in ks]
    launch, py = eff.launch_us * 1e-6, eff.python_us * 1e-6
    host, starts, offset = 0.0, [], 0.0
    for i, k in enumerate(ks):  # when each kernel is launched
        if i == len(lead):
            offset = host  # the forward's Python starts after the lead's launches
        if i < len(lead):
            host += launch * _launches(k)
        elif mode == "eager" and k.phase == "fwd":
            host = max(host, offset + py * k.stamp)
        else:
            host = max(host, offset + py * tr.host_calls.get("python", 0)) if mode == "eager" else host
            host += launch * _launches(k)
        starts.append(host)
    device = sum(times)
    if (loop_sync if tr.train else nfe_sync):
        seconds, tail = 0.0, 0.0
        for start, t in zip(reversed(starts), reversed(times)):
            tail += t
            seconds = max(seconds, start + tail)
    else:
        seconds = max(device, host)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kinds: dict[str, float] = defaultdict(float)
    for k, t in zip(ks, times):
        for name, share in (k.shares or {k.group: 1.0}).items():
            g = groups[name]
            g[0] += share * t
            g[1] += share * _launches(k)
        kinds[k.kind] += t
    if seconds > device:
        groups["host-bound (GPU idle)"] = [seconds - device, 0]
    return Prediction(seconds, device, host, sum(_launches(k) for k in ks),
                      {n: (g[0], round(g[1])) for n, g in groups.items()}, dict(kinds))


def _launches(k: Kernel) -> int:
    """Launches of a kernel: 1 for a model kernel, the multi_tensor_apply launches for an optimizer pass."""
    return k.ops if k.phase == "opt" else 1


# ----------------------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Target:
    """One measured H200 number (results/bench/h200): ms per step (train) or per NFE (sample)."""

    name: str
    backbone: str
    train: bool
    mode: str
    batch: int
    ms: float
    source: str


TARGETS = (
    Target("SiT train eager b32", "SiT", True, "eager", 32, 92.22, "xl_eager.json"),
    Target("ViT5 train eager b32", "ViT5", True, "eager", 32, 127.99, "xl_eager.json"),
    Target("SiT train eager b64", "SiT", True, "eager", 64, 157.96, "xl_eager.json"),
    Target("ViT5 train eager b64", "ViT5", True, "eager", 64, 224.02, "xl_eager.json"),
    Target("SiT train compiled b32", "SiT", True, "compile", 32, 75.43, "xl_compile.json"),
    Target("ViT5 train compiled b32", "ViT5", True, "compile", 32, 95.99, "xl_compile.json"),
    Target("SiT sample per NFE (CFG, 2x32)", "SiT", False, "eager", 32, 51.28, "sample.json"),
    Target("ViT5 sample per NFE (CFG, 2x32)", "ViT5", False, "eager", 32, 82.61, "sample.json"),
)
#: the measured ratios ViT5 / SiT (medians of per-round ratios in the JSON; within 0.005 of the ms ratios)
RATIOS = {"train eager b32": 1.388, "train eager b64": 1.424, "train compiled b32": 1.257, "sample": 1.611}


def target_traces(size: str = "XL", **overrides) -> dict[tuple[str, bool, int], Trace]:
    """The traces the targets need: each backbone's train step at batch 32 and 64 and its sampling call."""
    out = {}
    for backbone in ("SiT", "ViT5"):
        for batch in (32, 64):
            out[backbone, True, batch] = trace(backbone, size, batch, train=True, **overrides)
        out[backbone, False, 32] = trace(backbone, size, 32, train=False, **overrides)
    return out


#: the measured code's SDE drew its noise and times with blocking host-to-device copies (a stream sync per
#: NFE; removed after, see :func:`predict`)
NFE_SYNC_MEASURED = True


def calibration_rows(traces: dict, dev: Device = DEVICES["H200"], eff: Efficiency = FITTED,
                     nfe_sync: bool = NFE_SYNC_MEASURED) -> list[dict]:
    """Measured against predicted for every target, then the four ViT5 / SiT ratios; ``nfe_sync``: whether
    the traced code's sampler syncs every NFE (the measured code did; the current code does not)."""
    rows, pred = [], {}
    for t in TARGETS:
        p = predict(traces[t.backbone, t.train, t.batch], t.mode, dev, eff, nfe_sync=nfe_sync).ms()
        pred[t.name] = p
        rows.append(dict(row=t.name, measured=t.ms, predicted=p, error=p / t.ms - 1))
    pairs = {"train eager b32": ("train eager b32",), "train eager b64": ("train eager b64",),
             "train compiled b32": ("train compiled b32",), "sample": ("sample per NFE (CFG, 2x32)",)}
    for ratio, (suffix,) in pairs.items():
        p = pred[f"ViT5 {suffix}"] / pred[f"SiT {suffix}"]
        rows.append(dict(row=f"ratio ViT5/SiT {ratio}", measured=RATIOS[ratio], predicted=p,
                         error=p - RATIOS[ratio]))
    return rows


#: the constants --fit adjusts (the others keep FITTED's values)
FREE = ("matmul", "attention", "memory", "short_rows", "python_us", "launch_us")
#: upper bounds of the fitted fractions (others: 1): an assumption, not a measurement. cuBLAS's best bf16 GEMMs
#: on H100-class cards run at roughly 70-80 % of the dense peak; unbounded, the fit trades the matmuls (-> 1.0)
#: against flash attention, which the 8 times do not separate
CEILING = {"matmul": 0.75}


def fit(traces: dict, dev: Device = DEVICES["H200"], free: tuple[str, ...] = FREE,
        start: Efficiency = FITTED) -> tuple[Efficiency, float]:
    """Least squares on log(predicted / measured) over the 8 targets, adjusting the constants ``free``
    (Nelder-Mead, fractions clipped to [0.05, ``CEILING``]); returns the constants and the rms relative error."""
    from scipy.optimize import minimize

    def unpack(v) -> Efficiency:
        vals = {}
        for name, x in zip(free, v):
            vals[name] = float(max(x, 0.0)) if name.endswith("_us") else float(min(max(x, 0.05),
                                                                                     CEILING.get(name, 1.0)))
        return replace(start, **vals)

    def loss(v) -> float:
        eff = unpack(v)
        return sum(math.log(predict(traces[t.backbone, t.train, t.batch], t.mode, dev, eff,
                                    nfe_sync=NFE_SYNC_MEASURED).ms() / t.ms) ** 2 for t in TARGETS)

    res = minimize(loss, [getattr(start, n) for n in free], method="Nelder-Mead",
                   options=dict(xatol=1e-4, fatol=1e-9, maxiter=4000))
    return unpack(res.x), math.sqrt(res.fun / len(TARGETS))


def excess(vit5: Prediction, sit: Prediction) -> list[dict]:
    """ViT5's predicted time minus SiT's, per component, with each one's share of the total excess."""
    total = vit5.seconds - sit.seconds
    rows = []
    for g in sorted(set(vit5.groups) | set(sit.groups)):
        a, b = vit5.groups.get(g, (0.0, 0)), sit.groups.get(g, (0.0, 0))
        rows.append(dict(component=g, vit5_ms=a[0] * 1e3, sit_ms=b[0] * 1e3, excess_ms=(a[0] - b[0]) * 1e3,
                         share=(a[0] - b[0]) / total, kernels=a[1] - b[1]))
    return sorted(rows, key=lambda r: -r["excess_ms"])


def mfu(tr: Trace, p: Prediction, dev: Device) -> float:
    """Model FLOP utilisation as the bench counts it: batch x 6 x forward multiply-adds / time / peak."""
    per_image = (6 if tr.train else 2) * tr.fwd_macs
    return tr.batch * (1 if tr.train else 2) * per_image / p.seconds / dev.peak_flops


def breakdown(p: Prediction) -> list[dict]:
    """A prediction's components, largest first, with shares."""
    return sorted((dict(component=g, ms=t * 1e3, share=t / p.seconds, kernels=n) for g, (t, n) in p.groups.items()),
                  key=lambda r: -r["ms"])


#: ViT5 with one component switched back to SiT's: bench.vit5_overhead's --ablate variants
def ablations() -> dict[str, dict]:
    from bench.vit5_overhead import ABLATIONS

    return ABLATIONS


def ablation_predictions(size: str = "XL", batch: int = 32, dev: Device = DEVICES["H200"],
                         eff: Efficiency = FITTED, **overrides) -> list[dict]:
    """Predicted train-step ms of SiT, ViT5 and each ablated ViT5, eager and compiled (bf16, AdamW foreach)."""
    rows = []
    variants = {"SiT": ("SiT", {}), "ViT5": ("ViT5", {})}
    variants.update({f"ViT5{k}": ("ViT5", kw) for k, kw in ablations().items()})
    for name, (backbone, kw) in variants.items():
        tr = trace(backbone, size, batch, train=True, **{**overrides, **kw})
        rows.append(dict(variant=name, eager_ms=predict(tr, "eager", dev, eff).ms(),
                         compile_ms=predict(tr, "compile", dev, eff).ms()))
    sit = rows[0]
    for r in rows:
        r["eager_ratio"], r["compile_ratio"] = r["eager_ms"] / sit["eager_ms"], r["compile_ms"] / sit["compile_ms"]
    return rows


def kernel_predictions(traces: dict, dev: Device = DEVICES["H200"], eff: Efficiency = FITTED) -> dict:
    """ViT5 / SiT with the opt-in kernels: the Triton QK-norm + RoPE (``fused``; eager only: compiled code keeps
    the torch ops, which Inductor fuses), the tail attention (``tail``), both; and the eager b32 excess with both."""
    rows, traced = [], {}  # (train, batch, variant) -> trace: the compiled rows reuse the eager rows'
    cases = {"train eager b32": (True, 32, "eager"), "train eager b64": (True, 64, "eager"),
             "train compiled b32": (True, 32, "compile"), "sample": (False, 32, "eager"),
             "sample compiled": (False, 32, "compile")}
    for key, (train, batch, mode) in cases.items():
        sit = predict(traces["SiT", train, batch], mode, dev, eff)
        ratio = {}
        for name, kw in (("torch_ops", {}), ("fused", dict(fused=True)), ("tail", dict(tail=True)),
                         ("both", dict(fused=True, tail=True))):
            if mode == "compile" and kw.get("fused"):  # compiled code keeps the torch ops: the same step
                ratio[name] = ratio["tail" if kw.get("tail") else "torch_ops"]
                continue
            if not kw:
                traced[train, batch, name] = traces["ViT5", train, batch]
            elif (train, batch, name) not in traced:
                traced[train, batch, name] = trace("ViT5", "XL", batch, train=train, **kw)
            pred = predict(traced[train, batch, name], mode, dev, eff)
            ratio[name] = pred.seconds / sit.seconds
            if key == "train eager b32" and name == "both":
                excess_b32 = excess(pred, sit)
        rows.append(dict(row=key, sit_ms=sit.ms(), **ratio))
    return dict(rows=rows, excess_b32=excess_b32)


def what_if_sit(traces: dict, dev: Device = DEVICES["H200"], eff: Efficiency = FITTED) -> list[dict]:
    """SiT-XL/2's predicted MFU as the known costs are removed one after another (batch 32, then 64)."""
    fast_attention = replace(eff, attention=2 * eff.attention)
    steps = [("eager (measured: 25.0 %)", "eager", "foreach", eff, 32),
             ("compiled (measured: 30.5 %)", "compile", "foreach", eff, 32),
             ("compiled + AdamW fused=True", "compile", "fused", eff, 32),
             # FlashAttention-3 reports 1.5-2.0x FA2's speed on H100 (Shah et al. 2024): a Hopper attention kernel
             ("... + attention at 2x the fitted rate", "compile", "fused", fast_attention, 32),
             ("... + GEMMs at 80 % of peak", "compile", "fused", replace(fast_attention, matmul=0.80), 32),
             # the optimizer's fixed passes over 675M parameters, once per 64 images (or 2 accumulation steps)
             ("compiled + AdamW fused=True, batch 64", "compile", "fused", eff, 64),
             ("... + attention at 2x the fitted rate", "compile", "fused", fast_attention, 64),
             ("... + GEMMs at 80 % of peak", "compile", "fused", replace(fast_attention, matmul=0.80), 64)]
    rows = []
    for name, mode, opt, e, batch in steps:
        tr = traces["SiT", True, batch]
        p = predict(tr, mode, dev, e, optimizer=opt)
        rows.append(dict(setting=name, ms=p.ms(), mfu=mfu(tr, p, dev)))
    return rows


#: training/loop.py on one GPU: clip_grad_norm_, AdamW fused=True (every parameter on CUDA, no FSDP), the EMA
LOOP = dict(optimizer="fused", ema=True, clip=True)


def loop_rows(traces: dict, dev: Device = DEVICES["H200"], eff: Efficiency = FITTED) -> list[dict]:
    """XL/2 batch 32: the bench's step against training/loop.py's, with and without its host reads."""
    settings = [("bench step (AdamW fused, as bench.train_step now; no clipping, EMA or reads)",
                 dict(optimizer="fused")),
                ("training loop (clipping, AdamW fused, EMA), loss and grad-norm read every step",
                 dict(LOOP, loop_sync=True)),
                ("the same loop without the reads", LOOP)]
    rows = []
    for mode in ("eager", "compile"):
        for name, kw in settings:
            sit, vit5 = (predict(traces[b, True, 32], mode, dev, eff, **kw) for b in ("SiT", "ViT5"))
            rows.append(dict(setting=f"{mode}: {name}", sit_ms=sit.ms(), vit5_ms=vit5.ms(),
                             ratio=vit5.seconds / sit.seconds, sit_mfu=mfu(traces["SiT", True, 32], sit, dev)))
    return rows


def import_ref(rev: str) -> str:
    """``sit_vit5`` as of git revision ``rev``, importable as ``sit_vit5_ref`` (bench.before_after's extraction);
    returns the package name. The calibration traces the code the H200 table was measured with."""
    import tempfile

    from bench.before_after import import_ref as extract

    if "sit_vit5_ref" not in sys.modules:
        extract(rev, Path(tempfile.mkdtemp(prefix="cost_model_ref_")))
    return "sit_vit5_ref"


#: the revision whose models' generic path the H200 table measured (unchanged from the 2026-12-04 session
#: to the cost model's commit 13a1e01 and to 10ec938; issue 56 part 2 changed it after)
CALIBRATION_REF = "10ec938"


HOST_SYNCS = ("`sit_vit5/training/loop.py`: `accelerator.reduce(loss).item()` and `float(clip_grad_norm_(...))` run "
              "every step (two host syncs, before the optimizer step, which they guard: a non-finite loss or "
              "gradient norm stops the run before the weights change; `bench.train_step` has neither); "
              "`training/step_report.py` has none. What they cost, predicted:")


def report(dev_name: str = "H200", eff: Efficiency = FITTED, traces: dict | None = None,
           ablate: bool = True, calibration_traces: dict | None = None, calibration_ref: str | None = None) -> dict:
    """Everything the page and the JSON hold: calibration, breakdowns, excess, what-ifs, ablations.

    ``calibration_traces``: traces of the code the H200 times were measured with (``calibration_ref``, a git
    revision; :func:`import_ref`): the calibration rows use them, and the ratios they predict are listed as
    'before' beside the current code's. None: the current traces are calibrated."""
    traces = traces or target_traces()
    dev = DEVICES[dev_name]
    out: dict = dict(device=asdict(dev), constants=asdict(eff), fitted=list(FREE), fit_note=FIT_NOTE,
                     calibration=calibration_rows(calibration_traces or traces, dev, eff),
                     calibration_ref=calibration_ref if calibration_traces else None)
    if calibration_traces:
        before = {r["row"]: r["predicted"] for r in out["calibration"] if r["row"].startswith("ratio")}
        after = {r["row"]: r["predicted"] for r in calibration_rows(traces, dev, eff, nfe_sync=False)
                 if r["row"].startswith("ratio")}
        out["ratios_before_after"] = [dict(row=k, measured=RATIOS[k.removeprefix("ratio ViT5/SiT ")],
                                           before=before[k], after=after[k]) for k in before]
    cases = {"train_eager_b32": (True, "eager", 32), "train_compile_b32": (True, "compile", 32),
             "train_eager_b64": (True, "eager", 64), "sample": (False, "eager", 32),
             "sample_compile": (False, "compile", 32)}
    for key, (train, mode, batch) in cases.items():
        sit, vit5 = (predict(traces[b, train, batch], mode, dev, eff) for b in ("SiT", "ViT5"))
        out[key] = dict(sit_ms=sit.ms(), vit5_ms=vit5.ms(), ratio=vit5.seconds / sit.seconds,
                        sit_device_ms=sit.device * 1e3, sit_host_ms=sit.host * 1e3,
                        vit5_device_ms=vit5.device * 1e3, vit5_host_ms=vit5.host * 1e3,
                        sit_mfu=mfu(traces["SiT", train, batch], sit, dev),
                        excess=excess(vit5, sit), sit_breakdown=breakdown(sit), vit5_kernels=vit5.kernels,
                        sit_kernels=sit.kernels, sit_kinds_ms={k: t * 1e3 for k, t in sit.kinds.items()},
                        vit5_kinds_ms={k: t * 1e3 for k, t in vit5.kinds.items()})
    out["kernels"] = kernel_predictions(traces, dev, eff)
    out["what_if_sit"] = what_if_sit(traces, dev, eff)
    out["host_syncs"] = HOST_SYNCS
    out["loop"] = loop_rows(traces, dev, eff)
    if ablate:
        out["ablations"] = ablation_predictions(dev=dev, eff=eff)
    return out


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    """Markdown table: cols = (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) if f else str(r[k]) for k, _, f in cols) + " |")
    return lines


def markdown(rep: dict) -> str:
    """docs/gpu-cost-model.md from :func:`report`."""
    c = rep["constants"]
    cal = [dict(r, ok=("yes" if (abs(r["error"]) <= 0.05 if r["row"].startswith("ratio") else
                                abs(r["error"]) <= 0.10) else "**no**")) for r in rep["calibration"]]
    lines = [
        "# GPU cost model (issue 56)", "",
        "Generated by `python -m bench.cost_model --write-doc` (do not edit by hand). What it is and how it traces: "
        "the docstring of [bench/cost_model.py](../bench/cost_model.py). In short: one XL/2 bf16 training step "
        "(forward + backward, batch 32 or 64) and one sampling NFE (Euler-Maruyama SDE step, CFG on the doubled batch "
        "2 × 32) of each backbone are traced on fake CPU tensors along the GPU's code path (`kernels.generic_path()`),"
        " every aten op recorded with its shapes; each kernel costs max(FLOPs / (peak · e), bytes / (bandwidth · "
        "e_mem)); the host costs `python_us` per torch call from Python (a tensor attribute read or write is not a "
        "call) and `launch_us` per engine / foreach / Inductor launch; training runs the host ahead (max(device, "
        "host)). In the measured code a sampling NFE started from an idle GPU (the SDE's CPU-generator noise and its "
        "times were blocking host-to-device copies), so its forward waited on the host wherever the host fell behind; "
        "the calibration keeps that. The current sampler makes no host sync per step (tests/test_fake_cuda.py), so its"
        " NFEs are predicted as max(device, host), as training.", "",
        f"Device: {rep['device']['name']}, {rep['device']['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16, "
        f"{rep['device']['bandwidth'] / 1e12:.2f} TB/s (datasheet).", "",
        "## Calibration against the H200 table", "",
        f"**Fitted**: all {len(rep['fitted'])} constants ({', '.join(rep['fitted'])}), by least squares on "
        f"log(predicted / measured) over the 8 measured times below (`--fit`); the 4 ratios are not fitted "
        f"separately, they follow from the 8. {rep['fit_note']}", "",
        *([f"The calibration traces the models as of `{rep['calibration_ref']}` (the code the H200 table "
           "measured; `--calibrate-at`); every section after it predicts the current code.", ""]
          if rep.get("calibration_ref") else []),
        "| constant | value |", "|---|---|",
        *[f"| {k} | {v:g} |" for k, v in c.items()], "",
        *_table(cal, [("row", "row", ""), ("measured", "measured", ".3f"), ("predicted", "predicted", ".3f"),
                      ("error", "error (relative; ratios: absolute)", "+.3f"), ("ok", "within 10 % / 0.05", "")]),
        "",
    ]
    if rep.get("ratios_before_after"):
        lines += ["## ViT5 / SiT ratios: the calibrated code and the current code (predicted)", "",
                  f"'before': the models as of `{rep['calibration_ref']}`; 'after': this commit's (its sampler "
                  "without a sync per NFE). No GPU has measured 'after' yet (the `vit5_ablate` and `sample` stages "
                  "of tools/gpu_session.sh will).", "",
                  *_table(rep["ratios_before_after"], [("row", "ratio", ""), ("measured", "measured (before)", ".3f"),
                                                       ("before", "predicted before", ".3f"),
                                                       ("after", "predicted after", ".3f")]), ""]
    for key, title in (("train_eager_b32", "training step, eager, batch 32"),
                       ("train_compile_b32", "training step, compiled, batch 32"),
                       ("sample", "sampling, one NFE (CFG, 2 × 32)"),
                       ("sample_compile", "sampling, one NFE, compiled forward (`sample.py --compile`)")):
        r = rep[key]
        lines += [f"## ViT-5's excess over SiT: {title}", "",
                  f"Predicted SiT {r['sit_ms']:.1f} ms (device {r['sit_device_ms']:.1f}, host {r['sit_host_ms']:.1f}, "
                  f"{r['sit_kernels']} kernels), ViT5 {r['vit5_ms']:.1f} ms (device {r['vit5_device_ms']:.1f}, host "
                  f"{r['vit5_host_ms']:.1f}, {r['vit5_kernels']} kernels): ratio {r['ratio']:.3f}. Device time by "
                  "component (fused kernels split by their ops' unfused bytes); 'host-bound' is the time the GPU "
                  "waits on the host.", "",
                  *_table([x for x in r["excess"] if abs(x["excess_ms"]) >= 0.05],
                          [("component", "component", ""), ("sit_ms", "SiT ms", ".2f"), ("vit5_ms", "ViT5 ms", ".2f"),
                           ("excess_ms", "excess ms", "+.2f"), ("share", "share of excess", ".0%"),
                           ("kernels", "extra kernels", "+d")]), ""]
    if "kernels" in rep:
        f = rep["kernels"]
        lines += ["## With the opt-in kernels (`SIT_VIT5_FUSED_QK=1`, `SIT_VIT5_TAIL_ATTENTION=1`)", "",
                  "`sit_vit5/models/fused_qk.py`: QK-norm + RoPE, one Triton kernel each way for q and k of a token, "
                  "traced as one op (its bytes in and out); eager only, compiled code keeps the torch ops. "
                  "`sit_vit5/models/tail_attention.py`: flash attention on the 256 patch tokens at their own tiles, "
                  "the 4 registers' rows and columns merged by log-sum-exp in Triton kernels, traced as the flash "
                  "op plus one kernel each way (its 16-row dots and its activation passes). Predicted ViT5 / SiT; "
                  "no GPU has timed either yet (the `vit5_ablate` stage times `ViT5+fused_qk`, `ViT5+tail` and "
                  "`ViT5+both`).", "",
                  *_table(f["rows"], [("row", "ratio", ""), ("sit_ms", "SiT ms", ".1f"),
                                      ("torch_ops", "torch ops", ".3f"), ("fused", "fused QK", ".3f"),
                                      ("tail", "tail attention", ".3f"), ("both", "both", ".3f")]), "",
                  "ViT-5's excess over SiT with both, training step, eager, batch 32:", "",
                  *_table([x for x in f["excess_b32"] if abs(x["excess_ms"]) >= 0.05],
                          [("component", "component", ""), ("sit_ms", "SiT ms", ".2f"), ("vit5_ms", "ViT5 ms", ".2f"),
                           ("excess_ms", "excess ms", "+.2f"), ("share", "share of excess", ".0%"),
                           ("kernels", "extra kernels", "+d")]), ""]
    r, loop = rep["train_eager_b32"], rep["loop"]
    lines += ["## SiT-XL/2 itself: where the step goes (eager, batch 32)", "",
              f"Predicted MFU {r['sit_mfu']:.1%} (measured 25.0 %).", "",
              *_table(r["sit_breakdown"], [("component", "component", ""), ("ms", "ms", ".2f"),
                                           ("share", "share", ".0%"), ("kernels", "kernels", "d")]), "",
              "### What would reach 45 % MFU (predicted)", "",
              *_table(rep["what_if_sit"], [("setting", "setting", ""), ("ms", "ms", ".1f"), ("mfu", "MFU", ".1%")]),
              "", f"Host syncs: {rep['host_syncs']}", "",
              *_table(rep["loop"], [("setting", "XL/2, batch 32", ""), ("sit_ms", "SiT ms", ".1f"),
                                    ("vit5_ms", "ViT5 ms", ".1f"), ("ratio", "ViT5 / SiT", ".3f"),
                                    ("sit_mfu", "SiT MFU", ".1%")]), "",
              f"With fused AdamW (what the bench and the loop build on one GPU since issue 56) both eager steps "
              f"lose the optimizer's passes (SiT {r['sit_ms']:.1f} -> {loop[0]['sit_ms']:.1f} ms, ViT5 "
              f"{r['vit5_ms']:.1f} -> {loop[0]['vit5_ms']:.1f}): about the same milliseconds each, a larger share "
              f"of SiT's step, so the current bench's eager ratio is predicted at {loop[0]['ratio']:.3f}, against "
              f"{r['ratio']:.3f} with the foreach AdamW of the calibration. "
              "After the reads the GPU is idle until the host has launched the optimizer and the next forward: "
              f"eager, the reads cost SiT {loop[1]['sit_ms'] / loop[2]['sit_ms'] - 1:+.0%} and ViT5 "
              f"{loop[1]['vit5_ms'] / loop[2]['vit5_ms'] - 1:+.0%} (how much depends on `python_us`, a fitted "
              f"constant: see 'Identifiability' below); compiled, the launches are few and the reads cost "
              f"{loop[4]['sit_ms'] / loop[5]['sit_ms'] - 1:+.1%} and "
              f"{loop[4]['vit5_ms'] / loop[5]['vit5_ms'] - 1:+.1%}. "
              "Removing them means skipping a non-finite step on the device (fused AdamW's "
              "`found_inf`, an EMA update weighted by the same flag) and raising a step later; not built. The suite "
              "stage `xl_loop` (`bench.train_step --loop`) times the loop's step beside the plain one.", ""]
    host_bound = [name for name, key in (("ViT5's eager step", "train_eager_b32"), ("ViT5's sampling NFE", "sample"))
                  if rep[key]["vit5_host_ms"] > rep[key]["vit5_device_ms"]]

    def share(key: str, component: str) -> str:
        row = next((x for x in rep[key]["excess"] if x["component"] == component), None)
        return f"{row['share']:.0%}" if row else "none"

    ablate = {r["variant"]: r for r in rep.get("ablations", [])}
    no_regs = ablate.get("ViT5-registers")
    eager = rep["train_eager_b32"]
    flash_ms = eager["sit_kinds_ms"].get("attention", 0.0)  # the flash kernels alone (qkv and proj are matmuls)
    lines += [
        "## What the model rests on, and what it misses", "",
        "* **Flash attention's tiles (modelled since 2026-12-07).** ViT-5-XL/2 at 256 px has 256 patch tokens and 4 "
        "registers: 260 tokens. torch's FlashAttention-2 kernel for a head dim of 72 (run as 96) computes whole tiles "
        "of 128 query x 64 key rows forward and 64 x 128 backward (`FLASH_FWD_TILE`, `FLASH_BWD_TILE`), so 260 tokens "
        "run 3 x 5 tiles where SiT's 256 run 2 x 4: 1.875x SiT's attention work for 1.03x its FLOPs. Without this "
        "term the model missed the compiled ratio by -0.20 and the eager ones by -0.06 (rms error 0.06); with it, "
        f"the table above. Attention is now the largest part of ViT-5's excess: {share('train_eager_b32', 'attention')}"
        f" of it eager, {share('train_compile_b32', 'attention')} compiled, {share('sample', 'attention')} in an "
        "eager sampling NFE."
        + " Two GPU tests: the suite's first stage, `attention_tiles` (`bench.attention_tiles`, seconds), times the "
        "flash kernel alone at 256 to 512 tokens with the tiles' predicted ratios beside; and"
        + (f" the ablation row `ViT5-registers`: predicted {no_regs['eager_ratio']:.3f} "
           f"eager and {no_regs['compile_ratio']:.3f} compiled, against {ablate['ViT5']['eager_ratio']:.3f} and "
           f"{ablate['ViT5']['compile_ratio']:.3f} with the registers. If the measured drop is much smaller, the "
           "term is wrong." if no_regs else " the `vit5_ablate` stage's `ViT5-registers` row."),
        "* **What removes it: the tail attention (opt-in, `SIT_VIT5_TAIL_ATTENTION=1`).** Each query's softmax "
        "over the 260 keys splits exactly, by log-sum-exp, into the 256 patch keys and the 4 registers. "
        "`sit_vit5/models/tail_attention.py` runs torch's flash attention on the 256 x 256 block at SiT's tiles "
        "(it returns its log-sum-exp) and one Triton kernel for the register rows and columns and the merge; the "
        "backward is flash's own backward given the merged output and log-sum-exp, plus two Triton kernels. Written "
        "as plain torch ops instead, the merge would add about 20 small ops per block each way, whose host time "
        "outweighs the tiles they save in eager mode. The table 'With the opt-in kernels' above prices it; the "
        "registers ablation bounds what it can gain.",
        "* **The compiled backward's recomputation (modelled since 2026-12-07).** AOTAutograd's min-cut partitioner "
        "saves for the backward what is cheaper to save than to recompute, and recomputes the rest inside the "
        "backward's fused kernels. The model does the same chain by chain (`rematerialize`): pointwise ops and casts "
        "are recomputed from their sources where those are fewer bytes; reductions, `native_layer_norm` and what a "
        "backward matmul reads are saved. tests/test_cost_model.py compares the bytes saved per block with the "
        "partitioner's own choice on small models (hidden 144, 68 tokens, bf16 autocast): SiT +8 %, ViT5 +4 %. "
        "Without the rule the model had ViT-5's compiled QK-norm + RoPE chain write its fp32 intermediates out "
        "(ViT5 +47 %); the partitioner saves the bf16 qkv and recomputes them. Adding it moved the fitted constants "
        "(FIT_NOTE).",
        f"* **Attention's rate.** The fitted `attention` = {c['attention']:.3f} of the dense peak per executed FLOP "
        "(head dim 72 runs as 96, so 3/4 of that per useful FLOP) is low for flash attention, but it is what the 8 "
        "times ask for: every refit puts it between 0.061 and 0.064. Short sequences (2 to 5 key tiles per query "
        "tile) leave the kernel much of its time in prologue and epilogue. The same constant prices SiT's flash "
        f"kernels: {flash_ms:.1f} ms, {flash_ms / eager['sit_ms']:.0%} of its eager step (ViT-5's: "
        f"{eager['vit5_kinds_ms'].get('attention', 0.0):.1f} ms), which makes a faster attention "
        "kernel (FlashAttention-3 or cuDNN's on Hopper) SiT's largest MFU lever after fused AdamW (the table above). "
        "A `torch.profiler` trace of one step would settle it.",
        f"* **Identifiability.** 6 fitted constants for 8 times: the split between host and device is a fit, not a "
        f"measurement. `python_us` = {c['python_us']:.0f} us per torch call is set by the measured code's sampling "
        "NFE (a sync per NFE made its host time show); in the current code it makes "
        f"{' and '.join(host_bound) if host_bound else 'no eager ViT5 row'} host-bound. `matmul` and `launch_us` are "
        "not identified (FIT_NOTE above). Tensor attribute reads and writes (`x.dtype`, `p.grad = None`) are not "
        "counted as calls; counted, ViT-5's eager sampling NFE turns host-bound.", ""]
    if "ablations" in rep:
        lines += ["## Ablations: each ViT-5 component off (predicted, batch 32)", "",
                  "The rows `bench.vit5_overhead --ablate` times on a GPU (suite stage `vit5_ablate`), with these "
                  "predictions printed beside them.", "",
                  *_table(rep["ablations"], [("variant", "variant", ""), ("eager_ms", "eager ms", ".1f"),
                                             ("eager_ratio", "/ SiT", ".3f"), ("compile_ms", "compiled ms", ".1f"),
                                             ("compile_ratio", "/ SiT", ".3f")]), ""]
    return "\n".join(lines)


def print_calibration(rows: list[dict]) -> None:
    print(f"{'row':42s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for r in rows:
        print(f"{r['row']:42s} {r['measured']:9.3f} {r['predicted']:9.3f} {r['error']:+7.3f}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.cost_model", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=sorted(DEVICES), default="H200")
    p.add_argument("--fit", action="store_true", help="refit the constants to TARGETS and use them")
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--write-doc", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    p.add_argument("--no-ablate", action="store_true", help="skip the ablation predictions (7 more traces)")
    p.add_argument("--calibrate-at", default=CALIBRATION_REF, metavar="REV",
                   help="git revision whose models the calibration (and --fit) traces: the code the H200 table "
                        "measured; 'none': the current code")
    args = p.parse_args(argv)
    traces = target_traces()
    ref = None if args.calibrate_at == "none" else args.calibrate_at
    calib = target_traces(package=import_ref(ref)) if ref else None
    eff = FITTED
    if args.fit:
        eff, rms = fit(calib or traces)
        print(f"fit ({len(FREE)} constants, {len(TARGETS)} targets): {eff}, rms log error {rms:.4f}")
    rep = report(args.device, eff, traces, ablate=not args.no_ablate, calibration_traces=calib,
                 calibration_ref=ref)
    print_calibration(rep["calibration"])
    for r in rep.get("ratios_before_after", []):
        print(f"{r['row']:42s} measured {r['measured']:.3f}  predicted before {r['before']:.3f}  "
              f"after {r['after']:.3f}")
    for key in ("train_eager_b32", "train_compile_b32", "sample", "sample_compile"):
        print(f"\nViT5 excess, {key}: ratio {rep[key]['ratio']:.3f}")
        for r in rep[key]["excess"][:8]:
            print(f"  {r['component']:24s} {r['excess_ms']:+8.2f} ms  {r['share']:6.1%}")
    print(f"\nSiT eager b32 predicted MFU {rep['train_eager_b32']['sit_mfu']:.1%}")
    for r in rep["what_if_sit"]:
        print(f"  {r['setting']:40s} {r['ms']:7.1f} ms  MFU {r['mfu']:.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1, default=float))
    if args.write_doc:
        DOC.write_text(markdown(rep) + "\n")
        print(f"wrote {DOC}")
    return rep


if __name__ == "__main__":
    main()
