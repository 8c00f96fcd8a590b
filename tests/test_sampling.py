"""Sampling library: per-index determinism, bulk sharding / batching / resume, npz format, checkpoint loading."""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import pytest
import torch

from sit_vit5 import sampling
from sit_vit5.config import ConfigError, load_config
from sit_vit5.guidance import ClassifierFreeGuidance
from sit_vit5.images import to_uint8
from sit_vit5.models import create_model, load_model
from sit_vit5.sampling import (
    ResumeError,
    SampleSpec,
    SamplingPipeline,
    merge_parts,
    random_labels,
    sample_bulk,
)
from sit_vit5.transport import create_transport
from sit_vit5.transport.rng import sample_seed
from tests.helpers import naming

TINY = dict(input_size=8, in_channels=1, depth=1, hidden_size=32, num_heads=2, num_classes=10, learn_sigma=False)
ODE = SampleSpec(method="ode", sampling_method="euler", num_steps=4)
SDE = SampleSpec(method="sde", sampling_method="Euler", num_steps=4)




def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny SiT with random (not zero-initialised) outputs, so that sampling depends on the weights."""
    torch.manual_seed(seed)
    model = create_model("SiT-S/2", **{**TINY, **overrides})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def pipeline(spec: SampleSpec = SDE, **kwargs) -> SamplingPipeline:
    return SamplingPipeline(tiny_model(), create_transport(), spec, (1, 8, 8), 10, **kwargs)


# ----------------------------------------------------------------------------- conversions and seeds


def test_to_uint8_is_dit_expression_and_rounds_half_up():
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0, 1 / 255, -1 + 1 / 255, -1 + 0.5 / 127.5]).view(1, 1, 2, 4)
    out = to_uint8(x)
    assert out.dtype == np.uint8 and out.shape == (1, 2, 4, 1)
    # -1 -> 0, 0 -> 128, 1 -> 255, clipped outside; the tie 127.5 * (x + 1) = 0.5 rounds up to 1
    assert out.ravel()[[0, 1, 2, 3, 4, 7]].tolist() == [0, 0, 128, 255, 255, 1]
    x = torch.rand(3, 3, 5, 4) * 2.4 - 1.2
    expected = np.floor(np.clip(127.5 * x.double().numpy() + 128, 0, 255)).astype(np.uint8).transpose(0, 2, 3, 1)
    assert np.array_equal(to_uint8(x), expected)
    half_up = np.floor(np.clip(127.5 * (x.double().numpy() + 1), 0, 255) + 0.5).clip(0, 255).transpose(0, 2, 3, 1)
    assert np.array_equal(to_uint8(x), half_up.astype(np.uint8))


def test_sample_seeds_are_distinct_stable_and_checked():
    seeds = [sample_seed(0, i) for i in range(2000)]
    assert len(set(seeds)) == 2000 and all(0 <= s < 2**63 for s in seeds)
    assert seeds[:5] == [sample_seed(0, i) for i in range(5)]
    assert sample_seed(1, 0) != sample_seed(0, 0) != sample_seed(0, 0, stream=sampling.LABEL_STREAM)
    with pytest.raises(ValueError, match="index=-1"):
        sample_seed(0, -1)


def test_random_labels_are_per_index_and_uniform():
    labels = random_labels(range(5000), 3, 10)
    assert labels.dtype == np.int64 and labels.min() >= 0 and labels.max() <= 9
    assert np.array_equal(random_labels([4321, 7, 0], 3, 10), labels[[4321, 7, 0]])
    counts = np.bincount(labels, minlength=10)
    chi2 = ((counts - 500) ** 2 / 500).sum()
    assert chi2 < 40, counts  # 9 degrees of freedom: P(chi2 > 40) ~ 1e-5
    assert not np.array_equal(random_labels(range(50), 4, 10), labels[:50])


def test_spec_defaults_and_checks():
    assert SampleSpec().sampling_method == "dopri5" and SampleSpec(method="sde").sampling_method == "Euler"
    assert SampleSpec().batch_coupled and not ODE.batch_coupled and not SDE.batch_coupled
    assert SampleSpec(last_step="none").last_step is None
    with pytest.raises(ValueError, match="method='euler'; valid: ode, sde"):
        SampleSpec(method="euler")
    with pytest.raises(ValueError, match="cfg_interval"):
        SampleSpec(cfg_interval=(0.8, 0.2))


# ----------------------------------------------------------------------------- per-index determinism


@pytest.mark.parametrize("spec", [ODE, SDE], ids=["ode-euler", "sde-euler"])
def test_images_depend_on_index_and_seed_only(spec):
    pipe = pipeline(spec)
    full = pipe.generate(range(7), global_seed=5)
    assert full.images.shape == (7, 8, 8, 1) and full.nfe == (3 if spec.method == "ode" else 4)
    picked = pipe.generate([5, 1, 3], global_seed=5)
    assert np.array_equal(picked.labels, full.labels[[5, 1, 3]])
    # different batch shapes may change float matmul results by ~1e-7 (measured: 3.6e-7 for batch 1/2/3 vs 7)
    torch.testing.assert_close(picked.pixels, full.pixels[[5, 1, 3]], rtol=0, atol=1e-5)
    diff = np.abs(picked.images.astype(int) - full.images[[5, 1, 3]].astype(int))
    assert diff.max() <= 1
    again = pipe.generate([5, 1, 3], global_seed=5)
    assert torch.equal(again.pixels, picked.pixels)  # same batch -> bit-identical
    other = pipe.generate([5, 1, 3], global_seed=6)
    assert np.abs(other.pixels - picked.pixels).mean() > 0.1  # the seed matters


def test_sde_noise_is_used_and_labels_matter():
    ode, sde = pipeline(ODE), pipeline(SDE)
    labels = [0, 0, 0]
    assert np.abs(ode.generate([0, 1, 2], 0, labels).pixels - sde.generate([0, 1, 2], 0, labels).pixels).mean() > 0.1
    a, b = sde.generate([0, 1], 0, [0, 0]), sde.generate([0, 1], 0, [7, 7])
    assert (a.pixels - b.pixels).abs().mean() > 1e-3
    with pytest.raises(ValueError, match=naming("labels", "[0, 10)", "[10]")):
        sde.generate([0], 0, [10])


def test_guidance_is_wired_through_the_shared_helper():
    plain = pipeline(SDE)
    guided = pipeline(SampleSpec(method="sde", num_steps=4, cfg_scale=3.0, cfg_interval=(0.0, 0.9)))
    assert isinstance(guided.model_fn, ClassifierFreeGuidance)
    assert guided.model_fn.null_class == 10 and guided.model_fn.interval == (0.0, 0.9)
    assert (plain.generate([0, 1], 0).pixels - guided.generate([0, 1], 0).pixels).abs().mean() > 1e-3
    with pytest.raises(ValueError, match="class_dropout_prob=0"):
        SamplingPipeline(tiny_model(class_dropout_prob=0.0), create_transport(),
                         SampleSpec(cfg_scale=2.0), (1, 8, 8), 10)
    with pytest.raises(ValueError, match=naming("cfg_channels=3", "1")):
        pipeline(SampleSpec(cfg_scale=2.0, cfg_channels=3))


def test_samples_with_the_model_frozen_and_restores_its_flags():
    pipe = pipeline(ODE)
    flags = {n: p.requires_grad for n, p in pipe.model.named_parameters()}
    assert any(flags.values()) and not all(flags.values())  # trainable weights and a frozen pos-embed
    seen = []  # torch's matmul path depends on requires_grad: sample as a loaded (frozen) model
    hook = pipe.model.register_forward_hook(lambda m, i, o: seen.append(any(p.requires_grad for p in m.parameters())))
    full = pipe.generate([0, 1, 2], 3)
    hook.remove()
    assert seen and not any(seen)
    assert {n: p.requires_grad for n, p in pipe.model.named_parameters()} == flags
    loaded = pipeline(ODE)  # as load_model gives it: frozen for good
    loaded.model.requires_grad_(False)
    assert torch.equal(loaded.generate([0, 1, 2], 3).pixels, full.pixels)


def test_generate_takes_generators_steps_and_a_tick():
    pipe = pipeline(ODE)
    full = pipe.generate([4, 2], 9, labels=[1, 3])
    gens = [torch.Generator().manual_seed(sample_seed(9, i)) for i in (4, 2)]
    ticks = []
    again = pipe.generate([0, 1], 0, labels=[1, 3], generators=gens, tick=lambda: ticks.append(1))
    assert torch.equal(again.pixels, full.pixels)  # the generators decide, not the indices / seed
    assert len(ticks) == pipe.objective.evaluations(pipe.spec) == full.nfe
    # the objective's Euler steps through the one step-wise loop: the whole-trajectory ODE Euler's pixels
    steps = pipe.objective.steps(pipe.spec)
    stepped = pipe.generate([4, 2], 9, labels=[1, 3], steps=steps)
    assert torch.allclose(stepped.pixels, full.pixels, atol=1e-5) and stepped.nfe == len(steps.timesteps)
    broken = tiny_model()
    with torch.no_grad():
        broken.final_layer.linear.bias.fill_(float("nan"))
    nan = SamplingPipeline(broken, create_transport(), ODE, (1, 8, 8), 10)
    with pytest.raises(sampling.NonFiniteSampleError) as err:
        nan.generate([7], 0)
    assert "samples 7..7" in str(err.value)
    assert all(p.requires_grad for n, p in pipe.model.named_parameters() if "pos_embed" not in n)  # restored


def test_bf16_autocast_runs_and_stays_close():
    fp32, bf16 = pipeline(ODE), pipeline(ODE, precision="bf16")
    a, b = fp32.generate([0, 1], 0), bf16.generate([0, 1], 0)
    assert b.pixels.dtype == torch.float32 and 0 < (a.pixels - b.pixels).abs().max() < 0.5


# ----------------------------------------------------------------------------- bulk


def _read(path):
    with np.load(path, allow_pickle=False) as f:
        return f["arr_0"], f["arr_1"], sorted(f.files)


def test_bulk_is_independent_of_world_size_and_batch_size(tmp_path):
    n = 13
    one = sample_bulk(pipeline(SDE), n, tmp_path / "one", global_seed=2, batch_size=4, progress=False)
    assert one.npz == tmp_path / "one" / f"samples_{n}x8x8x3.npz" and one.generated == n
    pipe = pipeline(SDE)
    first = sample_bulk(pipe, n, tmp_path / "two", global_seed=2, batch_size=3, rank=0, world_size=2,
                        progress=False)
    assert first.npz is None and first.generated == 7  # indices 0, 2, ..., 12; rank 1 still missing
    second = sample_bulk(pipe, n, tmp_path / "two", global_seed=2, batch_size=5, rank=1, world_size=2,
                         progress=False)
    assert second.generated == 6 and second.npz is not None  # no barrier: the process that completes merges
    images1, labels1, keys = _read(one.npz)
    images2, labels2, _ = _read(second.npz)
    # ADM's two arrays, what they were made with, and the metadata a FID line is traced by
    assert keys == ["arr_0", "arr_1", "metadata_json", "settings"]
    assert images1.dtype == np.uint8 and images1.shape == (n, 8, 8, 3)
    assert np.array_equal(images1[..., 0], images1[..., 2])  # gray replicated to RGB
    assert labels1.dtype == np.int64 and np.array_equal(labels1, random_labels(range(n), 2, 10))
    assert np.array_equal(labels1, labels2)
    assert np.abs(images1.astype(int) - images2.astype(int)).max() <= 1  # measured: identical on this CPU
    direct = pipeline(SDE).generate([11, 12], 2)
    assert np.abs(images1[11:, ..., :1].astype(int) - direct.images.astype(int)).max() <= 1
    assert images1.std() > 10  # not a constant image


def test_merged_npz_reads_like_np_savez(tmp_path):
    from fid.image_sets import open_images

    result = sample_bulk(pipeline(ODE), 5, tmp_path, batch_size=2, progress=False, png=True)
    images, labels, _ = _read(result.npz)
    source = open_images(result.npz)  # the evaluator's reader (offset-based, not np.load)
    assert len(source) == 5 and np.array_equal(np.concatenate(list(source.batches(2))), images)
    reference = tmp_path / "reference.npz"
    np.savez(reference, arr_0=images, arr_1=labels)
    assert np.array_equal(_read(reference)[0], images)
    pngs = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert pngs == [f"{i:06d}.png" for i in range(5)]
    from PIL import Image

    with Image.open(tmp_path / "images" / "000003.png") as im:
        assert im.mode == "L" and np.array_equal(np.asarray(im), images[3, ..., 0])


def test_bulk_resume_skips_finished_parts(tmp_path, monkeypatch):
    n, spec = 10, ODE
    reference = sample_bulk(pipeline(spec), n, tmp_path / "ref", batch_size=4, progress=False).npz

    real_save, saved = sampling.bulk._save_part, []

    def crash_after_first(parts_dir, batch):
        if saved:
            raise KeyboardInterrupt("killed")
        saved.append(real_save(parts_dir, batch))
        return saved[-1]

    monkeypatch.setattr(sampling.bulk, "_save_part", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        sample_bulk(pipeline(spec), n, tmp_path / "run", batch_size=4, progress=False)
    monkeypatch.setattr(sampling.bulk, "_save_part", real_save)
    parts = sorted((tmp_path / "run" / "parts").iterdir())
    assert [p.name for p in parts] == ["0000000-0000003.npz"]  # no temporary file left behind
    before = os.stat(parts[0])

    pipe, made = pipeline(spec), []
    generate = pipe.generate
    monkeypatch.setattr(pipe, "generate", lambda idx, seed, labels=None: made.extend(idx) or generate(idx, seed))
    result = sample_bulk(pipe, n, tmp_path / "run", batch_size=4, progress=False)
    assert made == list(range(4, n)) and result.skipped == 4 and result.generated == 6
    after = os.stat(parts[0])
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    for a, b in zip(_read(result.npz), _read(reference)):
        assert np.array_equal(a, b)  # same batches as the uninterrupted run -> bit-identical

    made.clear()  # growing N only makes the new indices
    grown = sample_bulk(pipe, n + 3, tmp_path / "run", batch_size=4, progress=False)
    assert made == [10, 11, 12] and grown.npz.name == "samples_13x8x8x3.npz"
    assert np.array_equal(_read(grown.npz)[0][:n], _read(reference)[0])


def test_bulk_refuses_to_mix_settings(tmp_path):
    sample_bulk(pipeline(ODE), 2, tmp_path, global_seed=1, batch_size=2, progress=False, settings={"ckpt": "a"})
    with pytest.raises(ResumeError, match="global_seed: 1"):
        sample_bulk(pipeline(ODE), 2, tmp_path, global_seed=2, batch_size=2, progress=False, settings={"ckpt": "a"})
    with pytest.raises(ResumeError, match="spec"):
        sample_bulk(pipeline(SDE), 2, tmp_path, global_seed=1, batch_size=2, progress=False, settings={"ckpt": "a"})
    with pytest.raises(ValueError, match="rank"):
        sample_bulk(pipeline(ODE), 2, tmp_path, rank=2, world_size=2)
    with pytest.raises(ValueError, match=naming(tmp_path, "2 of 4")):
        merge_parts(tmp_path, 4)


def test_adaptive_solver_warns_in_bulk(tmp_path):
    with pytest.warns(UserWarning, match=naming("dopri5", "num_steps=2")):
        pipe = pipeline(SampleSpec(method="ode", sampling_method="dopri5", num_steps=2, atol=1e-2, rtol=1e-2))
    with pytest.warns(UserWarning, match=naming("dopri5", "rk4")):
        sample_bulk(pipe, 1, tmp_path, progress=False)


# ----------------------------------------------------------------------------- checkpoints


def our_config(**model):
    overrides = [f"model.{k}={v}" for k, v in {"name": "SiT-S/2", **TINY, **model}.items()]
    return load_config("configs/demo.yaml", overrides + ["transport.path_type=GVP"])


def test_load_our_checkpoint(tmp_path):
    model, ema = tiny_model(1), tiny_model(2)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "args": our_config(),
                "step": 123}, path)
    info = load_model(path)
    loaded = info.model
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ema.state_dict().items())
    assert (info.source, info.name, info.step, info.which) == ("ours", "SiT-S/2", 123, "ema")
    assert (info.input_size, info.in_channels, info.num_classes) == (8, 1, 10)
    assert info.objective["path_type"] == "GVP" and info.vae["name"] == "none"
    assert info.sample["sampling_method"] == "euler"
    raw = load_model(path, which="model").model
    assert all(torch.equal(raw.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=naming(path, "'SiT-S/2'", "'SiT-B/2'")):
        load_model(path, "SiT-B/2")


def test_load_official_bare_state_dict(tmp_path):
    """The official layout (4 latent channels, learn_sigma, null class) as a bare state dict, shrunk."""
    arch = dict(depth=1, hidden_size=32, num_heads=2)
    model = tiny_model(in_channels=4, learn_sigma=True)
    path = tmp_path / "SiT-S-2-bare.pt"
    torch.save(model.state_dict(), path)
    info = load_model(path, "SiT-S/2", overrides=arch)
    loaded = info.model
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert loaded.learn_sigma and (info.source, info.input_size, info.in_channels, info.num_classes) == (
        "official", 8, 4, 10)
    assert info.objective == {"objective": "sit"} and info.vae["name"] == "stabilityai/sd-vae-ft-ema"
    with pytest.raises(ValueError, match=naming(path, "--model", "SiT-XL/2")):
        load_model(path)
    # a CheckpointError naming the file and the mismatched hidden size
    with pytest.raises(RuntimeError, match=naming(path, "hidden_size=32", "64")):
        load_model(path, "SiT-S/2", overrides={**arch, "hidden_size": 64})
    # an official DiT/SiT training checkpoint: argparse args name the model, VAE and transport
    args = argparse.Namespace(model="SiT-S/2", vae="mse", path_type="VP", prediction="velocity", loss_weight=None)
    train_ckpt = tmp_path / "0400000.pt"
    torch.save({"ema": model.state_dict(), "args": args}, train_ckpt)
    info = load_model(train_ckpt, overrides=arch)
    assert info.name == "SiT-S/2" and info.vae["name"] == "stabilityai/sd-vae-ft-mse"
    assert info.objective == {"objective": "sit", "path_type": "VP", "prediction": "velocity"}
    with pytest.raises(RuntimeError, match=naming(train_ckpt, "'model'")):
        load_model(train_ckpt, which="model", overrides=arch)


# ----------------------------------------------------------------------------- one home for defaults


def test_spec_resolve_takes_the_first_setting_per_field():
    flags = {"method": None, "num_steps": 7, "cfg_scale": None, "sampling_method": None}
    saved = {"method": "ode", "sampling_method": "heun2", "num_steps": 50, "cfg_scale": 2.5,
             "num_images": 16}  # a config section: grid keys are not spec fields
    spec = SampleSpec.resolve(flags, saved)
    assert (spec.method, spec.sampling_method, spec.num_steps, spec.cfg_scale) == ("ode", "heun2", 7, 2.5)
    assert spec.diffusion_form == SampleSpec().diffusion_form == "sigma"  # SiT's sample.py default
    # the saved ODE solver is not carried over to an SDE chosen on top of it
    sde = SampleSpec.resolve({"method": "sde"}, saved)
    assert (sde.method, sde.sampling_method, sde.num_steps) == ("sde", "Euler", 50)
    assert SampleSpec.resolve() == SampleSpec() and SampleSpec.resolve({"cfg_interval": [0, 1]}) == (
        SampleSpec(cfg_interval=(0.0, 1.0)))
    with pytest.raises(ValueError, match="num_steps='5'"):
        SampleSpec.resolve({"num_steps": "5"})


def test_config_sample_section_defers_to_the_spec():
    from sit_vit5.config import DEFAULTS

    section = DEFAULTS["sample"]
    assert set(SampleSpec.keys()) <= set(section)
    preset = {"method", "sampling_method", "num_steps"}  # the cheap training-grid preset
    assert all(section[k] is None for k in SampleSpec.keys() if k not in preset)
    spec = SampleSpec.resolve(section)
    defaults = SampleSpec(method=section["method"], sampling_method=section["sampling_method"],
                          num_steps=section["num_steps"])
    assert spec == defaults


# ----------------------------------------------------------------------------- parts on disk


def test_part_names_say_which_indices_they_hold():
    from sit_vit5.sampling.bulk import _part_name

    assert _part_name(np.arange(0, 32)) == "0000000-0000031.npz"
    assert _part_name(np.arange(48, 384, 8)) == "0000048-0000376-step8.npz"  # one of 8 processes
    odd = _part_name(np.array([48, 50, 383]))
    assert odd.startswith("0000048-0000383-3-") and odd != _part_name(np.array([48, 51, 383]))


def test_truncated_part_is_removed_and_remade(tmp_path):
    """A part cut short after it was written (disk trouble, a copy): removed and regenerated once,
    not warned about forever; the merged samples equal an undamaged run's."""
    torch.manual_seed(0)
    model = create_model("SiT-S/2", input_size=8, in_channels=1, num_classes=10, depth=1,
                         hidden_size=32, num_heads=2, learn_sigma=False)

    def pipe():
        spec = SampleSpec(method="ode", sampling_method="euler", num_steps=3)
        return SamplingPipeline(model, create_transport(), spec, (1, 8, 8), 10)

    reference = sample_bulk(pipe(), 6, tmp_path / "ref", batch_size=3, progress=False).npz
    run = tmp_path / "run"
    sample_bulk(pipe(), 6, run, batch_size=3, progress=False)
    part = run / "parts" / "0000003-0000005.npz"
    part.write_bytes(part.read_bytes()[:100])
    with pytest.warns(UserWarning, match=naming("removed", part)):
        result = sample_bulk(pipe(), 6, run, batch_size=3, progress=False)
    assert result.generated == 3 and result.skipped == 3
    with np.load(result.npz) as a, np.load(reference) as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the third run has nothing to warn about
        assert sample_bulk(pipe(), 6, run, batch_size=3, progress=False).generated == 0


