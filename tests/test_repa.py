"""REPA (sit_vit5/training/repa.py) on tiny models made here: the projector's layout, the
loss against an independent computation, the gradient only where it belongs (the encoder frozen),
coeff 0 = training without REPA bit for bit, exact resume, registers left out, the one-line errors
(token grid, offline download, bad keys), timm / torch.hub / digits encoders without downloads, and
REPA from a latent cache with its images read beside it (``data.image_root``)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sit_vit5.config import ConfigError, configs_dir, load_config
from sit_vit5.models import load_model
from sit_vit5.training import read_checkpoint, train
from sit_vit5.training import repa as R
from sit_vit5.training.build import build
from sit_vit5.training.loop import train_step
from tests.helpers import assert_names, assert_states_equal, make_image_folder, naming, run_train

#: A tiny ViT5 (registers on) on the 8×8 digits; REPA: the digits encoder, a small projector.
TINY = [
    "model.name=ViT5-S/2",
    "model.depth=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.learn_sigma=false",
    "data.kind=digits",
    "data.image_size=8",
    "data.random_flip=false",
    "data.num_workers=0",
    "vae.name=none",
    "optim.lr=1e-3",
    "optim.ema_decay=0.9",
    "optim.grad_clip=1.0",
    "train.tensorboard=false",
    "train.sample_every=0",
    "train.log_every=1",
    "train.milestone_every=0",
    "train.keep_last=5",
    "data.global_batch_size=16",
]
REPA = ["repa.encoder=digits", "repa.depth=1", "repa.projector_dim=32"]


def cfg_of(tmp_path, name, *extra):
    return load_config(None, [*TINY, f"train.out_dir={tmp_path / name}", *extra])


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    """A random timm ViT saved as a local folder (timm's HF layout): 16 px, patch 4: 4×4 tokens."""
    timm = pytest.importorskip("timm")
    from timm.models import save_for_hf

    torch.manual_seed(0)
    net = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        embed_dim=24,
        depth=1,
        num_heads=2,
        num_classes=0,
    )
    path = tmp_path_factory.mktemp("tiny_vit")
    save_for_hf(net, str(path), safe_serialization=True)
    return path


# ----------------------------------------------------------------------------- the pieces


def test_projector_is_reprs_three_linear_silu_mlp():
    proj = R.Projector(32, 64, 24).reset_parameters(torch.Generator().manual_seed(0))
    kinds = [type(m).__name__ for m in proj]
    assert kinds == ["Linear", "SiLU", "Linear", "SiLU", "Linear"]
    assert [(m.in_features, m.out_features) for m in proj if isinstance(m, torch.nn.Linear)] == [
        (32, 64),
        (64, 64),
        (64, 24),
    ]
    assert all(torch.count_nonzero(m.bias) == 0 for m in proj if isinstance(m, torch.nn.Linear))
    bound = (6 / (32 + 64)) ** 0.5  # xavier-uniform
    assert 0.9 * bound < proj[0].weight.abs().max() <= bound
    assert proj(torch.randn(2, 5, 32)).shape == (2, 5, 24)


def test_alignment_loss_is_the_mean_negative_cosine_similarity():
    torch.manual_seed(0)
    h, z = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    per_image = R.alignment_loss(h, z)
    assert per_image.shape == (3,)
    independent = torch.stack([-F.cosine_similarity(h[b], z[b], dim=-1).mean() for b in range(3)])
    torch.testing.assert_close(per_image, independent)
    assert R.alignment_loss(z * 3.0, z) == pytest.approx([-1.0] * 3)  # aligned = -1, scale-free
    with pytest.raises(ConfigError, match="shape"):
        R.alignment_loss(h, z[:, :4])


def test_capture_takes_the_patch_tokens_of_the_forward_without_the_registers():
    from sit_vit5.models import create_model

    model = create_model(
        "ViT5-S/2",
        input_size=8,
        in_channels=1,
        num_classes=10,
        depth=3,
        hidden_size=32,
        num_heads=2,
        learn_sigma=False,
    )
    assert model.num_registers == 4
    seen = []
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    capture = R.HiddenCapture(model, depth=2)
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    model(x, t, y)  # not armed: nothing kept
    with pytest.raises(RuntimeError, match="0 forwards"):
        capture.take()
    with capture.armed():
        model(x, t, y)
    hidden = capture.take()
    assert hidden.shape == (2, 16, 32) and seen[-1].shape == (2, 16 + 4, 32)
    assert torch.equal(hidden.detach(), seen[-1][:, :16]) and hidden.requires_grad
    with pytest.raises(ConfigError, match=naming("repa.depth=4", "3")):
        R.HiddenCapture(model, depth=4)


