"""Memory and compute plan for a training run, on paper (no GPU needed), and a CPU check of the memory model.

    python -m bench.plan --model SiT-XL/2 --batch-size 32 --precision bf16 --strategy ddp --gpus 8
    python -m bench.plan --model ViT5-XL/2 --batch-size 64 --precision bf16 --strategy fsdp --gpus 16 \
        --grad-checkpointing --mfu 0.40
    python -m bench.plan --model SiT-S/2 --batch-size 16 --precision fp32 --measure-cpu   # model vs measured

Per GPU, in bytes: fp32 weights (4 P), gradients (4 P), AdamW moments (8 P), the fp32 EMA that the training
loop keeps on every process (4 P), DDP's gradient buckets (4 P, accelerate's default
``gradient_as_bucket_view=False``) or, under FSDP, weights/gradients/moments divided by the process count plus
the gathered weights and gradients of two blocks and the EMA's shards; bf16 autocast adds its cached bf16
weight copies (2 P).
Activations are counted from the autograd graph of our blocks (what each op saves for backward), per token per
block in units of the width D (SiT: 20 D, ViT-5: 22 D fp32; see ``block_saved``), times tokens, batch and depth;
with gradient checkpointing only each block's input is kept, plus one block recomputed. The peak is the larger
of (weights, moments, EMA, activations and the backward's working gradients) and (everything but activations,
with the gradients and the optimizer's temporaries). Fragmentation and the CUDA context (~0.5-1 GiB) are not in
the figure; leave 10-15 % headroom.

Compute: ``flops()`` counts a multiply-add once, so a training image costs 3 × 2 × flops() FLOPs (forward +
backward = 3 forwards), and 4 × with gradient checkpointing (one more forward; not counted in MFU, as usual).
GPU-hours = steps × global batch × 6 × flops() / (MFU × peak), independent of the GPU count.

Beside the backbone (``Extras``): frozen modules that stay resident and run forward only (REPA's encoder; the
VAE when a run encodes its images on the fly, as REPA runs do) cost 4 bytes per parameter and their forward
FLOPs (counted by ``torch.utils.flop_counter`` on meta tensors); REPA's projector is trained like the model
(weights, gradients and AdamW moments on every process, no EMA) and saves its layers' inputs per patch token.

    python -m bench.plan --model SiT-XL/2 --batch-size 32 --repa-encoder vit_base_patch14_dinov2 --vae-on-the-fly
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from sit_vit5.models import count_params, create_model, flops

from .common import PEAK_BF16_TFLOPS, SD_VAE_ARCH

GIB = 2**30
#: bytes of a saved tensor under each precision: the residual stream and norms stay fp32 under autocast
#: ("stream"), matmul inputs/outputs, attention and the MLP run in bf16 ("compute").
BYTES = {"fp32": {"stream": 4, "compute": 4}, "bf16": {"stream": 4, "compute": 2},
         "fp16": {"stream": 4, "compute": 2}}  # fp16 autocast saves what bf16 saves; its scaler is a scalar
#: transient gradient tensors alive at once in a block's backward (MLP: grad of fc2's input and of the GELU
#: input, 4 D each at ratio 4, plus the stream's gradient), per token, in units of D
BACKWARD_WORKSPACE_D = 9.0


def build_on_meta(name: str, **overrides) -> nn.Module:
    """The model's structure without allocating its weights (counts and shapes only)."""
    with torch.device("meta"):
        return create_model(name, **overrides)


