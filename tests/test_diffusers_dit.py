"""diffusers' DiT format both ways (sit_vit5.models.diffusers_dit), against diffusers' own
DiTTransformer2DModel and DiTPipeline, on tiny random models built from config (no downloads)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    DPMSolverMultistepScheduler,
)

from sit_vit5.diffusion.schedule import named_betas
from sit_vit5.export import FEW_STEP_FOLDER
from sit_vit5.export import main as export_main
from sit_vit5.models import CheckpointError, create_model, load_model
from sit_vit5.models.diffusers_dit import (
    dit_config,
    dit_pipeline,
    dit_scheduler,
    folder_schedule,
    from_diffusers_dit,
    from_diffusers_state,
    to_diffusers_dit,
    to_diffusers_state,
)
from sit_vit5.models.layers import sincos_pos_embed_2d
from sit_vit5.objective import DDPM_DEFAULTS, create_objective
from sit_vit5.sample_spec import FEW_STEPS, SampleSpec
from tests.helpers import naming
from tests.test_models import TINY, randomize

C = 4  # latent channels
#: the largest |ours - diffusers| the issue allows (eps and sigma halves alike)
TOL = 1e-5


def tiny_dit(learn_sigma: bool = True, seed: int = 0, tied: bool = True,
             **config) -> DiTTransformer2DModel:
    """A random DiTTransformer2DModel (2 blocks, width 64, 8x8 latents, 1000 classes: DiTPipeline's
    null class is 1000). ``tied``: every block holds the same embedders, as a converted DiT does."""
    torch.manual_seed(seed)
    dit = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=C,
                                out_channels=2 * C if learn_sigma else C, num_layers=2,
                                sample_size=8, patch_size=2, num_embeds_ada_norm=1000, **config)
    with torch.no_grad():
        for p in dit.parameters():  # diffusers' init is not the zero adaLN one; random all over
            p.copy_(torch.randn_like(p) * 0.1)
        if tied:
            first = dit.transformer_blocks[0].norm1.emb.state_dict()
            for block in dit.transformer_blocks[1:]:
                block.norm1.emb.load_state_dict(first)
    return dit.eval()


def dit_inputs(b: int = 4, seed: int = 1):
    """x, DiT's integer timesteps (both ends included) and labels (the null class 1000 included)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, C, 8, 8, generator=g)
    t = torch.tensor([0, 999, *torch.randint(0, 1000, (b - 2,), generator=g).tolist()])
    y = torch.tensor([1000, *torch.randint(0, 1000, (b - 1,), generator=g).tolist()])
    return x, t, y


def random_dit(**overrides):
    """Our tiny DiT with random weights, its fixed sin-cos table kept (diffusers recomputes it)."""
    model = randomize(create_model("DiT-S/2", **{**TINY, "num_classes": 1000}, **overrides)).eval()
    model.pos_embed.data.copy_(sincos_pos_embed_2d(64, 4)[None])
    return model


def diffusers_out(dit: DiTTransformer2DModel, x, t, y) -> torch.Tensor:
    with torch.no_grad():
        return dit(x, timestep=t, class_labels=y).sample


def ours_out(model, x, t, y) -> torch.Tensor:
    with torch.no_grad():
        return model(x, t, y)


def max_diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, ...]:
    """Max |a - b| of the eps half, then (2C outputs) of the sigma half."""
    d = (a - b).abs()
    return tuple(float(d[:, i:i + C].max()) for i in range(0, a.shape[1], C))


@pytest.mark.parametrize("learn_sigma", [True, False])
@pytest.mark.parametrize("norm_eps", [None, 1e-6])  # None: the class default, as the hub's config
def test_diffusers_to_ours_gives_diffusers_eps_and_sigma(tmp_path, learn_sigma, norm_eps):
    dit = tiny_dit(learn_sigma, **({} if norm_eps is None else {"norm_eps": norm_eps}))
    dit.save_pretrained(tmp_path)
    model = from_diffusers_dit(tmp_path)
    assert model.learn_sigma is learn_sigma and not model.training
    assert (model.num_classes, model.input_size, len(model.blocks)) == (1000, 8, 2)
    x, t, y = dit_inputs()
    want, got = diffusers_out(dit, x, t, y), ours_out(model, x, t, y)
    assert want.shape == got.shape == (4, 2 * C if learn_sigma else C, 8, 8)
    diffs = max_diffs(got, want)
    print(f"diffusers -> ours, max |diff| eps/sigma: {diffs}")
    assert max(diffs) <= TOL
    assert float(want.abs().max()) > 0.5  # outputs big enough for the bound to mean something
    # an instance converts the same as its folder
    assert torch.equal(ours_out(from_diffusers_dit(dit), x, t, y), got)


