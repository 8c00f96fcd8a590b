"""The objective switch (transport.objective: sit | ddpm): config checks, DiT-* names, the backbone's output
and timesteps under ddpm, the training loss, DDPM/DDIM sampling of a model, resume of older configs, and a
tiny end-to-end ddpm training run."""

from __future__ import annotations

import pytest
import torch

from sit_vit5.config import DEFAULTS, ConfigError, flatten, load_config
from sit_vit5.diffusion import DiffusionSampler, GaussianDiffusion, create_diffusion
from sit_vit5.models import create_model, list_models, load_model, name_objective
from sit_vit5.objective import DDPMObjective, SiTObjective, create_objective
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.training import read_checkpoint, save_checkpoint, train
from sit_vit5.training.checkpoint import config_differences
from sit_vit5.transport import Transport
from sit_vit5.utils.errors import SettingError

TINY_MODEL = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, in_channels=1, num_classes=10)
DDPM = ["transport.objective=ddpm", "model.learn_sigma=true", "sample.method=ddpm"]


def test_dit_names_are_the_sit_network_under_ddpm():
    assert {"DiT-S/2", "DiT-XL/2", "DiT-B/8"} <= set(list_models())
    assert name_objective("DiT-XL/2") == "ddpm" and name_objective("SiT-XL/2") is None
    dit, sit = create_model("DiT-S/2", **TINY_MODEL), create_model("SiT-S/2", **TINY_MODEL)
    assert type(dit) is type(sit) and dit.state_dict().keys() == sit.state_dict().keys()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["transport.objective=ddpm", "sample.method=ddpm", "model.learn_sigma=false"],
            "model.learn_sigma=true",
        ),
        (
            [
                "transport.objective=ddpm",
                "sample.method=ddpm",
                "transport.ddpm_variance=fixed_large",
            ],
            "model.learn_sigma=false",
        ),
        (["transport.objective=ddpm"], "sample.method='ode'"),
        (["sample.method=ddpm"], "sample.method='ddpm'"),
        (["model.name=DiT-XL/2"], "transport.objective=ddpm"),
        (["transport.objective=dit"], "transport.objective"),
        ([*DDPM, "transport.noise_schedule=quadratic"], "transport.noise_schedule"),
        ([*DDPM, "transport.ddpm_variance=small"], "transport.ddpm_variance"),
    ],
)
def test_contradictory_objective_settings_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_valid_objective_configs_load():
    cfg = load_config(None, [*DDPM, "model.name=DiT-XL/2"])
    assert cfg["transport"]["objective"] == "ddpm"
    cfg = load_config(
        None,
        [
            "transport.objective=ddpm",
            "sample.method=ddim",
            "model.learn_sigma=false",
            "transport.ddpm_variance=fixed_small",
        ],
    )
    diffusion = create_objective(cfg["transport"]).diffusion
    assert isinstance(diffusion, GaussianDiffusion) and diffusion.model_var_type == "fixed_small"
    assert isinstance(create_objective(DEFAULTS["transport"]).transport, Transport)


def test_ddpm_backbone_returns_2c_channels_and_receives_integer_steps():
    model = create_model("SiT-S/2", **TINY_MODEL)
    x, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 1, 2])
    assert model(x, torch.rand(3), y).shape == (3, 2, 8, 8)  # the full output: eps (or v), then sigma

    seen = []

    def spy(x, t, y):
        seen.append(t)
        return model(x, t, y)

    diffusion = create_objective({"objective": "ddpm"})
    torch.manual_seed(0)
    loss = diffusion.loss(spy, x, y)
    assert loss.shape == (3,) and torch.isfinite(loss).all()
    assert seen[0].dtype == torch.long and 0 <= seen[0].min() and seen[0].max() <= 999
    loss.mean().backward()  # the mean and variance halves of the output layer both get gradients
    grad = model.final_layer.linear.weight.grad.reshape(
        2 * 2, 2, -1
    )  # (p*p, C_out, D), C_out = [eps, v]
    assert grad[:, 0].abs().sum() > 0 and grad[:, 1].abs().sum() > 0


@pytest.mark.parametrize("objective", ["sit", "ddpm"])
def test_guidance_never_mixes_the_variance_half(objective):
    from sit_vit5.sampling import SamplingPipeline

    model = create_model("SiT-S/2", **TINY_MODEL)  # learn_sigma: 2C outputs
    method = create_objective({"objective": objective}).methods[0]
    for channels, guided in ((None, 1), (1, 1)):
        spec = SampleSpec(method=method, num_steps=3, cfg_scale=2.0, cfg_channels=channels)
        pipe = SamplingPipeline(model, create_objective({"objective": objective}), spec, (1, 8, 8), 10)
        assert pipe.model_fn.cfg_channels == guided