def block_saved(model: nn.Module) -> dict[str, float]:
    """Tensors one block saves for backward, per token, in units of the width D: {"stream": fp32 share,
    "compute": share that is bf16 under autocast}. Read off the ops in ``sit_vit5.models.layers.Block``."""
    sw, block = model.switches, model.blocks[0]
    ratio = block.mlp.fc1.out_features / block.mlp.fc1.in_features
    # LayerNorm saves its input and modulate saves the normalised x (two tensors); our RMSNorm saves x_hat,
    # which is the very tensor modulate saves (one)
    stream = 2 * (2.0 if sw["norm"] == "layernorm" else 1.0)
    # qkv input, the qkv output (q, k, v are views of it, saved by SDPA), SDPA output = proj input (SDPA
    # allocates its output token-major, so the transpose + reshape before proj is a view)
    compute = 1 + 3 + 1.0
    if sw["qk_norm"]:
        stream += 2  # x_hat of q and of k (fp32 inside RMSNorm)
    if sw["qk_norm"] or sw["rope"]:
        compute += 2  # SDPA then saves new q, k tensors (normed and/or rotated) instead of views
    compute += 2  # the gated residual multiplies save the attention and MLP outputs
    if sw["mlp"] == "gelu":
        compute += 1 + 2 * ratio  # fc1 input, GELU input, fc2 input
    else:  # SwiGLU, hidden h' = 2/3 of the GELU width: fc1 out (2h'), silu(a) and fc2 input (h' each)
        compute += 1 + 4 * (2 / 3) * ratio
    return {"stream": stream, "compute": compute}


def forward_gflops(module: nn.Module, *inputs: torch.Tensor, method: str = "forward") -> tuple[float, Any]:
    """GFLOPs (multiply-adds, as ``flops()`` counts them) of one ``module.<method>(*inputs)`` call under
    no_grad, counted by torch's flop counter (meta tensors work: nothing is computed), and its output."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        out = getattr(module, method)(*inputs)
    return counter.get_total_flops() / 2 / 1e9, out  # the counter counts a multiply-add as 2


@dataclass(frozen=True)
class Extras:
    """What sits beside the backbone in a training step: frozen modules run forward only (REPA's encoder,
    a VAE encoding on the fly) and REPA's projector. GFLOPs are multiply-adds per training image."""

    frozen_params: int = 0
    frozen_gflops: float = 0.0
    projector: tuple[int, int] | None = None  # REPA: (projector width P, encoder feature width E)
    parts: dict[str, float] = field(default_factory=dict)  # name -> forward GFLOPs, for the printout


def vae_extras(vae: nn.Module, image_size: int = 256) -> Extras:
    """``Extras`` of a run whose ``vae`` (built on meta is enough) encodes (1, 3, image_size, image_size)
    images on the fly: its resident weights and its encoder's FLOPs."""
    pixels = torch.zeros(1, 3, image_size, image_size, device=next(vae.parameters()).device)
    gflops, _ = forward_gflops(vae, pixels, method="encode")
    return Extras(sum(p.numel() for p in vae.parameters()), gflops, None, {"VAE encoder": gflops})


def repa_extras(encoder: nn.Module, resolution: int, projector_dim: int, vae: nn.Module | None = None,
                image_size: int = 256, method: str = "forward_features") -> Extras:
    """``Extras`` of a REPA run: ``encoder`` (built on meta is enough) seeing (1, 3, resolution, resolution)
    images through ``encoder.<method>``, a projector ``projector_dim`` wide to its feature width and, when
    the run encodes on the fly, ``vae`` (``vae_extras``)."""
    image = torch.zeros(1, 3, resolution, resolution, device=next(encoder.parameters()).device)
    gflops, out = forward_gflops(encoder, image, method=method)  # out: (1, T, E) tokens, or a map ending in E
    on_the_fly = vae_extras(vae, image_size) if vae is not None else Extras()
    return Extras(sum(p.numel() for p in encoder.parameters()) + on_the_fly.frozen_params,
                  gflops + on_the_fly.frozen_gflops, (projector_dim, out.shape[-1]),
                  {"REPA encoder": gflops, **on_the_fly.parts})


@dataclass
class Plan:
    """One configuration's per-GPU memory (GiB) and compute figures."""

    model: str
    params_m: float
    fwd_gflops: float
    batch: int
    precision: str
    strategy: str
    gpus: int
    grad_checkpointing: bool
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    ema_gib: float
    extra_gib: float  # DDP buckets or FSDP gathered units, autocast weight copies
    activations_gib: float
    workspace_gib: float
    peak_gib: float
    train_tflop_per_img: float
    step_tflop: float  # per GPU, one optimizer step at this per-GPU batch (recompute included)
    frozen_gib: float = 0.0  # Extras: REPA's encoder, a VAE encoding on the fly (fp32 weights)
    projector_gib: float = 0.0  # Extras: REPA's projector with its gradients and AdamW moments
    extras_gflops: float = 0.0  # Extras per training image, in forward-equivalents (frozen + 3 × projector)


