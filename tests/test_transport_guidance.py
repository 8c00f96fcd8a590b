"""Classifier-free guidance (sit_vit5.guidance, re-exported by sit_vit5.transport) inside the samplers."""

import pytest
import torch

from sit_vit5.transport import ClassifierFreeGuidance, Sampler, create_transport
from tests.gaussian_target import GaussianTarget

F64 = torch.float64
NUM_CLASSES = 3
# class means (row NUM_CLASSES = null class: the unconditional model) and a shared std, 4 "channels"
MEANS = torch.tensor(
    [[1.0, -1.0, 0.5, 2.0], [-0.5, 0.0, 1.5, -1.0], [0.3, 0.7, -0.2, 0.4], [0.0, 0.0, 0.0, 0.0]], dtype=F64
)
STD = torch.tensor([0.5, 0.8, 1.1, 0.6], dtype=F64)




class ClassGaussians:
    """model(x, t, y): the exact velocity of N(MEANS[y], STD^2); records the batch size of every call."""

    def __init__(self, path):
        self.path, self.batches = path, []

    def __call__(self, x, t, y):
        self.batches.append(len(x))
        return GaussianTarget(self.path, MEANS[y], STD).velocity(x, t)


def setup(path_type="Linear"):
    tr = create_transport(path_type)
    z = torch.randn(2048, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    y = torch.arange(2048) % NUM_CLASSES
    return tr, Sampler(tr), ClassGaussians(tr.path_sampler), (z - z.mean(0)) / z.std(0), y


def test_scale_one_is_the_conditional_model():
    tr, sampler, model, z, y = setup()
    fn = sampler.sample_ode(sampling_method="heun2", num_steps=6)
    guided = fn(z, ClassifierFreeGuidance(model, 1.0, null_class=NUM_CLASSES), y=y)
    assert set(model.batches) == {2048}  # no unconditional pass at all
    assert torch.equal(guided, fn(z, model, y=y))
    sde = sampler.sample_sde(num_steps=6)
    a = sde(z, ClassifierFreeGuidance(model, 1.0, NUM_CLASSES), generator=1, y=y)[-1]
    assert torch.equal(a, sde(z, model, generator=1, y=y)[-1])


@pytest.mark.parametrize("path_type", ["Linear", "GVP"])
def test_guided_ode_samples_the_extrapolated_gaussian(path_type):
    """With a shared std the guided field uncond + w (cond - uncond) is exactly the field of
    N(m_null + w (m_y - m_null), STD^2), so guided samples have that mean and std STD."""
    tr, sampler, model, z, y = setup(path_type)
    scale = 1.5
    x = sampler.sample_ode(sampling_method="heun2", num_steps=26)(
        z, ClassifierFreeGuidance(model, scale, NUM_CLASSES), y=y
    )[-1]
    assert sampler.last_nfe == 50 and set(model.batches) == {4096}  # one doubled call per evaluation
    for c in range(NUM_CLASSES):
        xc, expected_mean = x[y == c], MEANS[NUM_CLASSES] + scale * (MEANS[c] - MEANS[NUM_CLASSES])
        zc = z[y == c]
        exact = GaussianTarget(tr.path_sampler, expected_mean, STD).flow(zc, 0.0, 1.0)
        assert (xc - exact).abs().max().item() < 5e-3
        assert (xc.mean(0) - expected_mean).abs().max().item() < 0.1  # per-class z is not standardised


def test_legacy_three_channel_guidance_leaves_channel_three_conditional():
    tr, sampler, model, z, y = setup()
    fn = sampler.sample_ode(sampling_method="euler", num_steps=11)
    legacy = fn(z, ClassifierFreeGuidance(model, 4.0, NUM_CLASSES, cfg_channels=3), y=y)[-1]
    full = fn(z, ClassifierFreeGuidance(model, 4.0, NUM_CLASSES), y=y)[-1]
    cond = fn(z, model, y=y)[-1]
    # the fields are per-channel, so each channel's trajectory only sees its own field
    torch.testing.assert_close(legacy[:, 3], cond[:, 3], atol=1e-12, rtol=0)
    torch.testing.assert_close(legacy[:, :3], full[:, :3], atol=1e-12, rtol=0)
    assert (legacy[:, 3] - full[:, 3]).abs().max().item() > 0.1


def test_guidance_interval():
    """Guided only for t in [lo, hi]: equal to a hand-written switch, and no unconditional pass outside."""
    tr, sampler, model, z, y = setup()
    lo, hi, scale = 0.3, 0.6, 3.0

    def reference(x, t, y):
        cond = model(x, t, y)
        uncond = model(x, t, torch.full_like(y, NUM_CLASSES))
        inside = ((t >= lo) & (t <= hi))[:, None]
        return torch.where(inside, uncond + scale * (cond - uncond), cond)

    fn = sampler.sample_ode(sampling_method="euler", num_steps=11)  # t = 0, 0.1, ..., 0.9
    expected = fn(z, reference, y=y)[-1]
    model.batches.clear()
    got = fn(z, ClassifierFreeGuidance(model, scale, NUM_CLASSES, interval=(lo, hi)), y=y)[-1]
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    grid = torch.linspace(0, 1, 11, dtype=F64)[:-1]  # Euler evaluates at every grid time but the last
    assert model.batches.count(4096) == int(((grid >= lo) & (grid <= hi)).sum()) >= 3
    assert len(model.batches) == 10
    assert sampler.last_nfe == 10
    never = fn(z, ClassifierFreeGuidance(model, scale, NUM_CLASSES, interval=(2.0, 3.0)), y=y)[-1]
    assert torch.equal(never, fn(z, model, y=y)[-1])


def test_guided_sde_is_seeded():
    tr, sampler, model, z, y = setup("GVP")
    fn = sampler.sample_sde(sampling_method="Heun", num_steps=21)
    cfg = ClassifierFreeGuidance(model, 2.0, NUM_CLASSES)
    a = fn(z[:8], cfg, generator=list(range(8)), y=y[:8])[-1]
    assert sampler.last_nfe == 2 * 20 + 1
    b = fn(z[4:8], cfg, generator=list(range(4, 8)), y=y[4:8])[-1]
    torch.testing.assert_close(b, a[4:], atol=1e-12, rtol=0)


def test_guidance_without_an_interval_reads_no_mask(monkeypatch):
    """No interval: every step is guided, without building (and on a GPU syncing on) a per-step mask."""
    import sit_vit5.guidance as guidance

    tr, sampler, model, z, y = setup()
    fn = sampler.sample_ode(sampling_method="euler", num_steps=6)
    expected = fn(z, ClassifierFreeGuidance(model, 2.0, NUM_CLASSES, interval=(0.0, 1.0)), y=y)[-1]

    def no_mask(*args):
        raise AssertionError("a mask was built without an interval")

    monkeypatch.setattr(guidance, "in_interval", no_mask)
    got = fn(z, ClassifierFreeGuidance(model, 2.0, NUM_CLASSES), y=y)[-1]
    assert torch.equal(got, expected)  # guided everywhere, as the whole-range interval
