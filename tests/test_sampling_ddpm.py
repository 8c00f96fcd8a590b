"""Sampling DiT-objective models: an official-layout DiT state dict loads by name and samples as DiT's DDPM
loop defines, guidance leaves the variance half alone, the objective is never guessed, and sample.py drives
our ddpm checkpoints (grid = bulk, DiT's flags)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sample
from sit_vit5.config import load_config
from sit_vit5.diffusion import create_diffusion
from sit_vit5.models import LoadedModel, create_model, load_model
from sit_vit5.objective import SiTObjective, create_objective
from sit_vit5.sampling import SampleSpec, SamplingPipeline
from sit_vit5.training import save_checkpoint
from sit_vit5.transport import create_transport
from sit_vit5.transport.rng import sample_seed
from sit_vit5.utils.errors import SettingError
from tests.helpers import assert_names, naming, one_sample_error

DEPTH, WIDTH, HEADS, PATCH, C, SIDE, CLASSES = 2, 32, 2, 2, 4, 8, 10
ARCH = dict(depth=DEPTH, hidden_size=WIDTH, num_heads=HEADS)


def dit_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under DiT's own key names and shapes (models.py of DiT: learn_sigma, 2C outputs)."""
    g = torch.Generator().manual_seed(seed)
    D, n, pp = WIDTH, (SIDE // PATCH) ** 2, PATCH * PATCH

    def rand(*shape):
        return 0.05 * torch.randn(*shape, generator=g)

    state = {
        "x_embedder.proj.weight": rand(D, C, PATCH, PATCH),
        "x_embedder.proj.bias": rand(D),
        "t_embedder.mlp.0.weight": rand(D, 256),
        "t_embedder.mlp.0.bias": rand(D),
        "t_embedder.mlp.2.weight": rand(D, D),
        "t_embedder.mlp.2.bias": rand(D),
        "y_embedder.embedding_table.weight": rand(CLASSES + 1, D),  # last row: the null class
        "pos_embed": rand(1, n, D),
        "final_layer.adaLN_modulation.1.weight": rand(2 * D, D),
        "final_layer.adaLN_modulation.1.bias": rand(2 * D),
        "final_layer.linear.weight": rand(pp * 2 * C, D),
        "final_layer.linear.bias": rand(pp * 2 * C),
    }
    for i in range(DEPTH):
        for name, (out, inp) in {
            "attn.qkv": (3 * D, D),
            "attn.proj": (D, D),
            "mlp.fc1": (4 * D, D),
            "mlp.fc2": (D, 4 * D),
            "adaLN_modulation.1": (6 * D, D),
        }.items():
            state[f"blocks.{i}.{name}.weight"], state[f"blocks.{i}.{name}.bias"] = (
                rand(out, inp),
                rand(out),
            )
    return state


@pytest.fixture(scope="module")
def dit_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dit") / "DiT-tiny.pt"
    torch.save(dit_state_dict(), path)
    return path


def test_official_dit_file_loads_by_name_and_samples_as_ddpm_defines(dit_file):
    info = load_model(dit_file, "DiT-S/2", overrides=ARCH)
    assert (info.source, info.objective_name, info.objective["ddpm_variance"]) == (
        "official",
        "ddpm",
        "learned",
    )
    assert info.model.state_dict().keys() == dit_state_dict().keys()
    spec = SampleSpec(method="ddpm", num_steps=10)
    pipe = SamplingPipeline.for_model(info, spec)
    model = pipe.model
    x, y = torch.randn(2, C, SIDE, SIDE), torch.tensor([1, 2])
    assert model(x, torch.tensor([999, 3]), y).shape == (
        2,
        2 * C,
        SIDE,
        SIDE,
    )  # noise and variance halves
    batch = pipe.generate([0, 1, 2], global_seed=5, labels=[3, 1, 4])
    assert batch.nfe == 10
    # the same thing by hand: per-sample seeded noise, DiT's 10-step respaced p_sample_loop on the raw model
    gens = [torch.Generator().manual_seed(sample_seed(5, i)) for i in range(3)]
    z = torch.stack([torch.randn(C, SIDE, SIDE, generator=g) for g in gens])
    y = torch.tensor([3, 1, 4])
    expected = create_diffusion("10").p_sample_loop(
        model, z.shape, z, model_kwargs=dict(y=y), generator=gens
    )
    assert torch.equal(batch.pixels, expected)
    # DDIM (eta 0) is deterministic given z: no per-step noise
    ddim = SamplingPipeline.for_model(info, SampleSpec(method="ddim", num_steps=10))
    expected = create_diffusion("ddim10").ddim_sample_loop(
        model, z.shape, z, model_kwargs=dict(y=y)
    )
    assert torch.equal(ddim.generate([0, 1, 2], 5, labels=[3, 1, 4]).pixels, expected)


def test_guidance_under_ddpm_mixes_the_noise_channels_only(dit_file):
    info = load_model(dit_file, "DiT-S/2", overrides=ARCH)
    scale, labels = 3.0, torch.tensor([3, 1])
    pipe = SamplingPipeline.for_model(info, SampleSpec(method="ddpm", num_steps=5, cfg_scale=scale))
    model = pipe.model

    def dit_guided(
        x, t, y
    ):  # DiT's "standard" CFG: eps guided, the variance half from the conditional pass
        cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, CLASSES))
        eps = uncond[:, :C] + scale * (cond[:, :C] - uncond[:, :C])
        return torch.cat([eps, cond[:, C:]], dim=1)

    gens = [torch.Generator().manual_seed(sample_seed(0, i)) for i in range(2)]
    z = torch.stack([torch.randn(C, SIDE, SIDE, generator=g) for g in gens])
    # ancestral steps use the variance: guiding the variance half too would change the samples
    expected = create_diffusion("5").p_sample_loop(
        dit_guided, z.shape, z, model_kwargs=dict(y=labels), generator=gens
    )
    got = pipe.generate([0, 1], 0, labels=[3, 1]).pixels
    assert torch.allclose(
        got, expected, rtol=1e-4, atol=1e-4
    )  # batch shapes differ: float rounding only