def plan(model_name: str, batch: int, precision: str = "bf16", strategy: str = "ddp", gpus: int = 1,
         grad_checkpointing: bool = False, device: str = "cuda", ema: bool = True, extras: Extras | None = None,
         **overrides) -> Plan:
    """Analytic per-GPU memory and FLOPs of one training step (see the module docstring for the model).

    ``batch`` is the per-GPU micro-batch; ``gpus`` the number of data-parallel processes (DDP buckets and FSDP
    shards depend on it); ``device='cpu'`` uses CPU AdamW (one tensor at a time, no foreach temporaries);
    ``ema=False`` leaves out the EMA copy (``bench.train_step`` keeps none); ``extras``: REPA's encoder and
    projector, a VAE encoding on the fly (``repa_extras``).
    """
    extras = extras or Extras()
    if precision not in BYTES or strategy not in ("ddp", "fsdp"):
        raise ValueError(f"precision must be fp32|bf16|fp16 and strategy ddp|fsdp, got {precision!r}, {strategy!r}")
    model = build_on_meta(model_name, **overrides)
    p_all, p_train = count_params(model), count_params(model, trainable_only=True)
    width, depth = model.x_embedder.proj.out_channels, len(model.blocks)
    n_tokens = (model.input_size // model.patch_size) ** 2 + model.num_registers
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    largest = max(p.numel() for p in model.parameters())
    shard = gpus if strategy == "fsdp" else 1
    weights, grads, moments = 4 * p_all / shard, 4 * p_train / shard, 8 * p_train / shard
    # the loop keeps a full fp32 EMA on every process (under FSDP also its fp32 shards, updated per step)
    ema_bytes = 4 * p_all * (1 + (1 / gpus if strategy == "fsdp" else 0)) if ema else 0
    extra = 0.0
    if strategy == "ddp" and gpus > 1:
        extra += 4 * p_train  # gradient buckets
    if strategy == "fsdp":
        extra += 2 * 4 * block_params * 2  # gathered weights and unsharded gradients of 2 blocks (prefetch)
    if precision in ("bf16", "fp16"):
        extra += 2 * p_all / shard + (2 * 2 * block_params if strategy == "fsdp" else 0)  # autocast copies
    bytes_ = BYTES[precision]
    saved = block_saved(model)
    per_block = sum(saved[k] * bytes_[k] for k in saved) * width  # bytes per token
    # outside the blocks: the final layer's norm, modulate and linear input, and the embedding output
    outside = (bytes_["stream"] * 3 + bytes_["compute"]) * width
    if grad_checkpointing:  # block inputs kept, one block recomputed at a time during backward
        activations = batch * n_tokens * (depth * bytes_["stream"] * width + per_block + outside)
    else:
        activations = batch * n_tokens * (depth * per_block + outside)
    workspace = batch * n_tokens * BACKWARD_WORKSPACE_D * width * bytes_["compute"]
    frozen, projector, projector_gflops = 4 * extras.frozen_params, 0.0, 0.0
    if extras.projector is not None:  # Linear(D, P) - SiLU - Linear(P, P) - SiLU - Linear(P, E), per patch
        proj, feat = extras.projector
        n_patches = (model.input_size // model.patch_size) ** 2
        proj_params = width * proj + proj + proj * proj + proj + proj * feat + feat
        projector = 16 * proj_params  # weights, gradients, two moments: whole on every process
        projector_gflops = n_patches * (width * proj + proj * proj + proj * feat) / 1e9
        # saved: the 3 Linear inputs and 2 SiLU inputs (P each but the first, D: the block output the
        # backbone keeps anyway), the output for the cosine; the encoder's features (fp32) live all step
        activations += batch * n_patches * ((4 * proj + feat) * bytes_["compute"] + 4 * feat)
    # AdamW on GPU is foreach: one temporary as large as the moments' sqrt; on CPU one tensor at a time
    opt_temp = 4 * (p_train / shard if device == "cuda" else largest)
    static = weights + moments + ema_bytes + extra + frozen + projector
    peak = static + max(activations + workspace, grads + opt_temp)
    if strategy == "ddp":  # gradients exist during backward's tail while activations are mostly freed
        peak = max(peak, static + grads + workspace)
    fwd = flops(model)
    # TFLOP per training image: the backbone 3 forwards (4 with recompute), frozen modules one, projector 3
    per_img = 2 * (fwd * (4 if grad_checkpointing else 3) + extras.frozen_gflops + 3 * projector_gflops) / 1e3
    return Plan(model_name, p_all / 1e6, fwd, batch, precision, strategy, gpus, grad_checkpointing,
                weights / GIB, grads / GIB, moments / GIB, ema_bytes / GIB, extra / GIB, activations / GIB,
                workspace / GIB, peak / GIB, per_img, per_img * batch, frozen / GIB, projector / GIB,
                extras.frozen_gflops + 3 * projector_gflops)


def gpu_hours(fwd_gflops: float, steps: int, global_batch: int, mfu: float, peak_tflops: float,
              extras_gflops: float = 0.0) -> float:
    """GPU-hours for ``steps`` optimizer steps of ``global_batch`` images at model-FLOPs utilisation ``mfu``
    (``extras_gflops``: ``Plan.extras_gflops``, work beside the backbone at the same utilisation)."""
    model_flop = steps * global_batch * (6 * fwd_gflops + 2 * extras_gflops) * 1e9
    return model_flop / (mfu * peak_tflops * 1e12) / 3600


# ----------------------------------------------------------------------------- CPU measurement


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """Resident-memory high-water mark since the last reset (VmHWM, Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def _measure_child(args: argparse.Namespace) -> dict[str, float]:
    """Peak resident memory growth of real training steps (transport loss, backward, AdamW, EMA) on CPU."""
    from sit_vit5.training.ema import create_ema, update_ema
    from sit_vit5.transport import create_transport

    torch.set_num_threads(1)
    overrides = parse_overrides(args.override)
    transport = create_transport()

    def step(model, ema, opt, x, y):
        loss = transport.training_losses(model, x, model_kwargs=dict(y=y))["loss"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_ema(ema, model, 0.9999)

    # warm up the kernels (and their one-off buffers) on a tiny twin, so the baseline holds them
    tiny = create_model(args.model, **{**overrides, "depth": 1})
    x = torch.randn(2, tiny.in_channels, tiny.input_size, tiny.input_size)
    step(tiny, create_ema(tiny), torch.optim.AdamW(tiny.parameters()), x, torch.zeros(2, dtype=torch.long))
    del tiny
    base = _rss_bytes()
    # restart the high-water mark here: imports (diffusers) peak above the baseline on their own
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model = create_model(args.model, **overrides)
    model.set_grad_checkpointing(args.grad_checkpointing)
    ema = create_ema(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, model.in_channels, model.input_size, model.input_size)
    y = torch.randint(0, 1000, (args.batch_size,))
    for _ in range(2):  # the first step creates the AdamW moments
        step(model, ema, opt, x, y)
    peak = _peak_rss_bytes()
    return {"baseline_gib": base / GIB, "peak_gib": (peak - base) / GIB}


def measure_cpu_peak(model_name: str, batch: int, grad_checkpointing: bool = False,
                     overrides: list[str] | None = None) -> float:
    """Measured peak memory (GiB) of fp32 training steps on the CPU, above the process's baseline.

    Runs in a fresh process with glibc told to serve every block over 64 KiB by mmap (freed memory goes back
    at once), so resident memory tracks the live tensors rather than the allocator's caching.
    """
    cmd = [sys.executable, "-m", "bench.plan", "--model", model_name, "--batch-size", str(batch),
           "--precision", "fp32", "--measure-child"] + sum((["--override", o] for o in overrides or []), [])
    if grad_checkpointing:
        cmd.append("--grad-checkpointing")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measurement failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_gib"]


# ----------------------------------------------------------------------------- CLI


def parse_overrides(items: list[str] | None) -> dict:
    """``key=value`` model overrides (``depth=4``, ``input_size=16``), values parsed as Python literals."""
    import ast

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--override {item!r}: expected key=value")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def cli_extras(args: argparse.Namespace) -> Extras:
    """``Extras`` from ``--repa-encoder`` / ``--vae-on-the-fly`` (architectures built on meta, no weights)."""
    if args.repa_encoder is None and not args.vae_on_the_fly:
        return Extras()
    vae = None
    if args.vae_on_the_fly:
        from diffusers import AutoencoderKL

        with torch.device("meta"):
            vae = AutoencoderKL(**SD_VAE_ARCH)
    model = build_on_meta(args.model, **parse_overrides(args.override))
    image_size = model.input_size * (8 if vae is not None or model.in_channels == 4 else 1)
    if args.repa_encoder is None:
        return vae_extras(vae, image_size)
    try:
        import timm
    except ImportError:
        raise SystemExit("--repa-encoder builds the encoder with timm: pip install '.[repa]'") from None

    name = args.repa_encoder.removeprefix("timm:")
    try:
        with torch.device("meta"):
            encoder = timm.create_model(name, pretrained=False, num_classes=0)
    except RuntimeError as err:  # timm: "Unknown model (...)"
        raise SystemExit(f"--repa-encoder {name}: {err}") from None
    if not hasattr(encoder, "set_input_size"):
        raise SystemExit(f"--repa-encoder {name}: not a timm ViT (REPA aligns a ViT's patch tokens)")
    patch = encoder.patch_embed.patch_size[0]
    resolution = args.repa_resolution or patch * (model.input_size // model.patch_size)
    encoder.set_input_size(img_size=(resolution, resolution))
    return repa_extras(encoder, resolution, args.repa_projector_dim, vae, image_size)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default="SiT-XL/2", help="registry name, e.g. SiT-XL/2, ViT5-B/2")
    add("--batch-size", type=int, default=32, help="per-GPU micro-batch")
    add("--precision", choices=tuple(BYTES), default="bf16")
    add("--strategy", choices=("ddp", "fsdp"), default="ddp")
    add("--gpus", type=int, default=8, help="data-parallel processes (DDP buckets, FSDP shards, wall time)")
    add("--grad-checkpointing", action="store_true")
    add("--global-batch", type=int, default=256, help="images per optimizer step (SiT recipe: 256)")
    add("--steps", type=int, nargs="+", default=[400_000, 7_000_000], help="run lengths for GPU-hours")
    add("--mfu", type=float, default=0.45, help="model-FLOPs utilisation to assume")
    add("--gpu", default="H200", choices=tuple(PEAK_BF16_TFLOPS), help="sets the dense bf16 peak")
    add("--peak-tflops", type=float, default=None, help="override the peak TFLOP/s")
    add("--gpu-memory-gib", type=float, default=None, help="print the headroom against this capacity")
    add("--override", action="append", metavar="KEY=VALUE", help="model override (depth=4, input_size=16)")
    add("--repa-encoder", default=None, metavar="TIMM_NAME",
        help="add REPA with this timm encoder architecture (no weights needed), e.g. vit_base_patch14_dinov2 "
             "(DINOv2-B/14, REPA's)")
    add("--repa-projector-dim", type=int, default=2048, help="REPA projector width (REPA: 2048)")
    add("--repa-resolution", type=int, default=None,
        help="encoder input side (default: its patch × the model's token grid, 224 for DINOv2/14 at 256 px)")
    add("--vae-on-the-fly", action="store_true",
        help="the run encodes images with SD-VAE each step (data.kind=imagefolder, as REPA runs do)")
    add("--measure-cpu", action="store_true", help="also measure the fp32 peak on this CPU (small models!)")
    add("--measure-child", action="store_true", help=argparse.SUPPRESS)
    add("--json", default=None, help="write the figures here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.measure_child:
        print(json.dumps(_measure_child(args)))
        return {}
    if args.batch_size < 1 or args.gpus < 1 or not 0 < args.mfu <= 1:
        raise SystemExit("--batch-size and --gpus must be >= 1 and --mfu in (0, 1]")
    device = "cpu" if args.measure_cpu else "cuda"
    extras = cli_extras(args)
    result = plan(args.model, args.batch_size, args.precision, args.strategy, args.gpus, args.grad_checkpointing,
                  device=device, extras=extras, **parse_overrides(args.override))
    peak_tflops = args.peak_tflops or PEAK_BF16_TFLOPS[args.gpu]
    accum = max(1, math.ceil(args.global_batch / (args.batch_size * args.gpus)))
    print(f"{result.model}: {result.params_m:.2f}M parameters, {result.fwd_gflops:.2f} GFLOPs forward "
          f"(multiply-adds) per image")
    print(f"per GPU: batch {args.batch_size}, {args.precision}, {args.strategy.upper()} over {args.gpus} "
          f"process(es){', grad checkpointing' if args.grad_checkpointing else ''}; global batch "
          f"{args.global_batch} = {args.gpus} × {args.batch_size} × {accum} accumulation"
          f"{'' if args.gpus * args.batch_size * accum == args.global_batch else ' (does not divide!)'}")
    rows = [("weights (fp32)", result.weights_gib), ("gradients", result.grads_gib),
            ("AdamW moments", result.optimizer_gib), ("EMA (fp32, full)", result.ema_gib),
            ("buckets / gathered / autocast copies", result.extra_gib), ("activations", result.activations_gib),
            ("backward workspace", result.workspace_gib)]
    if extras.frozen_params:
        rows.insert(5, ("frozen: " + ", ".join(extras.parts), result.frozen_gib))
    if extras.projector:
        rows.insert(6, ("REPA projector (+ grads, AdamW)", result.projector_gib))
    for name, gib in rows:
        print(f"  {name:<38} {gib:8.2f} GiB")
    print(f"  {'predicted peak':<38} {result.peak_gib:8.2f} GiB")
    if args.gpu_memory_gib:
        print(f"  headroom on {args.gpu_memory_gib:.0f} GiB: {args.gpu_memory_gib - result.peak_gib:.1f} GiB")
    print(f"step: {result.train_tflop_per_img * 1e3:.0f} GFLOP per training image"
          f"{' (incl. recompute)' if args.grad_checkpointing else ''}, {result.step_tflop:.1f} TFLOP per GPU "
          f"micro-batch")
    for name, gflops in extras.parts.items():
        print(f"  of which {name}: {gflops:.1f} GFLOPs forward per image "
              f"({gflops / (3 * result.fwd_gflops):.1%} of the backbone's training step)")
    out = {"plan": asdict(result), "mfu": args.mfu, "peak_tflops": peak_tflops, "runs": []}
    img_per_s = args.mfu * peak_tflops * 1e12 / ((6 * result.fwd_gflops + 2 * result.extras_gflops) * 1e9)
    print(f"at {args.mfu:.0%} MFU of {peak_tflops:.0f} TFLOP/s ({args.gpu}): {img_per_s:.0f} img/s per GPU")
    for steps in args.steps:
        hours = gpu_hours(result.fwd_gflops, steps, args.global_batch, args.mfu, peak_tflops,
                          result.extras_gflops)
        days = hours / args.gpus / 24
        print(f"  {steps:>9,} steps × {args.global_batch}: {hours:10,.0f} GPU-hours = {days:6.1f} days on "
              f"{args.gpus} GPU(s)" + (f"; with the recompute at the same hardware utilisation: "
                                       f"{hours * 4 / 3:,.0f} GPU-hours" if args.grad_checkpointing else ""))
        out["runs"].append({"steps": steps, "gpu_hours": hours, "days": days})
    if args.measure_cpu:
        if args.precision != "fp32":
            raise SystemExit("--measure-cpu measures fp32 (CPU autocast is not the GPU's); pass --precision fp32")
        single = plan(args.model, args.batch_size, "fp32", "ddp", 1, args.grad_checkpointing, device="cpu",
                      **parse_overrides(args.override))  # one process: what the measurement runs
        measured = measure_cpu_peak(args.model, args.batch_size, args.grad_checkpointing, args.override)
        out.update(measured_cpu_peak_gib=measured, predicted_cpu_peak_gib=single.peak_gib)
        print(f"one CPU process, fp32: measured peak {measured:.3f} GiB vs predicted {single.peak_gib:.3f} GiB "
              f"({single.peak_gib / measured - 1:+.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
