"""SHA-256 of the images every sampling front end makes from two tiny models (objective sit and ddpm):
``SiTPipeline`` with its own scheduler and with diffusers' swapped in, and hand-written step-wise loops
over ``SiTScheduler``. A refactor of the sampling code must leave every line unchanged:

    OMP_NUM_THREADS=1 python tools/sample_hashes.py > before.txt   # (on the old commit)
    OMP_NUM_THREADS=1 python tools/sample_hashes.py | diff before.txt -

(``tests/conftest.py``'s ``SIT_VIT5_SAMPLE_SHA_LOG`` does the same for every ``sample.py`` call of the suite.)
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler

from sit_vit5.hub import SiTPipeline, scheduler_from
from sit_vit5.models import create_model
from sit_vit5.sample_spec import SampleSpec

TINY = dict(input_size=8, in_channels=1, num_classes=10, depth=2, hidden_size=64, num_heads=4, patch_size=2)
SETTINGS = {
    "sit": ({"objective": "sit"}, [dict(method="ode", sampling_method="euler", num_steps=6),
                                   dict(method="ode", sampling_method="heun", num_steps=5),
                                   dict(method="sde", num_steps=6),
                                   dict(method="ode", sampling_method="euler", num_steps=6, cfg_scale=2.0)]),
    "ddpm": ({"objective": "ddpm", "ddpm_variance": "learned", "diffusion_steps": 100},
             [dict(method="ddpm", num_steps=5), dict(method="ddim", num_steps=5),
              dict(method="ddpm", num_steps=5, cfg_scale=2.0)]),
}


def digest(x: torch.Tensor | np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()[:16]


def model_for(objective: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("ViT5-S/2", **TINY, learn_sigma=objective == "ddpm")
    with torch.no_grad():  # adaLN-Zero outputs 0 at init: give every weight a value
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def stepwise(pipe: SiTPipeline, labels: list[int], seed: int) -> np.ndarray:
    """The README's hand-written diffusers loop over the pipeline's scheduler."""
    model, scheduler = pipe.transformer, pipe.scheduler
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(labels), model.in_channels, model.input_size, model.input_size, generator=gen)
    y = torch.tensor(labels)
    scheduler.set_timesteps()
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, t.expand(len(x)), y), t, x, generator=gen).prev_sample
    return x.numpy()


def main() -> None:
    torch.set_num_threads(1)
    labels = [0, 3, 7]
    for name, (transport, specs) in SETTINGS.items():
        model = model_for(name)
        for settings in specs:
            spec = SampleSpec(**settings)
            pipe = SiTPipeline(transformer=model, scheduler=scheduler_from(transport, spec, {"name": "none"}))
            tag = f"{name} {' '.join(f'{k}={v}' for k, v in settings.items())}"
            images = pipe(labels, generator=1, output_type="uint8").images
            print(f"{tag} | pipeline {digest(images)}")
            if settings.get("cfg_scale", 1.0) == 1.0 and settings.get("sampling_method") in (None, "euler") \
                    and settings["method"] != "sde":
                print(f"{tag} | SiTScheduler loop {digest(stepwise(pipe, labels, 2))}")
                swap = {"sit": FlowMatchEulerDiscreteScheduler, "ddpm": DDPMScheduler}[name]
                if settings["method"] == "ddim":
                    swap = DDIMScheduler
                pipe.scheduler = swap.from_config(pipe.scheduler.config)
                if name == "ddpm":
                    from sit_vit5.hub import diffusers_scheduler  # our process as diffusers' scheduler

                    diffusion = pipe.sampling_pipeline().objective.diffusion
                    pipe.scheduler = diffusers_scheduler(diffusion, settings["method"], spec.num_steps, True)
                images = pipe(labels, generator=1, output_type="uint8").images
                print(f"{tag} | {type(pipe.scheduler).__name__} {digest(images)}")


if __name__ == "__main__":
    main()
