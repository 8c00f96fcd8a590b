"""``SiTPipeline``: a diffusers ``DiffusionPipeline`` around our model, VAE and sampler settings.

    from sit_vit5 import SiTPipeline
    pipe = SiTPipeline.from_pretrained("exported/")  # written by python -m sit_vit5.export
    images = pipe([207, 360], num_inference_steps=50, guidance_scale=1.5, generator=0).images
    pipe.save_pretrained("copy/")                    # like any diffusers pipeline
    pipe.push_to_hub("me/my-sit")

Components: ``transformer`` (``SiT`` / ``ViT5``, a diffusers ``ModelMixin``), ``vae`` (an
``AutoencoderKL``; None for pixel-space models) and ``scheduler`` (``SiTScheduler``: the transport
and the sampler settings, ``scheduler/scheduler_config.json``); ``id2label`` (optional, in
``model_index.json``) names the classes. Images come from ``sit_vit5.sampling``'s
``SamplingPipeline``, the code behind ``sample.py``: the same seed and settings give the same
pixels as ``sample.py grid`` (image i of a call is sample i of the seed, whatever the batch).

The scheduler can be swapped as in diffusers: ``pipe.scheduler =
FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)`` (SiT objective: our ODE Euler
step by step, diffusers' sigma = 1 - t), ``DDPMScheduler`` / ``DDIMScheduler`` (ddpm objective).
``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads a saved folder where
sit_vit5 is installed: ``save_pretrained`` writes a three-line ``pipeline.py`` that imports this
class.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    ConfigMixin,
    DDIMScheduler,
    DDPMScheduler,
    DiffusionPipeline,
    ImagePipelineOutput,
    SchedulerMixin,
)
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerOutput
from PIL import Image
from torch import Tensor

from .diffusion import GaussianDiffusion
from .errors import SettingError
from .images import to_uint8
from .models import SiT
from .objective import Objective, create_objective
from .sampling import NonFiniteSampleError, SampleSpec, SamplingPipeline
from .transport.integrators import (
    FIXED_STEP_NFE,
    SDE_STEP_NFE,
    batch_time,
    ode_method,
    time_grid,
)
from .transport.rng import sample_seed
from .vae import downsampling_factor, vae_enabled

#: ``output_type`` values: diffusers' pil / np / pt (float in [0, 1]) and sample.py's uint8 pixels
OUTPUT_TYPES = ("pil", "np", "pt", "uint8")
#: the scheduler-config sections that describe how to sample (kept when a scheduler is swapped)
SETTINGS = ("transport", "sampler", "vae")
IMAGENET_CLASSES = 1000
#: the file diffusers' generic loader runs (``_class_name`` = [file stem, class] in model_index)
LOADER_FILE = "pipeline.py"
LOADER_SOURCE = '''"""diffusers' entry point for this folder (written by sit_vit5):
DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) takes SiTPipeline from the
installed sit_vit5 package."""

try:
    from sit_vit5.pipeline import SiTPipeline  # noqa: F401
except ImportError as err:
    raise ImportError("this pipeline folder needs the sit-vit5 package installed (see its README: "
                      "pip install -e <sit-vit5 checkout>)") from err
'''


def imagenet_id2label() -> dict[int, str] | None:
    """The 1000 ImageNet-1k class names by id (torchvision's list, shipped with the package: no
    download); None when torchvision is not installed."""
    try:
        from torchvision.models import ResNet50_Weights
    except ImportError:
        return None
    return dict(enumerate(ResNet50_Weights.IMAGENET1K_V1.meta["categories"]))


def read_id2label(path: str | Path) -> dict[int, str]:
    """Class names from a file: JSON (``{"0": "tench", ...}`` or a list of names) or text (one
    name per line, line i = class i)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(data, list):
        return dict(enumerate(map(str, data)))
    if isinstance(data, dict):
        return {int(k): str(v) for k, v in data.items()}
    raise ValueError(f"{path}: expected a JSON object {{id: name}}, a JSON list or one name a line")