def test_digits_encoder_gives_the_feature_maps_at_both_grids():
    enc8 = R.load_encoder({"encoder": "digits"}, 8, (4, 4), 1)
    enc16 = R.load_encoder({"encoder": "digits"}, 16, (8, 8), 1)
    assert enc8.feature_dim == enc16.feature_dim == 64
    assert enc8(torch.zeros(2, 1, 8, 8)).shape == (2, 16, 64)
    assert enc16(torch.zeros(2, 1, 16, 16)).shape == (2, 64, 64)
    assert all(not p.requires_grad for p in enc8.parameters())
    with pytest.raises(ConfigError, match=naming("16", "4×4", "2×2")):
        R.load_encoder({"encoder": "digits"}, 8, (2, 2), 1)


def test_timm_folder_encoder_resizes_to_the_model_grid(tiny_vit):
    enc = R.load_encoder({"encoder": str(tiny_vit)}, 8, (4, 4), 1)
    assert enc.resolution == (16, 16) and enc.prefix_tokens == 1 and enc.feature_dim == 24
    x = torch.rand(2, 1, 8, 8) * 2 - 1
    expected_input = F.interpolate(
        ((x.expand(-1, 3, -1, -1) + 1) / 2 - 0.5) / 0.5, size=(16, 16), mode="bicubic"
    )  # the folder's cfg: mean = std = 0.5
    torch.testing.assert_close(enc.preprocess(x), expected_input)
    assert enc(x).shape == (2, 16, 24)
    enc8 = R.load_encoder({"encoder": str(tiny_vit)}, 8, (2, 2), 1)  # 8 px: 2×2 patches of 4
    assert enc8.resolution == (8, 8) and enc8(x).shape == (2, 4, 24)


