"""CUDA placement traced without a GPU: each path runs on fake CUDA tensors (FakeTensorMode), so a tensor
made on the CPU inside a forward or a sampler raises the device-mismatch error it would raise on a GPU.

FakeTensor tensors carry shapes, dtypes and devices but no values. Models are built outside the mode (weight
initialisation draws real numbers), then moved to "cuda" inside it. Every output is asserted to be on the
CUDA device. What FakeTensor cannot trace, and the real-GPU check that covers it:
* backward (needs a CUDA context): bench.suite stages ``xl_eager``/``xl_compile``/``fsdp``/``small``;
* CUDA autocast (off under FakeTensor): bench.suite stage ``correctness`` (bf16 CUDA vs CPU forward);
* torchdiffeq's ``odeint`` (checks its time grid by value): the ODE drift is traced one Euler step here,
  odeint itself by bench.suite stage ``correctness`` (a few ODE steps on CUDA);
* value reads (the non-finite check, guidance's interval skip and first-step blow-up check, the uint8
  conversion, the SDE's host-side time grid): replaced or built outside the mode in the pipeline
  trace, run for real by bench.suite stage ``pipeline``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="this torch build has no CUDA")

TINY = dict(input_size=8, depth=2, hidden_size=32, num_heads=2, num_classes=10)
TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                norm_num_groups=8, sample_size=16)
CUDA = torch.device("cuda", 0)


def fake_cuda():
    """The mode; real CPU tensors (the models' weights) may enter it, and become fake when moved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def on_cuda(*outs: Tensor | list | tuple) -> None:
    """Assert every tensor in ``outs`` (nested lists/tuples too) is on cuda:0."""
    flat = [t for t in _flatten(outs) if isinstance(t, Tensor)]
    assert flat, "nothing to check"
    for t in flat:
        assert t.device == CUDA, t.device


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flatten(item)
    else:
        yield x


def tiny(name: str, **kw) -> nn.Module:
    from sit_vit5.models import create_model

    torch.manual_seed(0)
    return create_model(name, **{**TINY, **kw}).eval()


def inputs(batch: int = 2, channels: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """(x (B, C, 8, 8), t (B,), y (B,)) on cuda; call inside the mode."""
    return (torch.randn(batch, channels, 8, 8, device=CUDA), torch.rand(batch, device=CUDA),
            torch.randint(0, 10, (batch,), device=CUDA))


# ----------------------------------------------------------------------------- backbones


@pytest.mark.parametrize("name, kw", [
    ("SiT-S/2", {}),
    ("ViT5-S/2", {}),  # RoPE (patches and registers), 4 registers, QK-norm, RMSNorm, learned APE
    ("ViT5-S/2", dict(num_registers=0, register_rope_theta=None)),
])
def test_backbone_forward_on_fake_cuda(name, kw):
    model = tiny(name, **kw)
    with fake_cuda():
        model = model.to("cuda")
        x, t, y = inputs()
        out = model(x, t, y)
        # another grid (interpolated APE, RoPE tables for 6x6) and the guided forward
        other = model(torch.randn(2, 4, 12, 12, device=CUDA), t, y)
        guided = model.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]),
                                        torch.cat([y, torch.full_like(y, 10)]), 4.0, interval=(0.2, 0.8))
    on_cuda(out, other, guided)
    assert out.shape == (2, 8, 8, 8) and other.shape == (2, 8, 12, 12) and guided.shape == (4, 8, 8, 8)  # 2C outputs


def test_vit5_gradient_checkpointing_and_train_mode_forward():
    """Checkpointing only acts in training mode: the train forward (label dropout draws, checkpoint wrapper)
    and the eval forward with the flag set."""
    model = tiny("ViT5-S/2")
    model.set_grad_checkpointing(True)
    with fake_cuda():
        model = model.to("cuda")
        x, t, y = inputs()
        evaluated = model(x, t, y)
        with torch.no_grad():
            trained = model.train()(x, t, y)
    on_cuda(evaluated, trained)