# ----------------------------------------------------------------------------- the scheduler


class SiTScheduler(SchedulerMixin, ConfigMixin):
    """How to sample: ``transport`` (the objective's config section: ``objective`` sit with
    ``create_transport`` keywords path_type, prediction, ..., or ddpm with DiT's diffusion keys) and
    ``sampler`` (``SampleSpec`` fields: method, sampling_method, num_steps, cfg_scale, ...), plus
    where the latents come from (``vae``: the decoder's source id and scaling factor).

    ``SiTPipeline`` runs the whole trajectory with the transport's integrators (what sample.py
    runs: ODE, SDE, adaptive solvers, DDPM / DDIM). For a hand-written diffusers loop,
    :meth:`set_timesteps` / :meth:`step` cover the ODE Euler path (``timesteps`` = our t in [0, 1),
    0 = noise; ``step`` takes the raw network output and converts it to the transport's velocity)
    and, for the ddpm objective, DDPM / DDIM on DiT's respaced steps (``timesteps`` = DiT's integer
    steps; ``step`` takes the raw output, 2C channels for a learned variance: set
    ``transformer.return_sigma = True``). The DDPM / DDIM steps are our diffusion's, bit-identical
    to the pipeline's: diffusers' ``DDPMScheduler`` / ``DDIMScheduler`` compute the same formulas
    in another float32 order (:func:`diffusers_scheduler` builds them; up to ~3e-4 apart after 10
    cosine-schedule steps, whose first step amplifies rounding ~600x)::

        scheduler.set_timesteps(num_steps)
        for t in scheduler.timesteps:
            x = scheduler.step(transformer(x, t.expand(len(x)), y), t, x).prev_sample
    """

    config_name = "scheduler_config.json"
    _compatibles = ["FlowMatchEulerDiscreteScheduler", "DDPMScheduler", "DDIMScheduler"]
    order = 1
    init_noise_sigma = 1.0

    @register_to_config
    def __init__(
        self,
        transport: dict[str, Any] | None = None,
        sampler: dict[str, Any] | None = None,
        vae: dict[str, Any] | None = None,
    ) -> None:
        # fail now, naming the field, rather than at the first call (an export that cannot sample)
        spec, objective = self.spec(), self.transport()
        if spec.method not in objective.methods:
            raise SettingError("sampler.method", spec.method, f" cannot sample a model trained "
                               f"with the {objective.name} objective (scheduler transport: "
                               f"{dict(transport or {})}); valid: {', '.join(objective.methods)}")
        self.timesteps: Tensor | None = None
        self.num_inference_steps: int | None = None
        self._grid: Tensor | None = None  # the ODE time grid (timesteps + the end point)
        self._spaced: GaussianDiffusion | None = None  # DDPM / DDIM: the respaced process
        self._clip = False
        self._objective: Objective | None = None
        self._method: str | None = None

    def spec(self, **overrides: Any) -> SampleSpec:
        """The sampler settings as a ``SampleSpec``, with ``overrides`` (None values ignored)
        applied."""
        settings = {
            **(self.config.sampler or {}),
            **{k: v for k, v in overrides.items() if v is not None},
        }
        return SampleSpec(**settings)

    def transport(self) -> Objective:
        """The objective the model was trained with: SiT's ``Transport`` or DiT's diffusion."""
        return create_objective(self.config.transport or {})

    def scale_model_input(self, sample: Tensor, timestep: Any = None) -> Tensor:
        """Identity (diffusers' loop API: our model takes x_t as it is)."""
        return sample

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        pixel_space: bool | None = None,
    ) -> None:
        """Prepare ``timesteps`` for :meth:`step`. ``num_inference_steps``: the sampler's num_steps
        (None = the exported default; ODE: grid points, so num_steps - 1 Euler steps). Covers
        method ode with sampling_method euler, ddpm and ddim; ``pixel_space`` (None: the ``vae``
        section says "none") clips DDPM / DDIM x0 predictions to [-1, 1] as the pipeline does."""
        spec = self.spec(num_steps=num_inference_steps)
        objective = self._objective = self.transport()
        self._method, self._spaced = spec.method, None
        if spec.method == "ode" and ode_method(spec.sampling_method) == "euler":
            tr = objective.transport  # type: ignore[attr-defined]  # the sit objective
            t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, sde=False, eval=True)
            self._grid = time_grid(t0, t1, spec.num_steps, torch.empty(0, device=device))
            self.timesteps = self._grid[:-1]
        elif spec.method in ("ddpm", "ddim"):
            if pixel_space is None:
                pixel_space = self.config.vae is not None and not vae_enabled(
                    self.config.vae.get("name"))
            diffusion = objective.diffusion  # type: ignore[attr-defined]  # the ddpm objective
            self._spaced = diffusion.respace(
                str(spec.num_steps) if spec.method == "ddpm" else f"ddim{spec.num_steps}")
            self._clip = pixel_space
            # the network's steps: DiT's original integer steps, noisiest first
            self.timesteps = torch.tensor(self._spaced.timestep_map[::-1], device=device)
        else:
            raise SettingError("method", f"{spec.method}/{spec.sampling_method}",
                               ": step-wise sampling (set_timesteps / step) covers ode/euler, ddpm "
                               "and ddim; the SDE and the other ODE solvers run whole trajectories "
                               "in SiTPipeline.__call__")
        self.num_inference_steps = len(self.timesteps)

    def step(
        self,
        model_output: Tensor,
        timestep: float | Tensor,
        sample: Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None,
        return_dict: bool = True,
    ) -> SchedulerOutput | tuple[Tensor]:
        """``x`` at the next entry of ``timesteps`` from the raw network output at ``timestep``
        (one of ``timesteps``) and ``sample`` ``(B, C, H, W)``. ODE: an Euler step ``x + (t_next -
        t) v`` with the transport's velocity; DDPM / DDIM (eta 0): DiT's step (``generator``: the
        DDPM noise, a list = one per image, as in diffusers)."""
        if self.timesteps is None:
            raise RuntimeError("SiTScheduler.step: call set_timesteps first")
        if self._spaced is None:
            i = _index_of(self.timesteps, timestep)
            t, t_next = self._grid[i], self._grid[i + 1]
            out = model_output[:, : sample.shape[1]]  # learn-sigma output: the transport reads half
            tr = self._objective.transport  # type: ignore[union-attr]
            prev = sample + (t_next - t) * tr.velocity(out, sample, batch_time(t, sample))
        else:
            # our DiT step on the given output: exactly what the whole-trajectory loop computes
            index = len(self.timesteps) - 1 - _index_of(self.timesteps, timestep)
            t = torch.full((len(sample),), index, dtype=torch.long, device=sample.device)
            step = self._spaced.p_sample if self._method == "ddpm" else self._spaced.ddim_sample
            prev = step(lambda *args, **kwargs: model_output, sample, t, clip_denoised=self._clip,
                        generator=generator)["sample"]
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)