def test_hub_encoder_from_a_local_checkout(tmp_path):
    """torch.hub's path with a local repository: DINOv2's layout (dict of x_norm_patchtokens, a
    class-token position table resampled once to the grid, registers dropped)."""
    pytest.importorskip("timm")
    (tmp_path / "hubconf.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.patch_size, self.num_register_tokens = 2, 2
                self.patch_embed = nn.Module()
                self.patch_embed.proj = nn.Conv2d(3, 8, 2, 2)
                self.patch_embed.patch_size = (2, 2)
                self.pos_embed = nn.Parameter(torch.randn(1, 1 + 9, 8))  # 3×3 at training
                self.head = nn.Linear(8, 3)

            def forward_features(self, x):
                t = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
                assert t.shape[1] + 1 == self.pos_embed.shape[1], "table not resampled"
                return {"x_norm_patchtokens": t + self.pos_embed[:, 1:]}

        def tiny():
            torch.manual_seed(0)
            return Tiny()
    """)
    )
    enc = R.load_encoder({"encoder": f"hub:{tmp_path}:tiny"}, 8, (4, 4), 3)
    assert enc.resolution == (8, 8) and enc.net.pos_embed.shape == (1, 17, 8)
    assert enc(torch.zeros(2, 3, 8, 8)).shape == (2, 16, 8) and enc.prefix_tokens == 3


def test_offline_timm_encoder_names_what_to_download(monkeypatch):
    pytest.importorskip("timm")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    spec = "timm:vit_tiny_patch16_224.augreg_in21k"
    with pytest.raises(ConfigError) as err:
        R.load_encoder({"encoder": spec}, 8, (4, 4), 1)
    message = str(err.value)
    assert "hf download timm/vit_tiny_patch16_224.augreg_in21k" in message
    assert "\n" not in message and spec in message
    with pytest.raises(ConfigError, match="not a timm model name"):
        R.load_encoder({"encoder": "timm:no_such_net"}, 8, (4, 4), 1)
    with pytest.raises(ConfigError, match="not a folder"):
        R.load_encoder({"encoder": "/no/such/encoder"}, 8, (4, 4), 1)


@pytest.mark.parametrize(
    "override, words",
    [
        ("repa.coeff=-1", "repa.coeff=-1"),
        ("repa.depth=0", "repa.depth=0"),
        ("repa.std=[0.5,0]", "repa.std"),
        ("repa.interpolation=lanczos", "repa.interpolation"),
        ("repa.weights=/x.pt", "repa.weights"),
    ],
)
def test_bad_repa_keys_are_config_errors(override, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        load_config(None, [*TINY, *REPA, override])


def test_repa_is_off_by_default_and_refused_without_images():
    assert load_config(None, TINY)["repa"]["encoder"] is None
    with pytest.raises(ConfigError, match="set data.image_root to the ImageFolder the cache was made from"):
        load_config(None, [*TINY, *REPA, "data.kind=latents"])
    with pytest.raises(ConfigError, match="data.image_root='x' is read only with data.kind=latents"):
        load_config(None, [*TINY, *REPA, "data.image_root=x"])


# ----------------------------------------------------------------------------- latents + images


@pytest.fixture(scope="module")
def latent_cache(tmp_path_factory, vae_dir):
    """20 random images (two classes, varied sizes) and their latent cache at 16 px through the tiny
    VAE (factor 2: 4×8×8 latents, the 4×4 patch grid of ``tiny_vit``)."""
    from sit_vit5 import cache_latents

    root = make_image_folder(tmp_path_factory.mktemp("repa") / "images", {"cat": 10, "dog": 10})
    cache = tmp_path_factory.mktemp("repa_cache")
    cache_latents.main(["--data-dir", str(root), "--out", str(cache), "--vae", str(vae_dir), "--image-size",
                        "16", "--batch-size", "8", "--shard-size", "8", "--num-workers", "0"])
    return root, cache


def latents_repa(tmp_path, name, latent_cache, vae_dir, tiny_vit, *extra):
    root, cache = latent_cache
    return cfg_of(tmp_path, name, "data.kind=latents", f"data.root={cache}", f"data.image_root={root}",
                  "data.image_size=16", "data.random_flip=true", f"vae.name={vae_dir}", f"repa.encoder={tiny_vit}",
                  "repa.depth=1", "repa.projector_dim=16", *extra)


def test_cached_latents_come_with_their_own_images_cropped_and_flipped_alike(latent_cache):
    """Each item's image is the ImageFolder's item (same crop, same flip draw) and its latent is the
    one the cache gives without images (the same draws)."""
    from sit_vit5.image_data import ImageFolderDataset
    from sit_vit5.latent_cache import LatentCacheDataset

    root, cache = latent_cache
    with_images = LatentCacheDataset(cache, random_flip=True, seed=3, image_root=root)
    plain = LatentCacheDataset(cache, random_flip=True, seed=3)
    folder = ImageFolderDataset(root, 16, random_flip=True, seed=3)
    flips = 0
    for epoch in (0, 1):
        for d in (with_images, plain, folder):
            d.set_epoch(epoch)
        for i in range(len(folder)):
            latent, label, image = with_images[i]
            expected, expected_label = folder[i]
            assert torch.equal(image, expected) and label == expected_label
            assert torch.equal(latent, plain[i][0])
            flips += not torch.equal(image, folder.read(i))
    assert 0 < flips < 2 * len(folder)  # both orientations were drawn


def test_repa_from_cached_latents_feeds_the_images_to_the_encoder(latent_cache, vae_dir, tiny_vit, tmp_path):
    run = build(latents_repa(tmp_path, "r", latent_cache, vae_dir, tiny_vit, "train.steps=1"), None)
    assert not run.encode_on_the_fly  # the VAE is not run on the images: the cache holds the latents
    x, y, images = next(iter(run.loader))
    assert x.shape[1:] == (4, 8, 8) and images.shape[1:] == (3, 16, 16)
    seen, features = [], run.repa.features
    run.repa.features = lambda pixels: seen.append(pixels) or features(pixels)
    loss, _ = train_step(run, x, y, 1e-3, images)
    assert len(seen) == 1 and torch.equal(seen[0], images)
    assert loss == pytest.approx(run.repa.last_metrics["loss_diffusion"]
                                 + 0.5 * run.repa.last_metrics["loss_repa"], rel=1e-6)
    run.logger.close()


def test_repa_from_cached_latents_resumes_exactly(latent_cache, vae_dir, tiny_vit, tmp_path):
    def cfg(name, steps):
        return latents_repa(tmp_path, name, latent_cache, vae_dir, tiny_vit, f"train.steps={steps}",
                            "train.ckpt_every=2")

    straight = train(cfg("straight", 4))
    first = train(cfg("resumed", 2))
    resumed = train(cfg("resumed", 4), resume="latest")
    assert first.losses + resumed.losses == straight.losses
    a, b = read_checkpoint(straight.checkpoint), read_checkpoint(resumed.checkpoint)
    for key in ("model", "ema", "opt", "repa"):
        assert_states_equal(a[key], b[key], key)


def test_images_beside_latents_must_be_the_cached_ones(latent_cache, tmp_path):
    import shutil

    from PIL import Image

    from sit_vit5.datasets import DataRootError
    from sit_vit5.latent_cache import CacheMismatchError, LatentCacheDataset

    root, cache = latent_cache
    with pytest.raises(DataRootError, match="is not a folder"):
        LatentCacheDataset(cache, image_root=tmp_path / "nowhere")
    (tmp_path / "other" / "cat").mkdir(parents=True)
    with pytest.raises(CacheMismatchError, match=r"has no cat/0.png, an image of the latent cache"):
        LatentCacheDataset(cache, image_root=tmp_path / "other")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    dataset = LatentCacheDataset(cache, random_flip=False, image_root=copy)
    Image.new("RGB", (40, 40)).save(copy / "cat" / "3.png")  # replaced after the cache was made
    with pytest.raises(CacheMismatchError, match=r"cat/3.png: \d+ bytes, \d+ when the latent cache"):
        dataset[3]
    assert dataset[4][2].shape == (3, 16, 16)


# ----------------------------------------------------------------------------- training


def test_encoder_frozen_projector_and_model_trained(tmp_path):
    run = build(cfg_of(tmp_path, "r", *REPA, "train.steps=1"), None)
    enc_before = {k: v.clone() for k, v in run.repa.encoder.state_dict().items()}
    proj_before = [p.detach().clone() for p in run.repa.parameters()]
    x, y = next(iter(run.loader))
    loss, _ = train_step(run, x, y, 1e-3)
    assert all(p.grad is None and not p.requires_grad for p in run.repa.encoder.parameters())
    assert_states_equal(run.repa.encoder.state_dict(), enc_before)
    assert not run.repa.encoder.training and run.repa.projector.training
    grads = [p.grad for p in run.repa.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    assert all(not torch.equal(a, b) for a, b in zip(proj_before, run.repa.parameters()))
    metrics = run.repa.last_metrics
    assert loss == pytest.approx(metrics["loss_diffusion"] + 0.5 * metrics["loss_repa"], rel=1e-6)
    assert -1 <= metrics["loss_repa"] <= 1
    # the EMA (and so every export) has no projector, and no hook of its own
    assert set(run.ema.state_dict()) == set(run.unwrapped.state_dict())
    assert not run.ema.blocks[0]._forward_hooks
    run.logger.close()


def test_logged_alignment_loss_equals_an_independent_computation(tmp_path):
    """The step's loss_repa from the hook equals the same draws recomputed by hand: the model's
    blocks run one by one, block 1's output without its registers, projected, negative cosine."""
    from sit_vit5.training.loop import SALT_NOISE
    from sit_vit5.transport.rng import mix_seed

    run = build(cfg_of(tmp_path, "r", *REPA, "train.steps=1", "optim.lr=1e-12"), None)
    model, proj = run.unwrapped, run.repa.projector
    x, y = next(iter(run.loader))
    projector_state = {k: v.clone() for k, v in proj.state_dict().items()}
    torch.manual_seed(mix_seed(0, 0, 0, SALT_NOISE))  # the step's noise: t, x0, then the label drop
    t, x0, x1 = run.objective.transport.sample(x)
    _, xt, _ = run.objective.transport.path_sampler.plan(t, x0, x1)
    h = model.x_embedder(xt) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, True)
    h = torch.cat([h, model.register_tokens.expand(len(x), -1, -1)], dim=1)
    h = model.blocks[0](h, c, model.rope(model.grid, h.device, h.dtype))[:, :16]
    proj.load_state_dict(projector_state)
    z = run.repa.encoder(x)
    expected = -F.cosine_similarity(proj(h), z, dim=-1).mean()
    train_step(run, x, y, 1e-12)
    assert run.repa.last_metrics["loss_repa"] == pytest.approx(expected.item(), rel=1e-5)
    run.logger.close()


