"""The names the command lines and the config check, without importing torch (so a bad flag or
key is reported before seconds of heavy imports). Copies of the torch-importing modules' names;
``tests/test_first_minute.py`` checks each equals its source. ``choose`` looks a name up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

#: transport sampler methods (``transport.sampler.METHODS``) and DiT's (``diffusion.METHODS``)
TRANSPORT_METHODS: tuple[str, ...] = ("ode", "sde")
DIFFUSION_METHODS: tuple[str, ...] = ("ddpm", "ddim")
#: SDE diffusion coefficients D(t) (keys of ``transport.DIFFUSION_FORMS``)
DIFFUSION_FORMS: tuple[str, ...] = ("constant", "SBDM", "sigma", "linear", "decreasing",
                                    "increasing-decreasing")
#: adaptive ODE tolerances, SiT's sample.py defaults (read by SampleSpec and Sampler)
DEFAULT_ATOL, DEFAULT_RTOL = 1e-6, 1e-3
#: ODE methods of torchdiffeq offered (``transport.integrators`` uses these tables): model
#: evaluations per step of the fixed-grid Runge-Kutta ones, every fixed-grid one, the adaptive ones,
#: aliases. Not explicit_adams: torchdiffeq runs Adams-Bashforth without a corrector at up to its
#: highest order, and on the Gaussian closed form its error grows as steps are added (6e-4 at 32
#: steps, 4e-3 at 64; tests/test_solver_order.py)
ODE_STEP_NFE: dict[str, int] = {"euler": 1, "midpoint": 2, "heun2": 2, "heun3": 3, "rk4": 4}
#: Adams-Bashforth-Moulton (the two names are one torchdiffeq solver): multistep coefficients for
#: equal steps, so no time shift; its corrector iterates, so the NFE is counted, not fixed
ODE_EQUAL_STEP_METHODS: tuple[str, ...] = ("implicit_adams", "fixed_adams")
ODE_FIXED_STEP_METHODS: tuple[str, ...] = (*ODE_STEP_NFE, *ODE_EQUAL_STEP_METHODS)
ODE_ADAPTIVE_METHODS: tuple[str, ...] = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
ODE_ALIASES: dict[str, str] = {"heun": "heun2"}
#: SDE integrators: model evaluations per step (``transport.integrators.SDE_STEP_NFE``)
SDE_STEP_NFE: dict[str, int] = {"Euler": 1, "Heun": 2}
#: diffusers' multistep solvers of the probability-flow ODE (the source of this table): ``--method
#: ode --sampling-method NAME`` -> (scheduler class, its keywords besides ``use_flow_sigmas=True,
#: prediction_type="flow_prediction"``); one model evaluation per step. Only the ones that converge
#: at their order on the Gaussian closed form (tests/test_flow_schedulers.py); in diffusers 0.42:
#: DEIS is first order with flow sigmas, and DPM-Solver++ 2M / 3M start at sigma 0.999, not 1, so
#: the noise they are given is off by 1e-3 and their error stops falling near 4e-3.
FLOW_SOLVERS: dict[str, tuple[str, dict[str, Any]]] = {
    "unipc": ("UniPCMultistepScheduler", {}),
}
#: diffusers' multistep solvers of DiT's diffusion, on its trained betas with epsilon prediction:
#: ``--method ddim --sampling-method NAME`` (its probability-flow ODE, deterministic) or ``--method
#: ddpm --sampling-method NAME`` (its reverse SDE, noise each step) -> (scheduler class, keywords
#: besides ``trained_betas, prediction_type="epsilon"``); one model evaluation per step, on the
#: scheduler's own integer timesteps (999 first). No method name means DDIM's / DDPM's own step.
DIFFUSION_SOLVERS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "ddim": {"unipc": ("UniPCMultistepScheduler", {}),
             "dpm++2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"})},
    "ddpm": {"dpm++2m-sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"})},
}
#: SDE last steps (keys of ``transport.LAST_STEPS``; None / "none" = stop at t1)
LAST_STEPS: tuple[str | None, ...] = ("Mean", "Tweedie", "Euler", None, "none")
#: transport paths and model predictions (keys of ``transport.PATHS`` / ``PREDICTIONS``)
PATHS: tuple[str, ...] = ("Linear", "GVP", "VP")
PREDICTIONS: tuple[str, ...] = ("velocity", "score", "noise")
#: training objectives (``objective.OBJECTIVES``) and DiT's diffusion defaults (``DDPM_DEFAULTS``)
OBJECTIVES: tuple[str, ...] = ("sit", "ddpm", "meanflow")
DDPM_DEFAULTS: dict[str, Any] = {"diffusion_steps": 1000, "noise_schedule": "linear",
                                 "ddpm_variance": "learned"}
#: MeanFlow's sampler (``objective.meanflow``): num_steps equal jumps of the average velocity
MEANFLOW_METHODS: tuple[str, ...] = ("meanflow",)
#: MeanFlow's transport keys (``objective.meanflow.MEANFLOW_KEYS``) and their defaults: the official
#: ImageNet setting (github Gsunshine/meanflow, configs/default.py: the JAX code behind the paper's
#: tables). Times are drawn in MeanFlow's convention (t = 1 noise): two logit-normal draws, ordered.
MEANFLOW_DEFAULTS: dict[str, Any] = {
    "meanflow_time_mean": -0.4,  # P_mean (the paper's best, Table 1c: lognorm(-0.4, 1.0))
    "meanflow_time_std": 1.0,  # P_std
    # r's own logit-normal (py-meanflow's P_mean_r / P_std_r; its CIFAR-10 scripts: -4.0, 1.6);
    # None: r is drawn like t (the ImageNet setting)
    "meanflow_r_mean": None,
    "meanflow_r_std": None,
    "meanflow_ratio": 0.25,  # fraction of pairs with r != t (data_proportion 0.75 have r = t)
    "meanflow_norm_p": 1.0,  # adaptive weight power p (Table 1d: p = 1 best)
    "meanflow_norm_c": 0.01,  # adaptive weight constant c (norm_eps)
    "meanflow_omega": 1.0,  # guidance folded into the target: omega ...
    "meanflow_kappa": 0.5,  # ... and kappa (effective scale omega / (1 - kappa) = 2)
    "meanflow_class_dropout": 0.1,  # labels dropped by the objective (the unguided target there)
    "meanflow_tangent": "conditional",  # the JVP's dz/dt (MEANFLOW_TANGENTS)
}
#: what the MeanFlow target's JVP moves z along: the sample's velocity x - ε (MeanFlow, eq. 8),
#: or the model's own u(z, t, t) without gradient (improved MeanFlow, arXiv 2512.02012 §4)
MEANFLOW_TANGENTS: tuple[str, ...] = ("conditional", "predicted")
#: model precisions (keys of ``precision.PRECISIONS``)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
#: the SD-VAE decoders of SiT/DiT (``vae.SD_VAE_IDS``) and their latent scaling factor
SD_VAE_IDS: tuple[str, ...] = ("stabilityai/sd-vae-ft-ema", "stabilityai/sd-vae-ft-mse")
SD_VAE_SCALING_FACTOR = 0.18215
#: the largest seed (``train.seed``, ``sample.seed``, ``--seed``): torch.manual_seed takes 64 bits
MAX_SEED = 2**64 - 1
#: how bulk (FID) samples get their class labels: ``sample.py bulk --label-sampling`` (the first is
#: the default: DiT/SiT's uniform random labels; equal = ADM / REPA-E's balanced classes)
LABEL_SAMPLINGS: tuple[str, ...] = ("random", "equal")
#: REPA resize modes (``repa.INTERPOLATIONS``)
INTERPOLATIONS: tuple[str, ...] = ("bicubic", "bilinear", "nearest", "area")
#: ``--ckpt`` names fetched from their hosts (``models.official``: OFFICIAL_WEIGHTS, then ALIASES)
OFFICIAL_NAMES: tuple[str, ...] = (
    "SiT-XL-2-256.pt", "SiT-XL-2-512.pt", "SiT-L-2-256.pt", "SiT-B-2-256.pt", "SiT-S-2-256.pt",
    "DiT-XL-2-256x256.pt", "DiT-XL-2-512x512.pt", "SiT-XL-2-256x256.pt", "SiT-XL-2-512x512.pt",
)


#: size -> (depth, hidden_size, num_heads), as in DiT/SiT; the patch sizes offered
SIZES: dict[str, tuple[int, int, int]] = {
    "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16),
}
PATCH_SIZES: tuple[int, ...] = (2, 4, 8)
#: the backbone prefixes of registry names (the keys of ``models.registry.BACKBONES``)
BACKBONE_NAMES: tuple[str, ...] = ("SiT", "ViT5", "DiT")
#: registry names ``<backbone>-<size>/<patch>`` and the backbones that imply an objective (DiT =
#: the SiT network under the ddpm objective)
MODEL_NAME = re.compile(r"^(?P<backbone>\w+?)-(?P<size>S|B|L|XL)/(?P<patch>\d+)$")
NAME_OBJECTIVES: dict[str, str] = {"DiT": "ddpm"}
#: config overrides train.py adds for a name that implies an objective (DiT-*: DiT's recipe)
OBJECTIVE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "ddpm": ("transport.objective=ddpm", "model.learn_sigma=true", "sample.method=ddpm"),
}
#: every registered name (``models.list_models()``): backbone x size x patch
MODEL_NAMES: tuple[str, ...] = tuple(f"{b}-{s}/{p}" for b in BACKBONE_NAMES for s in SIZES
                                     for p in PATCH_SIZES)
#: the keys of the config's ``model`` section: ``name`` and ``models.valid_overrides()``
MODEL_KEYS: tuple[str, ...] = (
    "name", "class_dropout_prob", "depth", "grad_checkpointing", "hidden_size", "in_channels",
    "input_size", "interval_embed", "layer_scale_init", "learn_sigma", "mlp", "mlp_act",
    "mlp_norm_eps", "mlp_ratio", "norm", "num_classes", "num_heads", "num_registers", "patch_size",
    "pos_embed", "qk_norm", "qkv_bias", "register_rope_theta", "rope", "rope_theta",
    "t_freq_shift")


def ode_solver_name(name: str) -> str:
    """The canonical ODE ``sampling_method`` (lower case, ``heun`` -> ``heun2``)."""
    key = name.lower()
    return ODE_ALIASES.get(key, key)


def flow_solver_name(sampling_method: str | None) -> str | None:
    """The ``FLOW_SOLVERS`` key ``sampling_method`` names (any case, ``ODE_ALIASES`` applied), None
    for other methods."""
    if sampling_method is None:
        return None
    key = ode_solver_name(sampling_method)
    return key if key in FLOW_SOLVERS else None


def name_objective(model_name: str) -> str | None:
    """The objective a model name implies ("ddpm" for ``DiT-*``), None when it leaves it open."""
    match = MODEL_NAME.match(model_name)
    return NAME_OBJECTIVES.get(match["backbone"]) if match else None


V = TypeVar("V")


def choose(registry: Mapping[Any, V], key: Any, what: str) -> V:
    """``registry[key]``, or a ValueError naming the bad ``what`` value and the valid ones."""
    try:
        return registry[key]
    except (KeyError, TypeError):
        valid = ", ".join(repr(k) for k in registry)
        raise ValueError(f"unknown {what} {key!r}; valid options: {valid}") from None