def _index_of(timesteps: Tensor, timestep: float | Tensor) -> int:
    hits = (timesteps == torch.as_tensor(timestep, device=timesteps.device)).nonzero()
    if len(hits) == 0:
        raise ValueError(f"timestep {float(timestep)!r} is not one of scheduler.timesteps")
    return int(hits[0, 0])


def diffusers_scheduler(
    diffusion: GaussianDiffusion, method: str, num_steps: int, pixel_space: bool
) -> DDPMScheduler | DDIMScheduler:
    """diffusers' ``DDPMScheduler`` (method ddpm) or ``DDIMScheduler`` (ddim, eta 0: step with
    ``eta=0, use_clipped_model_output=True``), timesteps set to the respaced steps our sampler uses
    (DiT's ``"num_steps"`` / ``"ddimN"``), with our betas and our float64 cumulative products
    rounded once to float32; ``pixel_space`` clips x0 to [-1, 1]. The same process as ours up to
    float32 rounding (see :class:`SiTScheduler`). Raises ``SettingError`` when DDIMScheduler's
    stride (T // num_steps) is not DiT's."""
    common = dict(num_train_timesteps=diffusion.original_num_steps, prediction_type="epsilon",
                  trained_betas=diffusion.original_betas.tolist(), clip_sample=pixel_space)
    if method == "ddpm":
        inner = DDPMScheduler(**common, variance_type=diffusion.model_var_type)
        ours = sorted(diffusion.respace(str(num_steps)).timestep_map, reverse=True)
        inner.set_timesteps(timesteps=ours)
    else:
        inner = DDIMScheduler(**common, set_alpha_to_one=True, steps_offset=0,
                              timestep_spacing="leading")
        ours = sorted(diffusion.respace(f"ddim{num_steps}").timestep_map, reverse=True)
        inner.set_timesteps(num_steps)
        if inner.timesteps.tolist() != ours:
            stride = ours[0] - ours[1] if len(ours) > 1 else diffusion.original_num_steps
            raise SettingError("num_steps", num_steps, f": DiT's ddim{num_steps} respacing "
                               f"(stride {stride}) is not DDIMScheduler's (stride "
                               f"{diffusion.original_num_steps // num_steps}); step-wise DDIM "
                               "needs a num_steps with equal strides (e.g. a divisor of "
                               f"{diffusion.original_num_steps}); the pipeline's DDIM has no limit")
    # diffusers multiplies float32 alphas; ours are float64 products, rounded here once
    inner.alphas_cumprod = torch.cumprod(1.0 - diffusion.original_betas, dim=0).float()
    return inner


