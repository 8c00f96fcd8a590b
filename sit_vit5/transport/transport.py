"""Transport = path + prediction type + loss weighting + time intervals; training losses (SiT API).

What the network predicts is one entry of ``PREDICTIONS``: how its output turns into the ODE
velocity and the score, and the training residual. Loss weights are one small dict. Differences from
the official SiT code (on purpose): eps defaults are always defined (SiT can leave ``sample_eps =
None``), user-given eps are honoured, the SBDM SDE never starts at a singular t = 0, and the reverse
interval is exactly the forward one run backwards.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from ..names import choose
from .paths import PATHS, Path
from .per_sample import expand_t_like_x, mean_flat
from .rng import GeneratorLike, randn_like, resolve_generator, uniform

#: where a singular end of the time interval must be moved inside even when eps = 0 (SBDM start, SDE
#: end)
SDE_MIN_EPS = 1e-3


@dataclass(frozen=True)
class Prediction:
    """How a network output ``out`` for ``(x_t, t)`` relates to the transport quantities.

    ``velocity(path, out, x, t)`` and ``score(path, out, x, t)`` return tensors shaped like ``x``;
    ``residual(out, x0, u_t, sigma_t)`` is the per-element training error whose square is the loss.
    """

    velocity: Callable[[Path, Tensor, Tensor, Tensor], Tensor]
    score: Callable[[Path, Tensor, Tensor, Tensor], Tensor]
    residual: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _score_from_noise(path: Path, out: Tensor, x: Tensor, t: Tensor) -> Tensor:
    return out / -path.compute_sigma_t(expand_t_like_x(t, x))[0]  # s = -eps / sigma


def _velocity_from_noise(path: Path, out: Tensor, x: Tensor, t: Tensor) -> Tensor:
    return path.get_velocity_from_score(_score_from_noise(path, out, x, t), x, t)


PREDICTIONS: dict[str, Prediction] = {
    "velocity": Prediction(
        velocity=lambda path, out, x, t: out,
        score=lambda path, out, x, t: path.get_score_from_velocity(out, x, t),
        residual=lambda out, x0, ut, sigma: out - ut,
    ),
    "score": Prediction(
        velocity=lambda path, out, x, t: path.get_velocity_from_score(out, x, t),
        score=lambda path, out, x, t: out,
        residual=lambda out, x0, ut, sigma: sigma * out + x0,  # target s = -x0 / sigma, times sigma
    ),
    "noise": Prediction(
        velocity=_velocity_from_noise, score=_score_from_noise,
        residual=lambda out, x0, ut, sigma: out - x0,
    ),
}

#: loss weight as a function of (w_t, sigma_t), both (B, 1, ..., 1); applied to score / noise losses
#: as in SiT
LOSS_WEIGHTS: dict[str | None, Callable[[Tensor, Tensor], Tensor | float]] = {
    None: lambda w, sigma: 1.0, "velocity": lambda w, sigma: (w / sigma) ** 2,
    "likelihood": lambda w, sigma: w / sigma**2,
}


def default_eps(path_type: str, prediction: str) -> tuple[float, float]:
    """SiT's ``(train_eps, sample_eps)`` defaults: VP 1e-5 / 1e-3; Linear/GVP score or noise 1e-3 /
    1e-3; Linear/GVP velocity 0 / 0 (velocity is finite on the closed interval)."""
    if path_type == "VP":
        return 1e-5, 1e-3
    return (0.0, 0.0) if prediction == "velocity" else (1e-3, 1e-3)


class Transport:
    """Training objective and sampling intervals for one (path, prediction, loss weight) choice.

    Attributes: ``path_sampler`` (a :class:`Path`), ``prediction`` / ``model_type`` (its name),
    ``loss_weight``, ``train_eps`` and ``sample_eps`` (floats, never None).
    """

    def __init__(
        self, *, path_type: str = "Linear", prediction: str = "velocity",
        loss_weight: str | None = None, train_eps: float, sample_eps: float,
    ) -> None:
        self.path_type = path_type
        self.path_sampler: Path = choose(PATHS, path_type, "path_type")()
        self.prediction = prediction
        self.predict: Prediction = choose(PREDICTIONS, prediction, "prediction")
        self.loss_weight = loss_weight
        self.weight_fn = choose(LOSS_WEIGHTS, loss_weight, "loss_weight")
        for name, eps in (("train_eps", train_eps), ("sample_eps", sample_eps)):
            if not 0.0 <= float(eps) < 0.5:
                raise ValueError(f"{name} must lie in [0, 0.5), got {eps!r}")
        self.train_eps, self.sample_eps = float(train_eps), float(sample_eps)
        if loss_weight is not None and prediction == "velocity":
            warnings.warn(
                f"loss_weight={loss_weight!r} is ignored with prediction='velocity' (as in SiT)",
                stacklevel=2,
            )

    @property
    def model_type(self) -> str:
        return self.prediction

    def __repr__(self) -> str:
        return (
            f"Transport(path_type={self.path_type!r}, prediction={self.prediction!r}, "
            f"loss_weight={self.loss_weight!r}, train_eps={self.train_eps}, "
            f"sample_eps={self.sample_eps})"
        )

    # ---------------------------------------------------------------- time intervals
    def check_interval(
        self, train_eps: float, sample_eps: float, *, diffusion_form: str = "SBDM",
        sde: bool = False, reverse: bool = False, eval: bool = False, last_step_size: float = 0.0,
    ) -> tuple[float, float]:
        """Integration interval ``(t0, t1)`` (``(t1, t0)`` when ``reverse``), SiT signature.

        Linear/GVP: ``[eps, 1 - eps]`` (eps = 0 by default for velocity). VP: ``[0, 1 - eps]`` (VP
        is finite at t = 0). SDE: the end is ``1 - last_step_size`` when a last step follows, else
        ``1 - max(eps, SDE_MIN_EPS)`` (the score is singular at t = 1); with SBDM on Linear/GVP the
        start is at least ``SDE_MIN_EPS`` (w_t ~ 1/t, the official code's NaN).
        """
        eps = sample_eps if eval else train_eps
        singular_start = self.path_sampler.alpha_vanishes_at_noise
        t0 = eps if singular_start else 0.0
        t1 = 1.0 - eps
        if sde:
            if singular_start and diffusion_form == "SBDM":
                t0 = max(t0, SDE_MIN_EPS)
            t1 = 1.0 - last_step_size if last_step_size > 0 else 1.0 - max(eps, SDE_MIN_EPS)
        if t0 >= t1:
            raise ValueError(
                f"empty time interval [{t0}, {t1}] (eps={eps}, last_step_size={last_step_size})")
        return (t1, t0) if reverse else (t0, t1)

    # ---------------------------------------------------------------- model outputs
    def model_output(self, model: Callable[..., Tensor], x: Tensor, t: Tensor,
                     **model_kwargs) -> Tensor:
        """``model(x, t, **model_kwargs)`` with ``t`` of shape ``(B,)``, read by
        :meth:`read_output`."""
        return self.read_output(model(x, t, **model_kwargs), x)

    @staticmethod
    def read_output(out: Tensor, x: Tensor) -> Tensor:
        """The part of a network output the transport reads: a learn-sigma output with twice the
        channels of ``x`` (dim 1) is cut to its first half. Raises if the shape does not match
        ``x``."""
        if out.dim() == x.dim() and out.shape[1] == 2 * x.shape[1] and out.shape[2:] == x.shape[2:]:
            out = out[:, : x.shape[1]]
        if out.shape != x.shape:
            raise ValueError(f"model output shape {tuple(out.shape)} does not match input "
                             f"{tuple(x.shape)}")
        return out

    def velocity(self, out: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """Probability-flow velocity from a model output (shape ``x.shape``)."""
        return self.predict.velocity(self.path_sampler, out, x, t)

    def score(self, out: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """Score ``grad log p_t(x)`` from a model output (shape ``x.shape``)."""
        return self.predict.score(self.path_sampler, out, x, t)

    def get_drift(self) -> Callable[..., Tensor]:
        """SiT-style ``fn(x, t, model, **kwargs)`` giving the ODE velocity."""
        return lambda x, t, model, **kw: self.velocity(self.model_output(model, x, t, **kw), x, t)

    def get_score(self) -> Callable[..., Tensor]:
        """SiT-style ``fn(x, t, model, **kwargs)`` giving the score."""
        return lambda x, t, model, **kw: self.score(self.model_output(model, x, t, **kw), x, t)

    def prior_logp(self, z: Tensor) -> Tensor:
        """``log N(z; 0, I)`` per sample in nats: ``(B, ...) -> (B,)``."""
        dims = z[0].numel()
        return -0.5 * dims * math.log(2 * math.pi) - 0.5 * z.flatten(1).pow(2).sum(dim=1)

    # ---------------------------------------------------------------- training
    def sample(self, x1: Tensor, generator: GeneratorLike = None) -> tuple[Tensor, Tensor, Tensor]:
        """Draw ``x0 ~ N(0, I)`` then ``t ~ U[t0, t1]`` (that order, as SiT); returns ``(t (B,), x0,
        x1)``."""
        gen = resolve_generator(generator, len(x1))
        x0 = randn_like(x1, gen)
        t0, t1 = self.check_interval(self.train_eps, self.sample_eps)
        t = uniform(len(x1), gen, like=x1) * (t1 - t0) + t0
        return t, x0, x1

    def training_losses(
        self, model: Callable[..., Tensor], x1: Tensor, model_kwargs: dict | None = None,
        generator: GeneratorLike = None,
    ) -> dict[str, Tensor]:
        """Per-sample loss for data ``x1`` of shape ``(B, C, ...)``.

        Returns ``{"loss": (B,), "pred": model output (B, C, ...)}``. velocity: ``mean |v -
        u_t|^2``; noise: ``mean w |eps - x0|^2``; score: ``mean w |sigma s + x0|^2`` with the weight
        ``w`` from ``loss_weight``. Draws from the global RNG unless ``generator`` is given.
        """
        t, x0, x1 = self.sample(x1, generator)
        return self.losses_at(model, t, x0, x1, model_kwargs)

    def losses_at(
        self, model: Callable[..., Tensor], t: Tensor, x0: Tensor, x1: Tensor,
        model_kwargs: dict | None = None,
    ) -> dict[str, Tensor]:
        """The training loss of :meth:`training_losses` at given times ``t`` (B,) and noise ``x0``
        (shape of ``x1``): a deterministic evaluation, e.g. a held-out loss on a fixed grid of
        draws."""
        t, xt, ut = self.path_sampler.plan(t, x0, x1)
        out = self.model_output(model, xt, t, **(model_kwargs or {}))
        sigma_t = self.path_sampler.compute_sigma_t(expand_t_like_x(t, xt))[0]
        residual = self.predict.residual(out, x0, ut, sigma_t)
        if self.prediction == "velocity":
            weight = 1.0
        else:
            weight = self.weight_fn(self.path_sampler.compute_drift(xt, t)[1], sigma_t)
        return {"loss": mean_flat(weight * residual**2), "pred": out}


#: the keywords of :func:`create_transport`: the keys of a config's transport section it reads
TRANSPORT_KEYS = ("path_type", "prediction", "loss_weight", "train_eps", "sample_eps")


def create_transport(
    path_type: str = "Linear", prediction: str = "velocity", loss_weight: str | None = None,
    train_eps: float | None = None, sample_eps: float | None = None,
) -> Transport:
    """SiT-compatible factory. ``path_type``: Linear | GVP | VP; ``prediction``: velocity | score |
    noise; ``loss_weight``: None | velocity | likelihood; an eps left as None takes its
    :func:`default_eps` value; the names are checked where Transport looks them up."""
    default_train, default_sample = default_eps(path_type, prediction)
    return Transport(
        path_type=path_type, prediction=prediction, loss_weight=loss_weight,
        train_eps=default_train if train_eps is None else train_eps,
        sample_eps=default_sample if sample_eps is None else sample_eps,
    )
