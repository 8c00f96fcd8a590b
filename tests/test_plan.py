"""bench.plan: the memory model's parts against closed forms, its peak against a measured CPU peak, the
GPU-hours arithmetic, and the CLI for the issue's configuration (XL/2, batch 32, bf16)."""

import pytest
import torch

from bench import plan as plan_module
from bench.plan import GIB, block_saved, build_on_meta, gpu_hours, measure_cpu_peak, plan
from sit_vit5.models import count_params, create_model, flops

SMALL = dict(depth=4, input_size=16)  # S width (384), 64 tokens: activations ~60 % of the peak at batch 32


def saved_activation_bytes(block, x, c, rope, weights: set[int]) -> int:
    """Bytes of the distinct per-token storages autograd saves for ``block``'s backward (hooks on the graph)."""
    storages = {}
    threshold = x.numel() * x.element_size()  # activations only: not rstd, (B, D) conditioning or weights

    def pack(t):
        ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if ptr not in weights and nbytes >= threshold:
            storages[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, c, rope)
    return sum(storages.values())


@pytest.mark.parametrize("name", ["SiT-S/2", "ViT5-S/2"])
def test_saved_activations_per_block_match_the_autograd_graph(name):
    """``block_saved`` is read off the ops of our Block; the saved-tensor hooks count what autograd keeps."""
    torch.manual_seed(0)
    model = create_model(name, input_size=8, depth=1, hidden_size=64, num_heads=2)
    B, N, D = 3, 16 + model.num_registers, 64
    x, c = torch.randn(B, N, D, requires_grad=True), torch.randn(B, D, requires_grad=True)
    rope = model.rope((4, 4), x.device, x.dtype) if model.rope is not None else None
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = saved_activation_bytes(model.blocks[0], x, c, rope, weights)
    saved = block_saved(model)
    assert measured == (saved["stream"] + saved["compute"]) * B * N * D * 4
    expected = {"SiT-S/2": {"stream": 4.0, "compute": 16.0}, "ViT5-S/2": {"stream": 4.0, "compute": 18.0}}
    assert saved == expected[name]  # 20 D and 22 D per token per block, as documented


def test_static_memory_is_the_closed_form_and_fsdp_divides_it():
    model = create_model("SiT-S/2", **SMALL)
    p, p_train = count_params(model), count_params(model, trainable_only=True)
    assert p - p_train == 64 * 384  # SiT's frozen sin-cos table
    one = plan("SiT-S/2", 8, "fp32", "ddp", 1, **SMALL)
    # weights and EMA: 4 bytes per parameter; gradients 4 and two AdamW moments 8 per trainable parameter
    assert one.weights_gib * GIB == 4 * p and one.ema_gib * GIB == 4 * p
    assert one.grads_gib * GIB == 4 * p_train and one.optimizer_gib * GIB == 8 * p_train
    assert one.extra_gib == 0
    ddp8 = plan("SiT-S/2", 8, "fp32", "ddp", 8, **SMALL)
    assert ddp8.extra_gib * GIB == 4 * p_train  # gradient buckets
    fsdp8 = plan("SiT-S/2", 8, "fp32", "fsdp", 8, **SMALL)
    assert fsdp8.weights_gib == pytest.approx(one.weights_gib / 8)
    assert fsdp8.optimizer_gib == pytest.approx(one.optimizer_gib / 8)
    assert fsdp8.ema_gib == pytest.approx(one.ema_gib * (1 + 1 / 8))  # whole on every process + its shards
    assert fsdp8.activations_gib == one.activations_gib
    ckpt = plan("SiT-S/2", 8, "fp32", "ddp", 1, grad_checkpointing=True, **SMALL)
    assert ckpt.activations_gib < one.activations_gib / 2
    assert ckpt.train_tflop_per_img == pytest.approx(one.train_tflop_per_img * 4 / 3)


def test_gpu_hours_closed_form():
    # 45 % of 989 TFLOP/s over 6 × 118.6 GFLOP per image is ~625 img/s (docs/PERFORMANCE.md)
    fwd = flops(build_on_meta("SiT-XL/2"))
    hours = gpu_hours(fwd, 400_000, 256, 0.45, 989.0)
    img_per_s = 0.45 * 989e12 / (6 * fwd * 1e9)
    assert img_per_s == pytest.approx(625, rel=0.01)
    assert hours == pytest.approx(400_000 * 256 / img_per_s / 3600)
    assert gpu_hours(fwd, 7_000_000, 256, 0.45, 989.0) == pytest.approx(hours * 17.5)


def test_cli_prints_memory_and_gpu_hours_for_xl(capsys, tmp_path):
    out = plan_module.main(["--model", "SiT-XL/2", "--batch-size", "32", "--precision", "bf16", "--gpus", "8",
                            "--json", str(tmp_path / "plan.json")])
    text = capsys.readouterr().out
    assert "predicted peak" in text and "GPU-hours" in text
    peak = out["plan"]["peak_gib"]
    assert 15 < peak < 80  # fits an 80 GB card at batch 32, as SiT's recipe (256 on 8 GPUs) does
    assert [r["steps"] for r in out["runs"]] == [400_000, 7_000_000]
    assert (tmp_path / "plan.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name, batch, ckpt", [("SiT-S/2", 32, False), ("ViT5-S/2", 32, False),
                                                ("ViT5-S/2", 32, True), ("SiT-S/2", 2, False)])