def test_coeff_zero_trains_bit_identically_to_no_repa(tmp_path):
    """With clipping on (grad_clip 1.0: the joint norm must reduce to the model's exactly)."""
    plain = train(cfg_of(tmp_path, "plain", "train.steps=3", "optim.grad_clip=0.05"))
    zero = train(
        cfg_of(tmp_path, "zero", *REPA, "repa.coeff=0", "train.steps=3", "optim.grad_clip=0.05")
    )
    assert plain.losses == zero.losses
    a, b = read_checkpoint(plain.checkpoint), read_checkpoint(zero.checkpoint)
    for key in ("model", "ema", "opt"):
        assert_states_equal(a[key], b[key], key)
    assert [r["grad_norm"] for r in rows(plain.run_dir)] == [
        r["grad_norm"] for r in rows(zero.run_dir)
    ]
    assert "repa" in b and "repa" not in a
    assert all(r["loss_diffusion"] == r["loss"] for r in rows(zero.run_dir))


def test_repa_changes_training_and_resumes_exactly(tmp_path):
    straight = train(cfg_of(tmp_path, "straight", *REPA, "train.steps=4", "train.ckpt_every=2"))
    first = train(cfg_of(tmp_path, "resumed", *REPA, "train.steps=2", "train.ckpt_every=2"))
    resumed = train(
        cfg_of(tmp_path, "resumed", *REPA, "train.steps=4", "train.ckpt_every=2"), resume="latest"
    )
    assert first.losses + resumed.losses == straight.losses
    a, b = read_checkpoint(straight.checkpoint), read_checkpoint(resumed.checkpoint)
    for key in ("model", "ema", "opt", "repa"):
        assert_states_equal(a[key], b[key], key)
    assert rows(straight.run_dir) == [
        {**r, **{k: s[k] for k in ("time_s", "steps_per_s", "img_per_s")}}
        for r, s in zip(rows(tmp_path / "resumed"), rows(straight.run_dir))
    ]
    plain = train(cfg_of(tmp_path, "plain", "train.steps=4"))
    assert plain.losses[0] != straight.losses[0]  # the loss holds the alignment term
    loaded = load_model(straight.checkpoint)  # the pipeline's loader: no projector needed
    assert set(loaded.model.state_dict()) == set(a["ema"])
    with pytest.raises(Exception, match="repa.encoder"):  # not resumable without REPA
        train(cfg_of(tmp_path, "straight", "train.steps=5"), resume="latest")


