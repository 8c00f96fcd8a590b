"""diffusers' multistep solvers of DiT's diffusion (``--method ddim / ddpm --sampling-method NAME``):
each converges at its order to the closed-form probability-flow map of Gaussian data, the SDE one to the
data's distribution; step-wise equals whole, the noise is per image, pixel space clips x0, and sample.py
and the spec take them and refuse what they cannot do in one line."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import sample
from sit_vit5.cli.sample_flags import describe_methods
from sit_vit5.names import DIFFUSION_SOLVERS
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import SampleSpec, sampling_methods
from sit_vit5.sampling import SamplingPipeline
from sit_vit5.utils.errors import SettingError
from tests.helpers import assert_names, one_sample_error
from tests.test_pipeline import grid_images
from tests.test_pipeline_conventions import ddpm_checkpoint

ODE_SOLVERS = list(DIFFUSION_SOLVERS["ddim"])
SDE_SOLVERS = list(DIFFUSION_SOLVERS["ddpm"])
MEAN, STD = 0.3, 0.5  # the data: N(MEAN, STD^2) in every dimension


@pytest.fixture(scope="module")
def objective():
    return create_objective({"objective": "ddpm", "ddpm_variance": "fixed_small"})


def alphas_bar(objective) -> torch.Tensor:
    return torch.cumprod(1 - torch.as_tensor(objective.diffusion.original_betas), 0)  # float64


def exact_eps(objective):
    """E[eps | x_t] for the Gaussian data: sqrt(1 - a) (x - sqrt(a) m) / (a s^2 + 1 - a), a = alpha_bar_t
    at DiT's integer t (a C-channel model: fixed variance)."""
    abar = alphas_bar(objective)

    def model(x, t, **kwargs):
        a = abar[t.long()].view(-1, 1, 1, 1)
        return ((1 - a).sqrt() * (x.double() - a.sqrt() * MEAN) / (a * STD**2 + 1 - a)).to(x.dtype)

    return model


def exact_map(objective, z: torch.Tensor, t0: int) -> torch.Tensor:
    """The probability-flow ODE from x_t0 = z to sigma 0, closed form: in xbar = x / sqrt(a) and
    sigma = sqrt(1 / a - 1) the Gaussian's flow keeps (xbar - m) / sqrt(s^2 + sigma^2) constant."""
    a = alphas_bar(objective)[t0]
    return MEAN + (z.double() / a.sqrt() - MEAN) * STD / math.sqrt(STD**2 + 1 / a - 1)


def test_the_tables_are_not_empty_and_listed():
    assert ODE_SOLVERS and SDE_SOLVERS
    listing = describe_methods()
    for method, solvers in DIFFUSION_SOLVERS.items():
        assert sampling_methods(method) == tuple(solvers)
        for name, (cls, _) in solvers.items():
            assert_names(listing, name, cls)