def test_dit_objective_model_and_its_loss():
    from sit_vit5.diffusion import create_diffusion

    model = tiny("SiT-S/2", learn_sigma=True)
    diffusion = create_diffusion("")
    with fake_cuda():
        model = model.to("cuda")
        x, _, y = inputs()
        t = torch.randint(0, diffusion.num_timesteps, (2,), device=CUDA)
        out = model(x, t.float(), y)
        with torch.no_grad():
            losses = diffusion.training_losses(model, x, t, dict(y=y))
    on_cuda(out, *losses.values())
    assert out.shape == (2, 8, 8, 8)


def test_transport_training_loss():
    from sit_vit5.transport import create_transport

    model = tiny("ViT5-S/2").train()
    with fake_cuda():
        model = model.to("cuda")
        x, _, y = inputs()
        with torch.no_grad():
            loss = create_transport().training_losses(model, x, dict(y=y))["loss"]
    on_cuda(loss)


# ----------------------------------------------------------------------------- samplers


def guided(model: nn.Module, cfg: float, interval: tuple[float, float] | None):
    """(model_fn, doubled z -> kwargs) as sample.py calls them: CFG on a doubled batch, or the plain forward."""
    if cfg == 1.0:
        return model.forward, lambda y: dict(y=y)
    def fn(x, t, y):
        return model.forward_with_cfg(x, t, y, cfg, interval=interval)
    return fn, lambda y: dict(y=torch.cat([y, torch.full_like(y, 10)]))


@pytest.mark.parametrize("cfg, interval", [(1.0, None), (4.0, None), (4.0, (0.1, 0.7))])
@pytest.mark.parametrize("method", ["Euler", "Heun"])
def test_sde_sampler(method, cfg, interval):
    from sit_vit5.transport import create_transport
    from sit_vit5.transport.sampler import Sampler

    model = tiny("ViT5-S/2")
    sample = Sampler(create_transport()).sample_sde(sampling_method=method, num_steps=3)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with fake_cuda(), torch.no_grad():
        model = model.to("cuda")
        z, _, y = inputs()
        fn, kwargs = guided(model, cfg, interval)
        if cfg != 1.0:
            z, gens = torch.cat([z, z]), gens + gens
        states = sample(z, fn, generator=gens, **kwargs(y))
    on_cuda(states)


class HostSyncs(TorchDispatchMode):
    """Records what makes the host wait for a GPU: a blocking copy from the host (the CUDA runtime
    synchronises the stream before a pageable host-to-device copy) and a value read (``.item()``,
    ``float()``, ``bool()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            # _to_copy(src, ..., non_blocking=) -> dst; copy_(dst, src, non_blocking)
            src, dst = (args[0], out) if func is torch.ops.aten._to_copy.default else args[1::-1]
            if (src.device.type == "cpu" and dst.device.type == "cuda"
                    and not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))):
                self.syncs.append(f"blocking copy {tuple(src.shape)} to the GPU")
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.append("value read")
        return out


@pytest.mark.parametrize("generator", ["per_row", "one", None])
@pytest.mark.parametrize("method", ["Euler", "Heun"])
@pytest.mark.parametrize("backbone", ["SiT-S/2", "ViT5-S/2"])
def test_sde_steps_never_wait_for_the_gpu(backbone, method, generator):
    """A guided SDE batch on a GPU queues every step without a host sync: the time is filled on the
    device, CPU-generator noise arrives from pinned memory without blocking. (Before: two blocking
    copies per step, so each NFE began from an idle GPU.) Not counted: the first batch (it builds
    the RoPE tables of its grid), guidance's first-call check (skipped here) and its interval mask
    (a sync by design, guidance.py)."""
    from sit_vit5.guidance import ClassifierFreeGuidance
    from sit_vit5.transport import create_transport
    from sit_vit5.transport.sampler import Sampler

    model = tiny(backbone)
    sample = Sampler(create_transport()).sample_sde(sampling_method=method, num_steps=4)
    gens = {"per_row": [torch.Generator().manual_seed(i) for i in range(2)],
            "one": torch.Generator().manual_seed(0), None: None}[generator]
    with fake_cuda(), torch.no_grad():
        model = model.to("cuda")
        z, _, y = inputs()
        fn = ClassifierFreeGuidance(model, 4.0, null_class=10)
        fn.checked = True
        sample(z, fn, generator=gens, y=y)  # the first batch builds ViT-5's RoPE tables (one copy)
        with HostSyncs() as recorder:
            states = sample(z, fn, generator=gens, y=y)
    on_cuda(states)
    assert len(states) == 4  # the run happened: 3 steps + the last step
    assert recorder.syncs == []


@pytest.mark.parametrize("loop", ["p_sample_loop", "ddim_sample_loop"])
def test_ddpm_steps_never_wait_for_the_gpu(loop):
    """DDPM / DDIM steps gather their schedule coefficients on the GPU without blocking copies
    (before: a blocking copy of a schedule array for each of about ten coefficients per step)."""
    from sit_vit5.diffusion import create_diffusion
    from sit_vit5.guidance import ClassifierFreeGuidance

    model = tiny("SiT-S/2", learn_sigma=True)
    diffusion = create_diffusion("4")
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with fake_cuda(), torch.no_grad():
        model = model.to("cuda")
        z, _, y = inputs()
        fn = ClassifierFreeGuidance(model, 4.0, null_class=10)
        fn.checked = True
        run = getattr(diffusion, loop)
        with HostSyncs() as recorder:
            out = run(fn, z.shape, noise=z, model_kwargs=dict(y=y), device=CUDA, generator=gens)
    on_cuda(out)
    assert diffusion.last_nfe == 4
    assert recorder.syncs == []


def test_training_loss_never_waits_for_the_gpu():
    """The training loss's times come from the CPU global RNG (as SiT), now without blocking."""
    from sit_vit5.transport import create_transport

    model = tiny("ViT5-S/2").train()
    with fake_cuda():
        model = model.to("cuda")
        x, _, y = inputs()
        transport = create_transport()
        transport.training_losses(model, x, dict(y=y))  # the first step builds the RoPE tables
        with HostSyncs() as recorder:
            loss = transport.training_losses(model, x, dict(y=y))["loss"]
    on_cuda(loss)
    assert recorder.syncs == []