def test_diffusion_sampler_respaces_the_trained_process():
    diffusion = create_diffusion("")
    sampler = DiffusionSampler(diffusion)
    calls = []

    def model(x, t, y):
        calls.append(int(t[0]))
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])

    z = torch.randn(2, 1, 4, 4)
    x = sampler.build("ddpm", 25)(z, model, generator=[1, 2], y=torch.tensor([0, 1]))[-1]
    assert x.shape == z.shape and sampler.last_nfe == 25 and calls[0] == 999 and calls[-1] == 0
    calls.clear()
    sampler.build("ddim", 50)(z, model, y=torch.tensor([0, 1]))
    assert sampler.last_nfe == 50 and calls[0] == 980  # ADM's ddim50: stride 20 from 0
    spaced = create_diffusion("25")
    assert torch.equal(diffusion.respace("25").betas, spaced.betas)
    with pytest.raises(SettingError) as err:  # the objective's check: a method that cannot sample it
        create_objective({"objective": "ddpm"}).sampler(SampleSpec(method="ode", num_steps=10))
    assert (err.value.key, err.value.value) == ("method", "ode")


def test_the_ddpm_demo_is_the_demo_with_dits_objective():
    """configs/demo-dit.yaml differs from the demo only in the objective, its sampler and the lr: the two
    demos compare the objectives on the same backbone, data and steps."""
    demo, dit = flatten(load_config("configs/demo.yaml")), flatten(load_config("configs/demo-dit.yaml"))
    changed = {k for k in demo.keys() | dit.keys() if demo.get(k) != dit.get(k)}
    assert changed == {"model.learn_sigma", "transport.objective", "transport.noise_schedule", "optim.lr",
                       "sample.method", "train.out_dir"}
    assert (dit["transport.objective"], dit["transport.noise_schedule"], dit["model.learn_sigma"]) == (
        "ddpm", "cosine", True)
    assert dit["vae.name"] == "none"  # pixel space: its DDPM / DDIM sampling clips x0 to [-1, 1]


def test_configs_without_the_objective_key_resume_as_sit():
    old = load_config(None, [])
    del old["transport"]["objective"], old["transport"]["diffusion_steps"]
    assert config_differences(old, load_config(None, [])) == []
    assert config_differences(old, load_config(None, DDPM)) == [
        "model.learn_sigma: '<unset>' (checkpoint) != True (this run)",
        "transport.objective: 'sit' (checkpoint) != 'ddpm' (this run)",
    ]


def test_tiny_ddpm_training_run_records_its_objective(tmp_path):
    cfg = load_config(
        None,
        [
            "model.name=ViT5-S/2",
            "model.depth=2",
            "model.hidden_size=32",
            "model.num_heads=2",
            *DDPM,
            "data.kind=digits",
            "data.image_size=8",
            "data.random_flip=false",
            "data.num_workers=0",
            "vae.name=none",
            "optim.lr=1e-3",
            "train.tensorboard=false",
            "train.log_every=5",
            "train.milestone_every=0",
            "train.steps=30",
            "train.ckpt_every=30",
            "data.global_batch_size=32",
            "train.sample_every=30",
            "sample.num_images=4",
            "sample.num_steps=5",
            f"train.out_dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert sum(result.losses[-5:]) < sum(result.losses[:5])
    assert result.sample_grid is not None and result.sample_grid.is_file()
    assert read_checkpoint(result.checkpoint)["args"]["transport"]["objective"] == "ddpm"


@pytest.mark.parametrize("objective", ["sit", "ddpm"])
def test_loaded_checkpoints_split_transport_kwargs_from_the_ddpm_keys(tmp_path, objective):
    extra = DDPM if objective == "ddpm" else []
    cfg = load_config(
        None,
        [
            "model.name=SiT-S/2",
            "model.input_size=8",
            "model.in_channels=1",
            "model.num_classes=10",
            *[
                f"model.{k}={v}"
                for k, v in TINY_MODEL.items()
                if k in ("depth", "hidden_size", "num_heads")
            ],
            *extra,
        ],
    )
    model = create_model(
        "SiT-S/2", **{**TINY_MODEL, "learn_sigma": cfg["model"].get("learn_sigma", True)}
    )
    state = {
        "model": model.state_dict(),
        "ema": model.state_dict(),
        "opt": {},
        "args": cfg,
        "step": 1,
    }
    loaded = load_model(save_checkpoint(state, tmp_path / "checkpoints", step=1))
    assert loaded.objective_name == objective == loaded.objective["objective"]
    if objective == "ddpm":
        assert loaded.objective["ddpm_variance"] == "learned"
    assert type(create_objective(loaded.objective)) is (
        SiTObjective if objective == "sit" else DDPMObjective
    )


def test_every_contradiction_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", ["transport.objective=ddpm"])  # demo: ode sampler, no sigma
    assert "sample.method='ode'" in str(err.value) and "model.learn_sigma=true" in str(err.value)