def test_ours_to_diffusers_gives_our_eps_and_sigma(tmp_path):
    model = random_dit(t_freq_shift=1, mlp_norm_eps=1e-5)
    dit = to_diffusers_dit(model)
    assert dit.config.out_channels == 2 * C and dit.config.norm_eps == 1e-5
    x, t, y = dit_inputs()
    diffs = max_diffs(diffusers_out(dit, x, t, y), ours_out(model, x, t, y))
    print(f"ours -> diffusers, max |diff| eps/sigma: {diffs}")
    assert len(diffs) == 2 and max(diffs) <= TOL
    dit.save_pretrained(tmp_path)  # the folder diffusers itself loads, strictly
    again, info = DiTTransformer2DModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values())
    assert torch.equal(diffusers_out(again.eval(), x, t, y), diffusers_out(dit, x, t, y))
    back = from_diffusers_dit(tmp_path)  # and the round trip is exact
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_our_dit_frequencies_are_converted_with_a_warning_not_silently():
    """Models trained here use DiT's timestep frequencies, which DiTTransformer2DModel cannot
    express: the conversion warns, and the outputs do differ (as diffusers' own DiT-XL-2-256
    differs from DiT)."""
    model = random_dit()
    with pytest.warns(UserWarning, match=naming("1e4^(-i/127)", "1e4^(-i/128)")):
        dit = to_diffusers_dit(model)
    x, t, y = dit_inputs()
    assert max(max_diffs(diffusers_out(dit, x, t, y), ours_out(model, x, t, y))) > 1e-3


def test_the_rename_table_covers_both_layouts_and_the_fixed_tables_agree():
    dit = tiny_dit()
    ours = from_diffusers_dit(dit)
    # every tensor on both sides is named by the table, except the fixed sin-cos table
    assert set(from_diffusers_state(dit.state_dict(), 2)) == set(ours.state_dict()) - {"pos_embed"}
    assert set(to_diffusers_state(ours.state_dict(), 2)) == set(dit.state_dict())
    # diffusers recomputes DiT's table (a buffer): the same layout (columns first) as ours, in fp32
    table = dit.pos_embed.pos_embed[0]
    assert torch.allclose(table, sincos_pos_embed_2d(64, 4), atol=1e-6)
    assert torch.allclose(ours.pos_embed[0], table, atol=1e-6)


def test_untied_embedders_and_foreign_architectures_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=naming("transformer_blocks.N.norm1.emb.timestep_embedder")):
        from_diffusers_dit(tiny_dit(tied=False))
    with pytest.raises(CheckpointError, match="activation_fn"):
        from_diffusers_dit(tiny_dit(activation_fn="geglu"))
    tiny_dit().save_pretrained(tmp_path / "pixart")  # another Transformer2DModel family
    config = json.loads((tmp_path / "pixart" / "config.json").read_text())
    config.update(_class_name="Transformer2DModel", norm_type="ada_norm_single")
    (tmp_path / "pixart" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=naming(tmp_path / "pixart", "ada_norm_single")):
        from_diffusers_dit(tmp_path / "pixart")
    vit5 = create_model("ViT5-S/2", **TINY)
    with pytest.raises(CheckpointError, match=naming("ViT5", "rmsnorm")):
        dit_config(vit5)
    with pytest.raises(CheckpointError, match=naming("pos_embed")):
        to_diffusers_dit(randomize(create_model("DiT-S/2", **TINY, t_freq_shift=1)))
    create_model("SiT-S/2", **TINY).save_pretrained(tmp_path / "sit")
    with pytest.raises(CheckpointError, match=naming(tmp_path / "sit", "config.json")):
        from_diffusers_dit(tmp_path / "sit")