def test_the_sync_recorder_sees_a_blocking_copy():
    """The recorder can fail: the old ways (as_tensor of a Python float, a pageable .to) are syncs."""
    with fake_cuda():
        x = torch.zeros(2, device=CUDA)
        with HostSyncs() as recorder:
            torch.as_tensor(0.5, device=x.device)
            torch.randn(2).to(x)
            torch.randn(2).to(x, non_blocking=True)
    assert len(recorder.syncs) == 2, recorder.syncs


@pytest.mark.parametrize("cfg, interval", [(1.0, None), (4.0, None), (4.0, (0.1, 0.7))])
def test_ode_drift_one_euler_step(cfg, interval):
    """The sampler's ODE drift on its own time grid (odeint itself: see the module docstring)."""
    from sit_vit5.transport import create_transport
    from sit_vit5.transport.integrators import batch_time, time_grid
    from sit_vit5.transport.sampler import Sampler

    model = tiny("SiT-S/2")
    sampler = Sampler(create_transport())
    with fake_cuda(), torch.no_grad():
        model = model.to("cuda")
        z, _, y = inputs()
        fn, kwargs = guided(model, cfg, interval)
        if cfg != 1.0:
            z = torch.cat([z, z])
        grid = time_grid(0.0, 1.0, 3, z)
        drift = sampler._velocity_fn(fn, kwargs(y))
        x1 = z + (grid[1] - grid[0]) * drift(z, batch_time(grid[0], z))
    on_cuda(grid, x1)


@pytest.mark.parametrize("loop", ["p_sample_loop", "ddim_sample_loop"])
@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_ddpm_and_ddim_loops(loop, cfg):
    from sit_vit5.diffusion import create_diffusion

    model = tiny("SiT-S/2", learn_sigma=True)
    diffusion = create_diffusion("3")  # respaced to 3 steps
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with fake_cuda(), torch.no_grad():
        model = model.to("cuda")
        z, _, y = inputs()
        fn, kwargs = guided(model, cfg, (0.0, 0.5) if cfg != 1.0 else None)
        if cfg != 1.0:
            z, gens = torch.cat([z, z]), gens + gens
        out = getattr(diffusion, loop)(fn, z.shape, noise=z, model_kwargs=kwargs(y), device=CUDA,
                                       generator=gens)
    on_cuda(out)
    assert out.shape == z.shape


# ----------------------------------------------------------------------------- VAE, REPA, the pipeline