@pytest.mark.parametrize("name", ODE_SOLVERS)
def test_each_ode_solver_converges_at_second_order_to_the_closed_form(objective, name):
    z = torch.randn(256, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    errors = []
    for steps in (10, 20, 40):
        built = objective.sampler(SampleSpec(method="ddim", sampling_method=name, num_steps=steps))
        x = built.sample(z, exact_eps(objective))[-1]
        assert built.sampler.last_nfe == steps
        errors.append(float((x.double() - exact_map(objective, z, 999)).abs().max()))
    slope = math.log2(errors[0] / errors[-1]) / 2
    assert slope >= 1.8, (name, errors)
    # against DDIM (first order) at the same 20 evaluations, each from its own first step
    ddim = objective.diffusion.respace("ddim20")
    x = objective.sampler(SampleSpec(method="ddim", num_steps=20)).sample(z, exact_eps(objective))[-1]
    ddim_error = float((x.double() - exact_map(objective, z, int(ddim.timestep_map[-1]))).abs().max())
    assert errors[1] < ddim_error / 2, (name, errors[1], ddim_error)


@pytest.mark.parametrize("name", SDE_SOLVERS)
def test_each_sde_solver_samples_the_data_distribution_closer_than_ddpm_at_the_same_nfe(objective, name):
    z = torch.randn(20000, 1, 1, 1, generator=torch.Generator().manual_seed(1))
    got = {}
    for solver in (name, None):
        spec = SampleSpec(method="ddpm", sampling_method=solver, num_steps=20)
        got[solver] = objective.sampler(spec).sample(z, exact_eps(objective), generator=5)[-1]
    x = got[name]
    # 20,000 draws: the standard error of the mean is 0.0035, of the std 0.0025
    assert abs(float(x.mean()) - MEAN) < 0.015 and abs(float(x.std()) - STD) < 0.025
    assert abs(float(got[None].std()) - STD) > 2 * abs(float(x.std()) - STD)  # DDPM at 20 steps: 0.39


@pytest.mark.parametrize("method, name", [("ddim", n) for n in ODE_SOLVERS]
                         + [("ddpm", n) for n in SDE_SOLVERS])
def test_step_wise_equals_whole_and_each_image_has_its_own_noise(method, name):
    model = _Linear()
    objective = create_objective({"objective": "ddpm", "noise_schedule": "cosine"})
    spec = SampleSpec(method=method, sampling_method=name, num_steps=6)
    pipe = SamplingPipeline(model, objective, spec, (2, 4, 4), 10)
    whole = pipe.generate([0, 1, 2], 7, labels=[1, 2, 3]).pixels
    stepped = pipe.generate([0, 1, 2], 7, labels=[1, 2, 3], steps=pipe.steps()).pixels
    alone = pipe.generate([1], 7, labels=[2]).pixels
    assert torch.equal(whole, stepped)
    torch.testing.assert_close(alone[0], whole[1], rtol=0, atol=1e-6)  # not the batch's draw
    assert pipe.generate([0], 7, labels=[1]).nfe == 6


@pytest.mark.parametrize("name", ODE_SOLVERS + SDE_SOLVERS)
def test_pixel_space_clips_x0_latent_space_does_not(name):
    method = "ddim" if name in ODE_SOLVERS else "ddpm"
    objective = create_objective({"objective": "ddpm", "noise_schedule": "cosine"})
    spec = SampleSpec(method=method, sampling_method=name, num_steps=8)
    pixel = SamplingPipeline(_Linear(gain=-5.0), objective, spec, (2, 4, 4), 10)
    latent = SamplingPipeline(_Linear(gain=-5.0), objective, spec, (2, 4, 4), 10, decode=lambda x: x)
    x_pixel = pixel.generate([0, 1], 0, labels=[0, 1]).pixels
    x_latent = latent.generate([0, 1], 0, labels=[0, 1]).pixels
    assert x_pixel.abs().max() <= 1 and x_latent.abs().max() > 10


def test_a_learned_variance_model_is_read_by_its_noise_half(objective):
    eps = exact_eps(objective)
    learned = create_objective({"objective": "ddpm"})  # ddpm_variance learned: 2C outputs

    def two_halves(x, t, **kwargs):
        return torch.cat([eps(x, t), torch.full_like(x, 7.0)], dim=1)

    z = torch.randn(4, 1, 2, 2, generator=torch.Generator().manual_seed(2))
    spec = SampleSpec(method="ddim", sampling_method=ODE_SOLVERS[0], num_steps=5)
    assert torch.equal(learned.sampler(spec).sample(z, two_halves)[-1], objective.sampler(spec).sample(z, eps)[-1])


def test_the_spec_takes_them_and_refuses_what_they_cannot_do():
    spec = SampleSpec(method="ddim", sampling_method="UniPC", num_steps=12)
    assert spec.sampling_method == "unipc" and spec.nfe == 12 and spec.with_nfe(7).num_steps == 7
    assert SampleSpec(method="ddim").sampling_method is None  # DDIM's own step
    with pytest.raises(SettingError) as err:
        SampleSpec(method="ddim", sampling_method="unipc", eta=1.0)
    assert (err.value.key, err.value.value) == ("eta", 1.0) and "dpm++2m-sde" in err.value.reason
    with pytest.raises(SettingError) as err:  # the SDE solver is ddpm's, not ddim's
        SampleSpec(method="ddim", sampling_method=SDE_SOLVERS[0])
    assert_names(str(err.value), SDE_SOLVERS[0], "method='ddim'", *ODE_SOLVERS)
    # a stored solver is kept under its own method, dropped under another or when it is not that method's
    checkpoint = {"method": "ddim", "sampling_method": "unipc", "num_steps": 20}
    assert SampleSpec.resolve({"num_steps": 8}, checkpoint).sampling_method == "unipc"
    assert SampleSpec.resolve({"method": "ddpm"}, checkpoint).sampling_method is None
    assert SampleSpec.resolve({"method": "ddim"}, {"sampling_method": "dopri5"}).sampling_method is None
    with pytest.raises(SettingError):  # typed: refused, not dropped
        SampleSpec.resolve({"method": "ddim", "sampling_method": "dopri5"}, explicit=True)
    for method in ("ode", "ddim"):  # a config's number where a name belongs: one error, no traceback
        with pytest.raises(SettingError) as err:
            SampleSpec.resolve({}, {"method": method, "sampling_method": 5})
        assert (err.value.key, err.value.value) == ("sampling_method", 5)


@pytest.mark.parametrize("method, name", [("ddim", n) for n in ODE_SOLVERS]
                         + [("ddpm", n) for n in SDE_SOLVERS])
def test_setting_up_a_solver_prints_no_third_party_notice(objective, method, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy 2's copy notice on diffusers' np.array(tensor)
        objective.steps(SampleSpec(method=method, sampling_method=name, num_steps=12)).restart()


def test_too_many_steps_for_the_integer_timesteps_is_one_error_naming_num_steps(objective):
    with pytest.raises(SettingError) as err:
        objective.steps(SampleSpec(method="ddim", sampling_method=ODE_SOLVERS[0], num_steps=1000))
    assert (err.value.key, err.value.value) == ("num_steps", 1000)


def test_sample_py_samples_a_dit_checkpoint_with_each_solver(tmp_path, capsys):
    ckpt = ddpm_checkpoint(tmp_path / "dit")
    labels = [3, 1]
    images = {}
    for method, name in [("ddim", n) for n in ODE_SOLVERS] + [("ddpm", n) for n in SDE_SOLVERS]:
        images[name] = grid_images(ckpt, tmp_path / name, labels, 5, "--method", method,
                                   "--sampling-method", name, "--nfe", "5")
        assert "NFE per image: 5" in capsys.readouterr().out
    ddim = grid_images(ckpt, tmp_path / "ddim", labels, 5, "--method", "ddim", "--nfe", "5")
    assert all(not np.array_equal(a, b) for a, b in zip(images[ODE_SOLVERS[0]], ddim, strict=True))
    argv = ["grid", "--ckpt", ckpt, "--method", "ddim", "--sampling-method", "dopri5", "--out",
            str(tmp_path / "bad")]
    assert sample.main(argv) == 2
    assert_names(one_sample_error(capsys, "grid"), "dopri5", *ODE_SOLVERS)
    assert not (tmp_path / "bad").exists()


class _Linear(torch.nn.Module):
    """A C-channel noise predictor eps = gain * x + a label shift: deterministic, cheap, class-aware."""

    learn_sigma, num_classes = False, 10

    def __init__(self, gain: float = 0.5) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x, t, y):
        return self.gain * x + 0.01 * y.view(-1, 1, 1, 1).to(x)