def test_grad_checkpointing_and_dit_objective_work_with_repa(tmp_path):
    base = train(cfg_of(tmp_path, "a", *REPA, "train.steps=2"))
    gc = train(cfg_of(tmp_path, "b", *REPA, "train.steps=2", "train.grad_checkpointing=true"))
    assert gc.losses == pytest.approx(base.losses, abs=1e-6)
    dit = train(
        cfg_of(
            tmp_path,
            "c",
            *REPA,
            "train.steps=2",
            "model.name=DiT-S/2",
            "model.learn_sigma=true",
            "transport.objective=ddpm",
            "sample.method=ddim",
        )
    )
    assert all(torch.isfinite(torch.tensor(dit.losses)))
    assert "loss_repa" in rows(dit.run_dir)[-1]


def test_timm_encoder_trains_and_a_grid_mismatch_is_one_line(tiny_vit, tmp_path, capsys):
    status, err = run_train(
        [
            *TINY,
            f"repa.encoder={tiny_vit}",
            "repa.depth=2",
            "repa.projector_dim=16",
            "train.steps=2",
            f"train.out_dir={tmp_path / 'ok'}",
        ],
        capsys,
    )
    assert status == 0, err
    row = rows(tmp_path / "ok")[-1]
    assert {"loss_diffusion", "loss_repa"} <= set(row)
    header = (tmp_path / "ok" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[8:10] == ["loss_diffusion", "loss_repa"]
    status, err = run_train(
        [
            *TINY,
            f"repa.encoder={tiny_vit}",
            "repa.depth=1",
            "repa.resolution=32",
            "train.steps=1",
            f"train.out_dir={tmp_path / 'bad'}",
        ],
        capsys,
    )
    assert status == 2
    assert_names(err, "64", "8×8", "32×32", "16", "4×4")
    assert "repa.resolution=16" in err
    status, err = run_train(
        [
            *TINY,
            "repa.encoder=digits",
            "repa.depth=3",
            "train.steps=1",
            f"train.out_dir={tmp_path / 'deep'}",
        ],
        capsys,
    )
    assert status == 2 and "repa.depth=3" in err and "2" in err


# ----------------------------------------------------------------------------- shipped configs


def test_xl_repa_configs_hold_repas_recipe():
    for name, backbone in (("sit-xl-2-repa", "SiT-XL/2"), ("vit5-xl-2-repa", "ViT5-XL/2")):
        cfg = load_config(f"imagenet/{name}")
        assert cfg["model"]["name"] == backbone and cfg["model"]["learn_sigma"] is False
        assert cfg["repa"] == {
            "encoder": "hub:facebookresearch/dinov2:dinov2_vitb14",
            "weights": None,
            "depth": 8,
            "projector_dim": 2048,
            "coeff": 0.5,
            "resolution": 224,
            "mean": None,
            "std": None,
            "interpolation": "bicubic",
        }
        assert (
            cfg["optim"]["lr"],
            cfg["optim"]["grad_clip"],
            cfg["data"]["global_batch_size"],
        ) == (1e-4, 1.0, 256)
        assert (
            cfg["train"]["precision"] == "fp16"
            and cfg["vae"]["name"] == "stabilityai/sd-vae-ft-mse"
        )
        assert cfg["data"]["kind"] == "imagefolder"  # the encoder needs the images


def test_repa_eval_protocol_is_repas_sampler():
    from sit_vit5.config import configs_dir
    from sit_vit5.experiments import imagenet

    p = imagenet.load_protocol(configs_dir() / "eval" / "repa.yaml")
    spec = imagenet.sample_spec(p["sample"])
    assert (spec.method, spec.sampling_method, spec.diffusion_form, spec.num_steps) == (
        "sde",
        "Euler",
        "sigma",
        250,
    )
    assert (spec.last_step, spec.last_step_size) == ("Mean", 0.04)
    assert (spec.cfg_scale, spec.cfg_channels, spec.cfg_interval) == (1.8, None, (0.3, 1.0))
    assert p["paper"] == {"SiT-XL/2": 1.42}


# ----------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_repa_under_ddp_and_fsdp_equals_one_process(tmp_path):
    """2-process torchrun (gloo): DDP for 2 steps, FSDP2 for 1 step then resumed for the 2nd; both
    equal
    one process x 2 accumulated micro-batches (the projector's gradients averaged, clipped with the
    model's), and the checkpoints hold the same projector and AdamW state."""
    from sit_vit5.config import save_config
    from tests.test_distributed import assert_close_states, launch

    config = tmp_path / "tiny.yaml"
    save_config(
        load_config(
            None, [*TINY, *REPA, f"train.out_dir={tmp_path / 'unused'}", "train.ckpt_every=1"]
        ),
        config,
    )
    for name, extra in (
        ("ddp", ["train.steps=2"]),
        ("fsdp", ["train.steps=1", "train.distributed=fsdp"]),
        ("fsdp", ["train.steps=2", "train.distributed=fsdp", "--resume", "latest"]),
    ):
        run = launch(
            ["train.py", "--config", str(config), f"train.out_dir={tmp_path / name}", *extra]
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    one = train(
        load_config(
            config, [f"train.out_dir={tmp_path / 'one'}", "train.steps=2", "train.grad_accum=2"]
        )
    )
    for name in ("ddp", "fsdp"):
        logged = rows(tmp_path / name)
        assert [r["loss"] for r in logged] == pytest.approx(one.losses, abs=1e-5), name
        assert [r["loss_repa"] for r in logged] == pytest.approx(
            [r["loss_repa"] for r in rows(one.run_dir)], abs=1e-5
        )
        a, b = (
            read_checkpoint(tmp_path / name / "checkpoints" / "0000002.pt"),
            read_checkpoint(one.checkpoint),
        )
        for key in ("model", "ema", "opt", "repa"):
            assert_close_states(a[key], b[key], 1e-5, f"{name}.{key}")


def test_repa_configs_are_the_xl_configs_plus_repas_changes():
    """Against configs/imagenet/{sit,vit5}-xl-2.yaml only REPA's recipe differs, and the two REPA
    files
    differ only in the backbone (and ViT-5's pinned layer_scale_init)."""
    from sit_vit5.config import flatten

    changed = {
        "model.learn_sigma",
        "data.random_flip",
        "vae.name",
        "optim.grad_clip",
        "train.precision",
        "train.out_dir",
        "repa.encoder",
        "repa.resolution",
    }
    for backbone in ("sit", "vit5"):
        base, with_repa = (
            flatten(load_config(f"imagenet/{backbone}-xl-2{s}")) for s in ("", "-repa")
        )
        assert {k for k in base if base[k] != with_repa[k]} == changed, backbone
    sit, vit5 = (flatten(load_config(f"imagenet/{b}-xl-2-repa")) for b in ("sit", "vit5"))
    assert {k for k in sit if sit[k] != vit5.get(k)} | (vit5.keys() - sit.keys()) == {
        "model.name",
        "model.layer_scale_init",
        "train.out_dir",
    }
    assert "generative setting" in (configs_dir() / "imagenet" / "vit5-xl-2-repa.yaml").read_text()


def test_the_demo_with_repa_trains_and_resumes_exactly_from_the_command_line(tmp_path, capsys):
    """docs/repa.md's `python train.py --config demo repa.encoder=digits ...`, 4 steps straight and
    2 + 2
    resumed with --resume latest: the same checkpoint, bit for bit."""
    argv = [
        "--config",
        "demo",
        "repa.encoder=digits",
        "repa.depth=1",
        "repa.projector_dim=128",
        "train.ckpt_every=2",
        "train.sample_every=0",
        "train.log_every=1",
        "train.tensorboard=false",
    ]
    for out, steps, extra in (
        ("straight", 4, []),
        ("resumed", 2, []),
        ("resumed", 4, ["--resume", "latest"]),
    ):
        status, err = run_train(
            [*argv, f"train.steps={steps}", f"train.out_dir={tmp_path / out}", *extra], capsys
        )
        assert status == 0, err
    a, b = (
        read_checkpoint(tmp_path / out / "checkpoints" / "0000004.pt")
        for out in ("straight", "resumed")
    )
    for key in ("model", "ema", "opt", "repa", "rng"):
        assert_states_equal(a[key], b[key], key)
    assert a["args"]["repa"]["encoder"] == "digits"


@pytest.mark.slow
def test_compiled_training_reads_the_hidden_state_too(tmp_path):
    """train.compile=true (inductor, ~1 min on a CPU): the hook on block repa.depth runs inside the
    compiled graph; losses, alignment losses and gradient norms match eager step by step."""
    eager = train(cfg_of(tmp_path, "eager", *REPA, "train.steps=3"))
    compiled = train(cfg_of(tmp_path, "compiled", *REPA, "train.steps=3", "train.compile=true"))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    for key in ("loss_repa", "grad_norm"):
        assert [r[key] for r in rows(compiled.run_dir)] == pytest.approx(
            [r[key] for r in rows(eager.run_dir)], rel=1e-4, abs=1e-5
        ), key


def test_a_timm_architecture_with_local_weights(tiny_vit, tmp_path, monkeypatch):
    """repa.encoder=timm:ARCH + repa.weights=FILE: no download; a file that does not fit is an
    error."""
    from safetensors.torch import load_file, save_file

    timm = pytest.importorskip("timm")
    real, sizes = (
        timm.create_model,
        dict(img_size=16, patch_size=4, embed_dim=24, depth=1, num_heads=2),
    )
    monkeypatch.setattr(
        timm, "create_model", lambda n, **kw: real(n, **{**kw, **sizes})
    )  # the tiny ViT
    name, weights = "timm:vit_tiny_patch16_224", tiny_vit / "model.safetensors"
    enc = R.load_encoder({"encoder": name, "weights": str(weights)}, 8, (4, 4), 1)
    folder = R.load_encoder({"encoder": str(tiny_vit)}, 8, (4, 4), 1)
    x = torch.rand(2, 1, 8, 8)
    torch.testing.assert_close(enc(x), folder(x))
    part = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("blocks.")}
    save_file(part, str(tmp_path / "part.safetensors"))
    with pytest.raises(ConfigError, match="missing"):
        R.load_encoder(
            {"encoder": name, "weights": str(tmp_path / "part.safetensors")}, 8, (4, 4), 1
        )