def test_sd_vae_architecture_decoder():
    from diffusers import AutoencoderKL

    from sit_vit5.vae import decoder, encode

    torch.manual_seed(0)
    vae = AutoencoderKL(**TINY_VAE).eval()
    decode = decoder(vae)
    with fake_cuda():
        vae = vae.to("cuda")
        images = decode(torch.randn(2, 4, 4, 4, device=CUDA))
        latents = encode(vae, torch.randn(2, 3, 8, 8, device=CUDA))
    on_cuda(images, latents)
    assert images.shape == (2, 3, 8, 8) and latents.shape == (2, 4, 4, 4)


def test_repa_projector_capture_and_alignment_loss():
    from sit_vit5.training import repa

    model = tiny("ViT5-S/2").train()
    projector = repa.Projector(32, 64, 16)
    capture = repa.HiddenCapture(model, 1)
    with fake_cuda():
        model, projector = model.to("cuda"), projector.to("cuda")
        x, t, y = inputs()
        with capture.armed():
            model(x, t, y)
        hidden = capture.take()
        projected = projector(hidden)
        loss = repa.alignment_loss(projected, torch.randn(2, 16, 16, device=CUDA))
    on_cuda(hidden, projected, loss)
    assert hidden.shape == (2, 16, 32) and loss.shape == (2,)  # 16 patch tokens, registers dropped


def test_exported_sit_pipeline_call(monkeypatch):
    """``SiTPipeline.__call__`` (ViT5 + the SD-VAE architecture, CFG): its pixels are on CUDA before the
    pipeline moves them to the host."""
    from diffusers import AutoencoderKL

    from sit_vit5 import SiTPipeline, guidance
    from sit_vit5.pipeline import scheduler_from
    from sit_vit5.sample_spec import SampleSpec
    from sit_vit5.sampling import sampling_pipeline as sampling_pipeline

    seen: list[Tensor] = []

    def to_uint8(pixels: Tensor) -> np.ndarray:  # values: there are none to convert
        seen.append(pixels)
        return np.zeros((pixels.shape[0], *pixels.shape[2:], pixels.shape[1]), np.uint8)

    real_to = nn.Module.to

    def to(module: nn.Module, *args, **kwargs) -> nn.Module:
        # torch cannot move fake parameters twice (swap_tensors meets FakeTensor's weakrefs): a module
        # already on the device is returned as it is, which is what .to does with real tensors
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if dtype is None and device is not None and all(t.device.type == device.type for t in tensors):
            return module
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", to)
    monkeypatch.setattr(sampling_pipeline, "to_uint8", to_uint8)
    # value reads: the finite check, and guidance's "any sample inside the interval?" (taken: guide)
    monkeypatch.setattr(sampling_pipeline, "bool", lambda _: True, raising=False)
    monkeypatch.setattr(guidance, "bool", lambda _: True, raising=False)
    # and the first guided step's blow-up check (reads maxima; tests/test_first_minute.py covers it)
    monkeypatch.setattr(guidance, "check_guided", lambda *args: None)
    model = tiny("ViT5-S/2", input_size=4)
    torch.manual_seed(0)
    vae = AutoencoderKL(**TINY_VAE).eval().requires_grad_(False)
    spec = SampleSpec(method="sde", sampling_method="Euler", num_steps=3, cfg_scale=4.0)
    scheduler = scheduler_from({"objective": "sit", "path_type": "Linear", "prediction": "velocity"}, spec)
    with fake_cuda():  # parts moved first: the pipeline's .to cannot swap parameters into fake ones
        pipe = SiTPipeline(transformer=model.to("cuda"), scheduler=scheduler, vae=vae.to("cuda"))
    pipe.set_progress_bar_config(disable=True)
    assert pipe._execution_device == CUDA
    # built outside the mode: the SDE's time grid is a host list (linspace(...).tolist()), no fake values
    sampling = pipe.sampling_pipeline()
    monkeypatch.setattr(pipe, "sampling_pipeline", lambda *args: sampling)
    with fake_cuda():
        out = pipe([1, 2], generator=0, output_type="pt")
    on_cuda(seen)
    assert seen[0].shape == (2, 3, 8, 8) and out.images.shape == (2, 3, 8, 8)