def test_the_objective_of_a_bare_file_is_told_never_guessed(dit_file):
    with pytest.raises(ValueError, match="model_name / --model"):
        load_model(dit_file, overrides=ARCH)
    with pytest.raises(ValueError) as err:
        load_model(dit_file, "DiT-S/2", overrides=ARCH, objective="sit")
    assert "DiT-S/2" in str(err.value) and "objective=ddpm" in str(err.value)
    assert load_model(dit_file, "SiT-S/2", overrides=ARCH, objective="ddpm").objective_name == "ddpm"
    info = load_model(dit_file, "SiT-S/2", overrides=ARCH)  # a SiT name: the SiT objective
    assert info.objective_name == "sit" and isinstance(
        create_objective(info.objective), SiTObjective
    )
    x = torch.zeros(1, C, SIDE, SIDE)
    spec = SampleSpec(method="ode", sampling_method="euler", num_steps=2)
    assert SamplingPipeline.for_model(info, spec).model(
        x, torch.ones(1), torch.ones(1).long()
    ).shape == (1, 2 * C, SIDE, SIDE)  # the full output: the transport reads the first C channels


def test_spec_modes_belong_to_their_objective():
    with pytest.raises(SettingError, match=naming("sampling_method='euler'", "method='ddpm'")):
        SampleSpec(method="ddpm", sampling_method="euler")
    with pytest.raises(ValueError, match="cfg_interval"):
        SampleSpec(method="ddim", cfg_interval=(0.2, 0.8))
    with pytest.raises(SettingError, match=naming("method='ddpm'", "sit", "ode", "sde")):
        SiTObjective(create_transport()).sampler(SampleSpec(method="ddpm"))
    assert SampleSpec(method="ddpm").sampling_method is None