def test_predicted_peak_within_20_percent_of_measured_cpu_peak(name, batch, ckpt):
    """Real fp32 training steps (loss, backward, AdamW, EMA) in a fresh process; peak resident memory."""
    predicted = plan(name, batch, "fp32", "ddp", 1, ckpt, device="cpu", **SMALL)
    measured = measure_cpu_peak(name, batch, ckpt, [f"{k}={v}" for k, v in SMALL.items()])
    print(f"{name} batch {batch} ckpt {ckpt}: predicted {predicted.peak_gib:.3f} GiB, measured {measured:.3f}")
    assert predicted.peak_gib == pytest.approx(measured, rel=0.20)


def test_repa_extras_count_the_projector_encoder_and_vae_as_built():
    """REPA's projector (weights, gradients, two AdamW moments), its frozen encoder and an on-the-fly VAE
    against the modules themselves; FLOPs against closed forms for Linear layers."""
    timm = pytest.importorskip("timm")
    from diffusers import AutoencoderKL

    from bench.common import TINY_VAE_ARCH
    from bench.plan import Extras, forward_gflops, repa_extras
    from sit_vit5.training.repa import Projector

    gflops, out = forward_gflops(torch.nn.Linear(64, 32), torch.zeros(10, 64))
    assert gflops == pytest.approx(10 * 64 * 32 / 1e9) and out.shape == (10, 32)
    encoder = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32)
    vae = AutoencoderKL(**TINY_VAE_ARCH)
    extras = repa_extras(encoder, 32, 96, vae, image_size=32)
    assert extras.projector == (96, 192)  # the encoder's feature width, read off its output
    assert extras.frozen_params == count_params(encoder) + count_params(vae)
    assert set(extras.parts) == {"REPA encoder", "VAE encoder"} and all(g > 0 for g in extras.parts.values())
    # a ViT's forward is at least its Linear layers' multiply-adds over its 5 tokens (4 patches + cls)
    linear = sum(m.in_features * m.out_features for m in encoder.modules() if isinstance(m, torch.nn.Linear))
    assert extras.parts["REPA encoder"] >= 5 * linear / 1e9

    kw = dict(input_size=8, depth=2, hidden_size=64, num_heads=2)  # 4×4 = 16 patch tokens, width 64
    base = plan("ViT5-S/2", 4, "fp32", "ddp", 1, **kw)
    with_repa = plan("ViT5-S/2", 4, "fp32", "ddp", 1, extras=extras, **kw)
    assert with_repa.frozen_gib * GIB == 4 * extras.frozen_params
    assert with_repa.projector_gib * GIB == 16 * count_params(Projector(64, 96, 192))
    projector_gflops = 16 * (64 * 96 + 96 * 96 + 96 * 192) / 1e9
    assert with_repa.extras_gflops == pytest.approx(extras.frozen_gflops + 3 * projector_gflops)
    assert with_repa.train_tflop_per_img == pytest.approx(
        base.train_tflop_per_img + 2 * with_repa.extras_gflops / 1e3)
    assert with_repa.activations_gib > base.activations_gib  # the projector's saved inputs, the features
    assert with_repa.peak_gib > base.peak_gib + with_repa.frozen_gib + with_repa.projector_gib - 1e-9
    assert plan("ViT5-S/2", 4, "fp32", "ddp", 1, extras=Extras(), **kw) == base
    hours = gpu_hours(1.0, 10, 8, 0.5, 100.0, extras_gflops=3.0)
    assert hours == pytest.approx(10 * 8 * (6 + 6) * 1e9 / (0.5 * 100e12) / 3600)


def test_cli_adds_repa_and_the_on_the_fly_vae(capsys):
    pytest.importorskip("timm")
    out = plan_module.main(["--model", "SiT-XL/2", "--batch-size", "32", "--repa-encoder",
                            "vit_base_patch14_dinov2", "--vae-on-the-fly"])
    text = capsys.readouterr().out
    assert "REPA encoder" in text and "VAE encoder" in text and "REPA projector" in text
    base = plan("SiT-XL/2", 32, "bf16", "ddp", 8)
    got = out["plan"]
    assert got["frozen_gib"] * GIB == 4 * (85_724_928 + 83_653_863)  # DINOv2-B/14 (timm) + SD-VAE
    # DINOv2-B/14 at 224 px (257 tokens) ≈ 23 GMACs; SD-VAE's encoder at 256 px ≈ 136
    assert got["extras_gflops"] == pytest.approx(23.2 + 136.4 + 3 * 2.08, rel=0.01)
    assert got["peak_gib"] > base.peak_gib