def scheduler_from(
    transport: dict[str, Any], spec: SampleSpec, vae: dict[str, Any] | None = None
) -> SiTScheduler:
    """A ``SiTScheduler`` holding ``transport`` (the objective's config section) and every field of
    ``spec``."""
    sampler = dataclasses.asdict(spec)
    return SiTScheduler(transport=dict(transport), sampler=sampler, vae=dict(vae) if vae else None)


# ----------------------------------------------------------------------------- the pipeline


class _Ticking:
    """A model function that advances a progress bar once per evaluation."""

    def __init__(self, fn: Callable[..., Tensor], bar: Any) -> None:
        self.fn, self.bar = fn, bar

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        out = self.fn(*args, **kwargs)
        self.bar.update()
        return out


def evaluations(spec: SampleSpec) -> int | None:
    """Model evaluations per batch of the whole-trajectory sampler (None: adaptive solvers)."""
    if spec.method in ("ddpm", "ddim"):
        return spec.num_steps
    steps = spec.num_steps - 1
    if spec.method == "ode":
        per_step = FIXED_STEP_NFE.get(ode_method(spec.sampling_method))
        return None if per_step is None else steps * per_step
    per_step = SDE_STEP_NFE.get(spec.sampling_method)
    return None if per_step is None else steps * per_step + (spec.last_step is not None)


def _scheduler_kind(scheduler: Any) -> str:
    """"sit" (ours), "flow" (diffusers' flow-matching schedulers) or "eps" (DDPM family)."""
    if isinstance(scheduler, SiTScheduler):
        return "sit"
    if not (callable(getattr(scheduler, "set_timesteps", None))
            and callable(getattr(scheduler, "step", None))):
        raise TypeError(f"scheduler {type(scheduler).__name__}: not a diffusers scheduler "
                        "(needs set_timesteps / step)")
    if type(scheduler).__name__.startswith("FlowMatch"):
        return "flow"
    if hasattr(scheduler, "alphas_cumprod"):
        prediction = scheduler.config.get("prediction_type", "epsilon")
        if prediction != "epsilon":
            raise ValueError(f"{type(scheduler).__name__} with prediction_type={prediction!r}: our "
                             "ddpm-objective models predict epsilon")
        return "eps"
    raise TypeError(f"scheduler {type(scheduler).__name__}: SiTPipeline runs a SiTScheduler, a "
                    "FlowMatch* scheduler (sit objective) or a DDPM-family one (ddpm objective)")


