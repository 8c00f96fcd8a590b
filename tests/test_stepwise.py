"""The one step-wise loop (``stepwise.denoise``) and its repeated-timestep guard, on a toy
``Steps`` whose answer is known in closed form."""

from __future__ import annotations

import pytest
import torch

from sit_vit5.stepwise import denoise, refuse_repeated_timesteps
from sit_vit5.utils.errors import SettingError


class HalvingSteps:
    """x <- x - 0.5 * model_output, with the model returning x: each step halves x."""

    def __init__(self, n: int, sigma: float = 2.0) -> None:
        self.timesteps = torch.arange(n, 0, -1)
        self.init_noise_sigma = sigma
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1

    def model_input(self, x, t):
        return x

    def model_time(self, t, x):
        return t.expand(len(x))

    def step(self, model_output, t, x, generator=None):
        return x - 0.5 * model_output


def test_denoise_gives_the_closed_form_and_the_whole_trajectory_when_asked():
    steps, z = HalvingSteps(4), torch.randn(3, 2, 4, 4)
    times = []

    def model(x, t, scale):
        times.append(t.tolist())
        return x * scale

    trajectory: list[torch.Tensor] = []
    out = denoise(steps, z, model, trajectory=trajectory, scale=1.0)
    torch.testing.assert_close(out, z * 2.0 * 0.5 ** 4)  # sigma 2, then four halvings
    assert len(trajectory) == 5 and trajectory[-1] is out
    torch.testing.assert_close(trajectory[0], z * 2.0)
    for earlier, later in zip(trajectory, trajectory[1:]):
        torch.testing.assert_close(later, earlier / 2)
    assert times == [[4] * 3, [3] * 3, [2] * 3, [1] * 3] and steps.restarts == 1
    assert denoise(steps, z, model, scale=1.0).shape == z.shape


def test_repeated_timesteps_are_refused_naming_num_steps():
    refuse_repeated_timesteps(torch.tensor([999, 500, 0]), 3, ": unused")
    with pytest.raises(SettingError) as err:
        refuse_repeated_timesteps(torch.tensor([999, 998, 998, 0]), 4, ": two coincide")
    assert err.value.key == "num_steps" and err.value.value == 4
    assert str(err.value) == "num_steps=4: two coincide"