@pytest.fixture(scope="module")
def ddpm_ckpt(tmp_path_factory):
    """Our training checkpoint of a tiny pixel-space model trained with the ddpm objective."""
    overrides = [
        "model.name=SiT-S/2",
        "model.depth=1",
        "model.hidden_size=32",
        "model.num_heads=2",
        "model.input_size=8",
        "model.in_channels=1",
        "model.num_classes=10",
        "model.learn_sigma=true",
        "transport.objective=ddpm",
        "sample.method=ddpm",
        "sample.num_steps=4",
        "vae.name=none",
    ]
    cfg = load_config("configs/demo.yaml", overrides)
    torch.manual_seed(0)
    model = create_model(
        "SiT-S/2",
        depth=1,
        hidden_size=32,
        num_heads=2,
        input_size=8,
        in_channels=1,
        num_classes=10,
        learn_sigma=True,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    state = {
        "model": model.state_dict(),
        "ema": model.state_dict(),
        "opt": {},
        "args": cfg,
        "step": 3,
    }
    return str(save_checkpoint(state, tmp_path_factory.mktemp("ddpm_run") / "checkpoints", step=3))


def test_cli_samples_our_ddpm_checkpoint_grid_equals_bulk(ddpm_ckpt, tmp_path, capsys):
    grid = [
        "grid",
        "--ckpt",
        ddpm_ckpt,
        "--num-images",
        "3",
        "--global-seed",
        "2",
        "--out",
        str(tmp_path / "g"),
        "--no-progress",
    ]
    assert sample.main(grid) == 0
    printed = capsys.readouterr().out
    assert (
        "objective ddpm" in printed and "method=ddpm" in printed and "NFE per image: 4" in printed
    )
    bulk = [
        "bulk",
        "--ckpt",
        ddpm_ckpt,
        "--num-fid-samples",
        "3",
        "--per-proc-batch-size",
        "2",
        "--global-seed",
        "2",
        "--out",
        str(tmp_path / "b"),
        "--no-progress",
    ]
    assert sample.main(bulk) == 0
    with np.load(tmp_path / "b" / "samples_3x8x8x3.npz") as f:
        images = f["arr_0"]
    from PIL import Image

    for i in range(3):
        with Image.open(tmp_path / "g" / f"{i:06d}.png") as im:
            assert np.array_equal(np.asarray(im), images[i, :, :, 0])
    assert (
        sample.main(
            [
                *grid[:-3],
                "--method",
                "ddim",
                "--num-sampling-steps",
                "6",
                "--out",
                str(tmp_path / "d"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "NFE per image: 6" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--method", "ode"], ("--method", "ode", "ddpm", "ddim", "0000003.pt")),
        (["--objective", "sit"], ("transport.objective=ddpm", "0000003.pt")),
        (["--prediction", "noise"], ("--prediction", "noise", "0000003.pt")),
        (["--sampling-method", "euler"], ("--sampling-method", "euler", "method='ddpm'")),
    ],
)
def test_cli_refuses_transport_flags_on_ddpm_models(ddpm_ckpt, tmp_path, capsys, extra, names):
    argv = [
        "grid",
        "--ckpt",
        ddpm_ckpt,
        "--num-images",
        "1",
        "--out",
        str(tmp_path),
        "--no-progress",
        *extra,
    ]
    assert sample.main(argv) == 2
    assert_names(one_sample_error(capsys, "grid"), *names)


def test_dit_protocol_flags_parse():
    args = sample.build_parser().parse_args(
        [
            "bulk",
            "--ckpt",
            "DiT-XL-2-256x256.pt",
            "--model",
            "DiT-XL/2",
            "--image-size",
            "256",
            "--method",
            "ddpm",
            "--num-sampling-steps",
            "250",
            "--cfg-scale",
            "1.5",
            "--cfg-channels",
            "3",
            "--out",
            "x",
        ]
    )
    info = LoadedModel(
        None,
        "DiT-XL/2",
        "official",
        32,
        4,
        1000,
        {"objective": "ddpm"},
        {"name": "stabilityai/sd-vae-ft-ema"},
    )
    spec = sample.resolve_spec(args, info.sample, create_objective(info.objective).methods[0])
    assert (spec.method, spec.num_steps, spec.cfg_scale, spec.cfg_channels) == ("ddpm", 250, 1.5, 3)
    no_method = sample.build_parser().parse_args(
        ["grid", "--ckpt", "DiT-XL-2-256x256.pt", "--model", "DiT-XL/2"]
    )
    assert (
        sample.resolve_spec(no_method, {}, "ddpm").method == "ddpm"
    )  # the objective's default sampler


class _ZeroEps(torch.nn.Module):
    """A 2C-channel ddpm model that predicts eps = 0: its x0 estimate x_t / sqrt(alpha_bar_t) is far out of
    [-1, 1], so clipping shows in every sample."""

    learn_sigma, num_classes = True, CLASSES

    def forward(self, x, t, y):
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])


@pytest.mark.parametrize("method", ["ddpm", "ddim"])
def test_pixel_space_samples_clip_x0_latent_ones_do_not(method):
    diffusion = create_diffusion("", noise_schedule="cosine")
    spec = SampleSpec(method=method, num_steps=10)
    shape = (C, SIDE, SIDE)
    pixel = SamplingPipeline(_ZeroEps(), diffusion, spec, shape, CLASSES)  # no decoder: pixel space
    latent = SamplingPipeline(_ZeroEps(), diffusion, spec, shape, CLASSES, decode=lambda x: x)
    x_pixel = pixel.generate([0, 1], 0, labels=[0, 1]).pixels
    x_latent = latent.generate([0, 1], 0, labels=[0, 1]).pixels
    # the last step returns the (clipped) x0 estimate: ADM's image convention keeps it in [-1, 1]
    assert x_pixel.abs().max() <= 1 and x_latent.abs().max() > 10
    # the same by hand with DiT's API: clip_denoised=True in pixel space, False (DiT) for latents
    spaced = create_diffusion(("" if method == "ddpm" else "ddim") + "10", noise_schedule="cosine")
    loop = spaced.p_sample_loop if method == "ddpm" else spaced.ddim_sample_loop
    gens = [torch.Generator().manual_seed(sample_seed(0, i)) for i in range(2)]
    z = torch.stack([torch.randn(shape, generator=g) for g in gens])
    for clip, got in ((True, x_pixel), (False, x_latent)):
        gens = [torch.Generator().manual_seed(sample_seed(0, i)) for i in range(2)]
        [torch.randn(shape, generator=g) for g in gens]  # advance past the initial noise, as generate does
        expected = loop(_ZeroEps(), z.shape, z.clone(), clip_denoised=clip,
                        model_kwargs=dict(y=torch.tensor([0, 1])), generator=gens)
        assert torch.equal(got, expected)


def test_loaded_checkpoints_know_whether_they_sample_pixels(dit_file):
    info = load_model(dit_file, "DiT-S/2", overrides=ARCH)  # DiT: SD-VAE latents
    assert not SamplingPipeline.for_model(info, SampleSpec(method="ddpm", num_steps=5)).sampler.clip_denoised
    info.vae = {"name": "none"}
    assert SamplingPipeline.for_model(info, SampleSpec(method="ddpm", num_steps=5)).sampler.clip_denoised


def test_ddim_eta_reaches_the_sampler_through_the_spec():
    """DDIM's eta is one SampleSpec field: sample.py's --eta, the whole-trajectory sampler and the step-wise
    steps all take it; eta 0 is deterministic, eta 1 draws noise from the per-sample generators, and the
    step-wise loop over the objective's steps gives the whole trajectory's pixels for either."""
    model = create_model("SiT-S/2", input_size=SIDE, in_channels=C, num_classes=CLASSES, **ARCH)
    model.load_state_dict({**dit_state_dict(), "pos_embed": model.pos_embed}, strict=True)
    objective = create_objective({"objective": "ddpm", "diffusion_steps": 100})
    pixels = {}
    for eta in (0.0, 1.0):
        spec = SampleSpec(method="ddim", num_steps=5, eta=eta)
        pipe = SamplingPipeline(model, objective, spec, (C, SIDE, SIDE), CLASSES)
        whole = pipe.generate([0, 1], 3, labels=[2, 5])
        stepped = pipe.generate([0, 1], 3, labels=[2, 5], steps=pipe.steps())
        assert torch.equal(whole.pixels, stepped.pixels) and whole.nfe == stepped.nfe == 5
        pixels[eta] = whole.pixels
    assert not torch.allclose(pixels[0.0], pixels[1.0], atol=1e-3)  # eta 1 adds noise
    args = sample.build_parser().parse_args(["grid", "--ckpt", "x.pt", "--method", "ddim", "--eta", "0.5"])
    assert sample.resolve_spec(args, {}).eta == 0.5
    with pytest.raises(ValueError) as err:  # SettingError naming the field
        SampleSpec(method="ddim", eta=-0.1)
    assert "eta" in str(err.value)