class SiTPipeline(DiffusionPipeline):
    """Class-conditional image generation with a SiT / ViT-5 model (see the module docstring).

    ``id2label``: class id -> name (DiT's format: comma-separated synonyms allowed), saved in
    ``model_index.json``; None = ImageNet's names for a 1000-class model (torchvision's list),
    else none. ``labels`` maps each name to its id and ``get_label_ids`` looks names up, as in
    diffusers' ``DiTPipeline``.
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(
        self,
        transformer: SiT,
        scheduler: SiTScheduler,
        vae: AutoencoderKL | None = None,
        id2label: Mapping[int | str, str] | None = None,
    ) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        classes = getattr(transformer, "num_classes", None)
        if id2label is None and classes == IMAGENET_CLASSES:
            id2label = imagenet_id2label()
        names = {int(k): str(v) for k, v in (id2label or {}).items()}
        bad = [k for k in names if classes is not None and not 0 <= k < classes]
        if bad:
            raise ValueError(f"id2label: class id {bad[0]} is out of range for a model with "
                             f"{classes} classes")
        self.register_to_config(id2label=names or None)
        self.id2label = names
        self.labels = dict(sorted(
            (name.strip(), k) for k, value in names.items() for name in value.split(",")
        ))
        # the sampling settings, kept for a diffusers scheduler swapped in later
        self._settings = {k: scheduler.config.get(k) for k in SETTINGS}

    # ------------------------------------------------------------------ labels and arguments

    def get_label_ids(self, label: str | Sequence[str]) -> list[int]:
        """Class ids of label names (``"golden retriever"`` or a list of names), as DiTPipeline's;
        an unknown name raises a one-line ValueError naming it."""
        names = [label] if isinstance(label, str) else list(label)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"get_label_ids: {name!r} is not a label name (a str)")
            if name in self.labels:
                continue
            if not self.labels:
                raise ValueError(f"class_labels: {name!r} is a name, but this pipeline has no "
                                 "label names (id2label); pass class ids, or load it with "
                                 "id2label={...}")
            close = [k for k in self.labels if name.lower() in k.lower()][:3] or \
                difflib.get_close_matches(name, list(self.labels), n=3)  # "cat": "tiger cat"
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"class_labels: {name!r} is not a label name of this pipeline{hint} "
                             f"(pipe.labels maps its {len(self.labels)} names to ids)")
        return [self.labels[name] for name in names]

    def _label_ids(self, class_labels: Any) -> list[int]:
        """``class_labels`` (an id, a name, a list of either, an integer tensor / array) as ids in
        [0, num_classes), or a one-line TypeError / ValueError naming the value at fault."""
        n = self.transformer.num_classes
        expected = f"a class id (an int in [0, {n})) or a label name"
        if isinstance(class_labels, (torch.Tensor, np.ndarray)):
            dtype = class_labels.dtype
            integral = (not dtype.is_floating_point and not dtype.is_complex
                        and dtype != torch.bool) if isinstance(dtype, torch.dtype) \
                else np.issubdtype(dtype, np.integer)
            if not integral:
                raise TypeError(f"class_labels: a {dtype} tensor; class ids are integers in "
                                f"[0, {n})")
            items: list[Any] = class_labels.reshape(-1).tolist()
        elif isinstance(class_labels, (list, tuple)):
            items = list(class_labels)
        elif isinstance(class_labels, (str, int, np.integer)) and \
                not isinstance(class_labels, bool):
            items = [class_labels]
        else:
            kind = type(class_labels).__name__
            raise TypeError(f"class_labels: {class_labels!r} ({kind}) is not {expected}, nor a "
                            "list of them")
        if not items:
            raise ValueError(f"class_labels is empty: give at least one class id or label name "
                             f"(this model has {n} classes)")
        ids = []
        for item in items:
            if isinstance(item, str):
                ids += self.get_label_ids(item)
            elif isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
                ids.append(int(item))
            else:
                raise TypeError(f"class_labels: {item!r} ({type(item).__name__}) is not {expected}")
        bad = next((i for i in ids if not 0 <= i < n), None)
        if bad is not None:
            raise ValueError(f"class_labels: {bad} is out of range; this model has {n} classes "
                             f"(ids 0..{n - 1})")
        return ids

    @staticmethod
    def _global_seed(generator: int | torch.Generator | None) -> int:
        if generator is None:
            return int(torch.randint(0, 2**62, ()))
        if isinstance(generator, torch.Generator):
            return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        integer = isinstance(generator, (int, np.integer))
        if integer and not isinstance(generator, (bool, np.bool_)) and generator >= 0:
            return int(generator)
        raise TypeError(f"generator: expected a torch.Generator, a list of them (one per image), a "
                        f"seed >= 0 (int) or None, got {generator!r} ({type(generator).__name__})")

    def _generators(self, generator: Any, count: int) -> list[torch.Generator]:
        """One generator per image: a list as given (diffusers' convention); a seed / generator /
        None -> sample.py's per-sample streams of that seed (image i = sample i)."""
        if isinstance(generator, (list, tuple)):
            if len(generator) != count:
                raise ValueError(f"generator: a list of {len(generator)} generators for {count} "
                                 "images; pass one per image, or one generator / seed for all")
            for g in generator:
                if not isinstance(g, torch.Generator):
                    raise TypeError(f"generator: list entries must be torch.Generator, got {g!r}")
            return list(generator)
        seed = self._global_seed(generator)
        return [torch.Generator().manual_seed(sample_seed(seed, i)) for i in range(count)]

    # ------------------------------------------------------------------ sampling

    def vae_scale_factor(self) -> int:
        """Pixels per latent along each side (1 for a pixel-space model)."""
        return 1 if self.vae is None else downsampling_factor(self.vae)

    def sampling_settings(self) -> dict[str, Any]:
        """The ``transport`` / ``sampler`` / ``vae`` sections: the SiTScheduler's, else those a
        diffusers scheduler carries over from ``from_config``, else this pipeline's original
        ones."""
        config = self.scheduler.config
        if isinstance(self.scheduler, SiTScheduler) or config.get("transport") is not None:
            return {k: config.get(k) for k in SETTINGS}
        return dict(self._settings)

    def sampling_pipeline(
        self,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
    ) -> SamplingPipeline:
        """The ``sit_vit5.sampling.SamplingPipeline`` this pipeline's settings describe (what
        sample.py runs), on the execution device. With a diffusers scheduler its spec is the
        step-wise one (ODE Euler / DDPM on num_steps) carrying the guidance settings."""
        settings = self.sampling_settings()
        objective = create_objective(settings["transport"] or {})
        sampler = settings["sampler"] or {}
        overrides = {"num_steps": num_inference_steps, "cfg_scale": guidance_scale}
        if isinstance(self.scheduler, SiTScheduler):
            spec = self.scheduler.spec(**overrides)
        else:
            method = {"sit": "ode", "ddpm": "ddpm"}[objective.name]
            spec = SampleSpec.resolve({**overrides, "method": method, "sampling_method": "euler"},
                                      {k: v for k, v in sampler.items() if k != "method"})
        return SamplingPipeline.for_components(
            self.transformer, objective, spec, self.vae, self._execution_device
        )

    def _set_timesteps(self, pipe: SamplingPipeline) -> int:
        """Set a diffusers scheduler's timesteps for ``pipe``'s spec (flow matching: sigmas = 1 -
        our time grid, so that its Euler steps are ours); returns how many there are."""
        scheduler, kind = self.scheduler, _scheduler_kind(self.scheduler)
        objective, name, device = pipe.transport, type(self.scheduler).__name__, pipe.device
        if (kind == "flow") != (objective.name == "sit"):
            wanted = ("FlowMatchEulerDiscreteScheduler" if objective.name == "sit"
                      else "DDPMScheduler / DDIMScheduler") + " or the SiTScheduler"
            raise ValueError(f"{name} cannot sample a model trained with the {objective.name} "
                             f"objective; use {wanted}")
        if kind == "flow":
            tr = objective.transport  # type: ignore[attr-defined]
            t0, t1 = tr.check_interval(tr.train_eps, tr.sample_eps, sde=False, eval=True)
            if t1 != 1.0:
                raise ValueError(f"{name} ends at sigma 0 (t = 1), but this transport integrates "
                                 f"to t = {t1} ({tr!r}); keep the SiTScheduler")
            grid = time_grid(t0, t1, pipe.spec.num_steps, torch.empty(0))
            scheduler.set_timesteps(sigmas=(1.0 - grid[:-1].double()).numpy(), device=device)
        else:
            scheduler.set_timesteps(pipe.spec.num_steps, device=device)
        return len(scheduler.timesteps)

    def _denoise(self, pipe: SamplingPipeline, z: Tensor, y: Tensor,
                 gens: list[torch.Generator], bar: Any) -> Tensor:
        """The step-wise loop of a diffusers scheduler (diffusers' conventions: flow-matching
        sigma = 1 - t and flow = -velocity; DDPM family: integer steps, epsilon)."""
        scheduler, kind = self.scheduler, _scheduler_kind(self.scheduler)
        channels, batch = z.shape[1], len(z)
        tr = getattr(pipe.transport, "transport", None)  # the sit objective's (flow matching)
        self._set_timesteps(pipe)
        x = z * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching: none (1)
        extra = {"generator": gens} if "generator" in inspect.signature(scheduler.step).parameters \
            else {}
        learned = scheduler.config.get("variance_type") in ("learned", "learned_range")
        scale = getattr(scheduler, "scale_model_input", lambda x, t: x)
        for t in scheduler.timesteps:
            if kind == "flow":
                t_model = (1.0 - t / scheduler.config.num_train_timesteps).to(x).expand(batch)
                out = pipe.model_fn(x, t_model, y)[:, :channels]
                out = -tr.velocity(out, x, t_model)  # diffusers' flow points from data to noise
            else:
                out = pipe.model_fn(scale(x, t), t.to(x.device).expand(batch), y)
                out = out if learned else out[:, :channels]
            x = scheduler.step(out, t, x, **extra).prev_sample
            bar.update()
        return x

    def _batch(self, pipe: SamplingPipeline, gens: list[torch.Generator], labels: list[int],
               bar: Any) -> tuple[Tensor, np.ndarray]:
        """Float pixels ``(B, C, H, W)`` (CPU, about [-1, 1]) and sample.py's uint8 images of one
        batch; noise and labels as ``SamplingPipeline.generate`` draws them."""
        device = pipe.device
        z = torch.stack([torch.randn(pipe.latent_shape, generator=g, device=g.device)
                         for g in gens]).to(device)
        y = torch.tensor(labels, dtype=torch.long, device=device)
        if isinstance(self.scheduler, SiTScheduler):
            x = pipe.sample_fn(z, _Ticking(pipe.model_fn, bar), generator=gens, y=y)[-1]
        else:
            x = self._denoise(pipe, z, y, gens, bar)
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteSampleError("non-finite values (NaN/inf) in the samples: the model's "
                                       "outputs are not finite (NaN/inf weights?)")
        pixels = pipe.decode(x) if pipe.decode is not None else x
        return pixels.float().cpu(), to_uint8(pixels)

    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | str | Sequence[int | str] | Tensor,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        generator: int | torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        batch_size: int = 32,
    ) -> ImagePipelineOutput | tuple:
        """Images of ``class_labels`` (one image per label: class ids, or label names when the
        pipeline has ``id2label``).

        ``num_inference_steps`` / ``guidance_scale``: override the scheduler's ``num_steps`` (ODE:
        grid points; DDPM / DDIM: steps) / ``cfg_scale`` (None = the exported defaults).
        ``generator``: a list of ``torch.Generator`` (one per image: its noise, as in diffusers); an
        int is ``sample.py``'s ``--seed`` (image i is sample i of that seed: identical pixels); a
        ``torch.Generator`` draws such a seed; None = random. ``output_type``: "pil" (PIL images),
        "np" (float32 array (N, H, W, C) in [0, 1]), "pt" (float tensor (N, C, H, W) in [0, 1]),
        as diffusers returns them, or "uint8" (uint8 array (N, H, W, C): the pixels sample.py
        writes, which "pil" holds too). The progress bar ticks once per model evaluation.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; valid: {', '.join(OUTPUT_TYPES)}")
        labels = self._label_ids(class_labels)
        gens = self._generators(generator, len(labels))
        pipe = self.sampling_pipeline(num_inference_steps, guidance_scale)
        starts = range(0, len(labels), batch_size)
        per_batch = (evaluations(pipe.spec) if isinstance(self.scheduler, SiTScheduler)
                     else self._set_timesteps(pipe))
        total = float("inf") if per_batch is None else per_batch * len(starts)  # inf: unknown
        with self.progress_bar(total=total) as bar:
            batches = [self._batch(pipe, gens[lo : lo + batch_size], labels[lo : lo + batch_size],
                                   bar) for lo in starts]
        pixels = torch.cat([b[0] for b in batches])
        if output_type in ("np", "pt"):
            images: Any = (pixels / 2 + 0.5).clamp(0, 1)  # diffusers' postprocessing
            if output_type == "np":
                images = images.permute(0, 2, 3, 1).numpy()
        else:
            images = np.concatenate([b[1] for b in batches])
            if output_type == "pil":
                images = [Image.fromarray(im[..., 0] if im.shape[2] == 1 else im) for im in images]
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    # ------------------------------------------------------------------ saving and loading

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        """diffusers' ``save_pretrained``, plus what diffusers' generic loader needs:
        ``pipeline.py`` (imports this class) named in ``model_index.json``'s ``_class_name``. A
        swapped-in diffusers scheduler also records the sampling settings."""
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in ("commit_message", "private", "create_pr", "token",
                                          "repo_id") if k in kwargs}
        if not isinstance(self.scheduler, SiTScheduler) and \
                self.scheduler.config.get("transport") is None:
            self.scheduler.register_to_config(**self._settings)
        super().save_pretrained(save_directory, *args, **kwargs)
        folder = Path(save_directory)
        (folder / LOADER_FILE).write_text(LOADER_SOURCE)
        index_path = folder / self.config_name
        index = json.loads(index_path.read_text())
        index["_class_name"] = [Path(LOADER_FILE).stem, type(self).__name__]
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if push:
            self.push_to_hub(hub.pop("repo_id", folder.name), **hub)

    @classmethod
    def _dict_from_json_file(cls, json_file: str | Path) -> dict[str, Any]:
        # our own class needs no code from the folder: read the loader entry as the plain name
        config = super()._dict_from_json_file(json_file)
        if config.get("_class_name") == [Path(LOADER_FILE).stem, cls.__name__]:
            config["_class_name"] = cls.__name__
        return config


__all__ = [
    "OUTPUT_TYPES",
    "SiTPipeline",
    "SiTScheduler",
    "diffusers_scheduler",
    "imagenet_id2label",
    "read_id2label",
    "scheduler_from",
]