def test_a_negative_cfg_scale_is_refused_alike_everywhere_unless_asked_for():
    """One rule (sample_spec.check_cfg_scale) for the pipeline, the config and sample.py: refused
    unless explicitly allowed, then warned about."""
    spec = SampleSpec(method="ode", sampling_method="euler", num_steps=2, cfg_scale=-1.0)
    with pytest.raises(ValueError, match=naming("cfg_scale=-1.0")):
        pipeline(spec)
    with pytest.warns(UserWarning, match=naming("cfg_scale=-1.0")):
        assert pipeline(spec, allow_negative_cfg=True).spec.cfg_scale == -1.0
    with pytest.raises(ConfigError, match=r"sample.cfg_scale=-1(\.0)?"):
        load_config(None, ["sample.cfg_scale=-1"])


def test_spec_options_are_the_sampler_builders_keywords():
    """Each spec field tagged for a solver is a keyword of that solver's builder, and every builder
    keyword but ``progress`` / ``reverse`` comes from the spec (a new solver option cannot be lost)."""
    import inspect

    from sit_vit5.transport import Sampler

    for method, build in (("ode", Sampler.sample_ode), ("sde", Sampler.sample_sde)):
        keywords = set(inspect.signature(build).parameters) - {"self", "progress", "reverse"}
        assert set(SampleSpec(method=method).options()) == keywords, method
    from sit_vit5.diffusion import DiffusionSampler

    keywords = set(inspect.signature(DiffusionSampler.build).parameters) - {"self", "method", "progress"}
    assert set(SampleSpec(method="ddim").options()) == keywords  # eta reaches DDIM through the spec
    assert set(SampleSpec(method="ddpm").options()) == keywords - {"eta"}