def test_the_hubs_transformer2dmodel_config_is_read_as_dit(tmp_path):
    """facebook/DiT-XL-2-256's transformer/config.json predates DiTTransformer2DModel: class
    Transformer2DModel, no norm_eps (so 1e-5) and a few cross-attention keys."""
    dit = tiny_dit()
    dit.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("norm_eps")
    config.update(_class_name="Transformer2DModel", cross_attention_dim=None,
                  num_vector_embeds=None, only_cross_attention=False, use_linear_projection=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = from_diffusers_dit(tmp_path)
    assert model.blocks[0].norm2.eps == 1e-5
    x, t, y = dit_inputs()
    assert max(max_diffs(ours_out(model, x, t, y), diffusers_out(dit, x, t, y))) <= TOL


# ----------------------------------------------------------------------------- DiTPipeline


def _images(pipe: DiTPipeline, scheduler=None, steps: int = 3) -> np.ndarray:
    if scheduler is not None:
        pipe.scheduler = scheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe(class_labels=[1, 207], guidance_scale=4.0, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(0), output_type="np").images


@pytest.mark.parametrize("scheduler", [None, DPMSolverMultistepScheduler])  # DDIM, Karras-family
def test_dit_pipeline_samples_our_export_as_it_samples_the_original(tmp_path, vae_dir, scheduler):
    """DiT folder -> our model (load_model) -> ``export --format dit`` -> diffusers' DiTPipeline:
    the same images as DiTPipeline on the original DiTTransformer2DModel."""
    dit = tiny_dit()
    dit.save_pretrained(tmp_path / "dit")
    loaded = load_model(tmp_path / "dit")
    assert (loaded.source, loaded.objective_name) == ("diffusers", "ddpm")
    assert loaded.name == "DiT (depth 2, hidden 64, heads 4, patch 2)"  # no registry size
    assert loaded.objective["ddpm_variance"] == "learned"
    out = tmp_path / "export"
    with warnings.catch_warnings():  # a model converted from diffusers converts back exactly
        warnings.filterwarnings("error", message=".*only approximates")
        assert export_main([str(tmp_path / "dit"), str(out), "--format", "dit", "--vae",
                            str(vae_dir)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "DiTPipeline"
    assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    assert index["scheduler"] == ["diffusers", "DDIMScheduler"]
    ours = DiTPipeline.from_pretrained(out)
    original = DiTPipeline(transformer=dit, vae=AutoencoderKL.from_pretrained(out / "vae"),
                           scheduler=DDIMScheduler.from_pretrained(out / "scheduler"))
    images = _images(ours, scheduler)
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()
    assert np.array_equal(images, _images(original, scheduler))


def test_a_dit_format_export_carries_the_few_step_solver_on_its_own_noise_schedule(tmp_path, vae_dir):
    """``export --format dit`` writes scheduler_fewstep/: sample.py's few-step solver for the model
    (DPM-Solver++ 2M SDE), on the betas of the folder's own scheduler; swapped into DiTPipeline it
    takes one transformer call a step."""
    tiny_dit().save_pretrained(tmp_path / "dit")
    out = tmp_path / "export"
    assert export_main([str(tmp_path / "dit"), str(out), "--format", "dit", "--vae", str(vae_dir)]) == 0
    few = DPMSolverMultistepScheduler.from_pretrained(out, subfolder=FEW_STEP_FOLDER)
    setting = FEW_STEPS["ddpm"]
    ours = create_objective(load_model(tmp_path / "dit").objective).steps(
        SampleSpec(**setting), pixel_space=False).scheduler
    for key in ("algorithm_type", "solver_order", "prediction_type", "thresholding", "trained_betas"):
        assert few.config[key] == ours.config[key], key
    assert few.config.algorithm_type == "sde-dpmsolver++" and not few.config.thresholding
    pipe = DiTPipeline.from_pretrained(out)
    torch.testing.assert_close(few.alphas_cumprod, pipe.scheduler.alphas_cumprod, rtol=0, atol=1e-6)
    calls = []
    pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    pipe.scheduler = few
    pipe.set_progress_bar_config(disable=True)
    images = pipe(class_labels=[1, 207], guidance_scale=4.0, num_inference_steps=setting["num_steps"],
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()
    assert len(calls) == SampleSpec(**setting).nfe == 12


def test_a_pipeline_folder_loads_with_its_vae_and_schedule(tmp_path, vae_dir):
    """load_model on a DiTPipeline folder (the hub's layout): its transformer, vae/ and scale;
    sample.py --ckpt takes it too."""
    dit = tiny_dit()
    vae = AutoencoderKL.from_pretrained(vae_dir)
    scheduler = DDIMScheduler(beta_schedule="linear", beta_start=1e-4, beta_end=0.02,
                              clip_sample=False)
    DiTPipeline(transformer=dit, vae=vae, scheduler=scheduler).save_pretrained(tmp_path / "pipe")
    loaded = load_model(tmp_path / "pipe")
    assert loaded.vae["name"] == str(tmp_path / "pipe" / "vae")
    assert loaded.objective == {"objective": "ddpm", "ddpm_variance": "learned", "diffusion_steps": 1000,
                                "noise_schedule": "linear"}
    x, t, y = dit_inputs()
    assert max(max_diffs(ours_out(loaded.model, x, t, y), diffusers_out(dit, x, t, y))) <= TOL
    from sit_vit5.cli import sample

    args = ["grid", "--ckpt", str(tmp_path / "pipe"), "--classes", "1", "2", "--num-steps", "2",
            "--out", str(tmp_path / "grid"), "--no-progress"]
    assert sample.main(args) == 0
    assert len(list((tmp_path / "grid").glob("0*.png"))) == 2
    bad = json.loads((tmp_path / "pipe" / "scheduler" / "scheduler_config.json").read_text())
    bad["beta_end"] = 0.012
    (tmp_path / "pipe" / "scheduler" / "scheduler_config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=naming(tmp_path / "pipe" / "scheduler" / "scheduler_config.json")):
        load_model(tmp_path / "pipe")


@pytest.mark.parametrize(("schedule", "steps"), [("linear", 1000), ("linear", 250),
                                                 ("cosine", 1000)])
def test_noise_schedules_map_to_diffusers_betas_and_back(tmp_path, schedule, steps):
    scheduler = dit_scheduler({"noise_schedule": schedule, "diffusion_steps": steps})
    assert torch.allclose(scheduler.betas.double(), named_betas(schedule, steps), atol=1e-7)
    scheduler.save_pretrained(tmp_path / "scheduler")
    assert folder_schedule(tmp_path) == {"diffusion_steps": steps, "noise_schedule": schedule}


def test_dit_pipeline_refuses_what_it_cannot_sample(tmp_path, vae_dir, capsys):
    ckpt = tmp_path / "SiT-S-2.pt"
    torch.save(create_model("SiT-S/2", **{**TINY, "num_classes": 1000}).state_dict(), ckpt)
    sizes = dict(depth=2, hidden_size=64, num_heads=4)
    vae = AutoencoderKL.from_pretrained(vae_dir)
    with pytest.raises(CheckpointError, match=naming("SiT-S/2", "sit", "ddpm")):
        dit_pipeline(load_model(ckpt, "SiT-S/2", overrides=sizes), vae, DDPM_DEFAULTS)
    with pytest.raises(CheckpointError, match=naming("DiT-S/2", "VAE")):
        dit_pipeline(load_model(ckpt, "DiT-S/2", overrides=sizes), None, DDPM_DEFAULTS)
    dit = tiny_dit()
    dit.save_pretrained(tmp_path / "dit")
    assert export_main([str(tmp_path / "dit"), str(tmp_path / "out"), "--format", "dit",
                        "--vae", "none"]) == 2  # the CLI: one line, no folder
    assert "VAE" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_sample_py_bulk_takes_a_diffusers_dit_folder_and_records_its_digest(tmp_path, vae_dir, capsys):
    import sample
    from sit_vit5.utils.checksums import sha256_tree

    folder = tmp_path / "dit"
    tiny_dit().save_pretrained(folder)
    out = tmp_path / "bulk"
    argv = ["bulk", "--ckpt", str(folder), "--vae", str(vae_dir), "--num-samples", "2", "--num-steps", "2",
            "--out", str(out), "--no-progress"]
    assert sample.main(argv) == 0, capsys.readouterr().err  # it read the folder as a file before
    npz = np.load(next(out.glob("samples_*.npz")))
    assert npz["arr_0"].shape[0] == 2
    assert json.loads(str(npz["metadata_json"]))["checkpoint_sha256"] == sha256_tree(folder)
