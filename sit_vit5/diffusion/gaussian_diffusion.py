"""Discrete Gaussian diffusion as DiT trains and samples it (DDPM, Ho et al. 2020; IDDPM, Nichol &
Dhariwal 2021; ADM), with DiT's API: ``create_diffusion(...)`` -> :class:`GaussianDiffusion`.

Forward process ``q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I)`` with ``abar_t = prod_{s<=t}
alpha_s``, ``alpha_s = 1 - beta_s``; t = 0 .. T-1, T-1 is noise. The network ``model(x_t, t_model,
**kwargs)`` receives ``t_model = timestep_map[t]``: the *original* integer step (0 .. 999 for DiT)
even on a respaced process. Its output is ``(B, C, ...)`` (epsilon or x_0) or, with a learned
variance, ``(B, 2C, ...)`` whose second half ``v`` in [-1, 1] sets ``log var = (v+1)/2 log beta_t +
(1-v)/2 log beta~_t`` (IDDPM eq. 15).

Randomness: every function that draws takes ``generator=`` as the transport's samplers do (None, a
seed, a ``torch.Generator``, or one per batch row -- then sample i depends only on its own seed).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from sit_vit5.names import DIFFUSION_METHODS, choose
from sit_vit5.transport.per_sample import mean_flat
from sit_vit5.transport.rng import (
    GeneratorLike,
    Resolved,
    randn_like,
    resolve_generator,
    to_device,
)

from .losses import discretized_gaussian_log_likelihood, normal_kl
from .schedule import named_betas, respace_betas, space_timesteps

ModelFn = Callable[..., Tensor]

#: samplers: ancestral DDPM (DiT's p_sample_loop) or DDIM (eta 0): the ``method`` of configs and
#: CLIs
METHODS = DIFFUSION_METHODS
#: what the first C output channels are: the noise (DiT) or the clean data
MEAN_TYPES = ("epsilon", "start_x")
#: learned_range: IDDPM interpolation (DiT); fixed_small: beta~_t; fixed_large: beta_t (beta~_1 at t
#: = 0)
VAR_TYPES = ("learned_range", "fixed_small", "fixed_large")
#: mse: L_simple (+ L_vlb with a learned variance, the hybrid loss); rescaled_mse: vb x T/1000;
#: kl: the VLB alone (bits); rescaled_kl: VLB x T
LOSS_TYPES = ("mse", "rescaled_mse", "kl", "rescaled_kl")


def _check(value: str, valid: Sequence[str], what: str) -> str:
    return choose({v: v for v in valid}, value, what)


class GaussianDiffusion:
    """A (possibly respaced) discrete Gaussian diffusion with its training loss and DDPM / DDIM
    samplers.

    ``betas``: ``(T,)`` float64 of *this* process; ``timestep_map``: the original step of each of
    its T steps (identity when not respaced). Schedule tensors are float64 and are gathered at ``t``
    in float32 (float64 for float64 data), as ADM does. """

    def __init__(
        self, *, betas: Tensor, model_mean_type: str = "epsilon",
        model_var_type: str = "learned_range", loss_type: str = "mse",
        timestep_map: Sequence[int] | None = None, original_betas: Tensor | None = None,
    ) -> None:
        betas = torch.as_tensor(betas, dtype=torch.float64)
        if betas.dim() != 1 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ValueError("betas must be a 1-D tensor with every entry in (0, 1]")
        self.model_mean_type = _check(model_mean_type, MEAN_TYPES, "model_mean_type")
        self.model_var_type = _check(model_var_type, VAR_TYPES, "model_var_type")
        self.loss_type = _check(loss_type, LOSS_TYPES, "loss_type")
        self.num_timesteps = len(betas)
        self.timestep_map = (
            list(range(len(betas))) if timestep_map is None else [int(s) for s in timestep_map]
        )
        if len(self.timestep_map) != len(betas):
            raise ValueError(
                f"timestep_map has {len(self.timestep_map)} entries for {len(betas)} steps"
            )
        # the schedule this process was respaced from (itself when not respaced): what respace()
        # starts from
        self.original_betas = (
            betas
            if original_betas is None
            else torch.as_tensor(original_betas, dtype=torch.float64)
        )
        self.original_num_steps = len(self.original_betas)
        if self.timestep_map[-1] >= self.original_num_steps:
            raise ValueError(
                f"timestep_map reaches step {self.timestep_map[-1]} of a "
                f"{self.original_num_steps}-step original process"
            )
        self.last_nfe: int | None = None  # model evaluations of the most recent sampling loop

        self.betas = betas
        alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(alphas, dim=0)
        self.alphas_cumprod_prev = torch.cat([betas.new_ones(1), self.alphas_cumprod[:-1]])
        ac, ac_prev = self.alphas_cumprod, self.alphas_cumprod_prev
        # posterior q(x_{t-1} | x_t, x_0) = N(c1 x_0 + c2 x_t, beta~_t), DDPM eq. 6-7
        self.posterior_variance = betas * (1.0 - ac_prev) / (1.0 - ac)
        # beta~_0 = 0: its log is clipped to beta~_1 (the t = 0 entry is only used by learned_range
        # / fixed_small)
        pv = self.posterior_variance
        self.posterior_log_variance_clipped = (
            torch.log(torch.cat([pv[1:2], pv[1:]])) if len(pv) > 1 else torch.log(betas)
        )
        self.posterior_mean_coef1 = betas * ac_prev.sqrt() / (1.0 - ac)
        self.posterior_mean_coef2 = (1.0 - ac_prev) * alphas.sqrt() / (1.0 - ac)
        large = torch.cat([pv[1:2], betas[1:]]) if len(pv) > 1 else betas
        self._fixed = {
            "fixed_small": (pv, self.posterior_log_variance_clipped),
            "fixed_large": (large, torch.log(large)),
        }

    def __repr__(self) -> str:
        return (
            f"GaussianDiffusion(num_timesteps={self.num_timesteps}, original_num_steps="
            f"{self.original_num_steps}, mean={self.model_mean_type!r}, "
            f"var={self.model_var_type!r}, loss={self.loss_type!r})"
        )

    def respace(self, timestep_respacing: str | Sequence[int] | None) -> GaussianDiffusion:
        """The same model's process on fewer steps (``"250"``, ``"ddim50"``, section counts; None /
        "" = all), respaced from the original schedule; mean, variance and loss types are kept."""
        if timestep_respacing is None or timestep_respacing == "":
            timestep_respacing = [self.original_num_steps]
        betas, keep = respace_betas(
            self.original_betas, space_timesteps(self.original_num_steps, timestep_respacing)
        )
        return GaussianDiffusion(
            betas=betas, model_mean_type=self.model_mean_type, model_var_type=self.model_var_type,
            loss_type=self.loss_type, timestep_map=keep, original_betas=self.original_betas,
        )

    # ---------------------------------------------------------------- helpers
    @property
    def learns_sigma(self) -> bool:
        """Whether the model must output ``2C`` channels (the second half sets the variance)."""
        return self.model_var_type == "learned_range"

    def _at(self, arr: Tensor, t: Tensor, x: Tensor) -> Tensor:
        """``arr[t]`` shaped ``(B, 1, ..., 1)`` on ``x``'s device, float32 (float64 for float64
        ``x``)."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        values = to_device(arr, t.device)[t.long()].to(device=x.device, dtype=dtype)
        return values.reshape(-1, *([1] * (x.dim() - 1)))

    def model_timesteps(self, t: Tensor) -> Tensor:
        """The timesteps the network sees: original integer steps ``timestep_map[t]`` (long, like
        ``t``)."""
        return to_device(torch.as_tensor(self.timestep_map, dtype=torch.long), t.device)[t.long()]

    def _timesteps(self, index: int, batch: int, device: torch.device) -> Tensor:
        return torch.full((batch,), index, dtype=torch.long, device=device)

    # ---------------------------------------------------------------- forward process
    def q_mean_variance(self, x_start: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and log variance of ``q(x_t | x_0)`` (variance ``(B, 1, ...)``)."""
        mean = self._at(self.alphas_cumprod.sqrt(), t, x_start) * x_start
        return (
            mean, self._at(1.0 - self.alphas_cumprod, t, x_start),
            self._at(torch.log1p(-self.alphas_cumprod), t, x_start),
        )

    def q_sample(
        self, x_start: Tensor, t: Tensor, noise: Tensor | None = None, *,
        generator: GeneratorLike = None,
    ) -> Tensor:
        """Draw ``x_t ~ q(x_t | x_0)``: ``sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise``."""
        if noise is None:
            noise = randn_like(x_start, resolve_generator(generator, len(x_start)))
        if noise.shape != x_start.shape:
            raise ValueError(
                f"noise shape {tuple(noise.shape)} differs from x_start {tuple(x_start.shape)}"
            )
        return (
            self._at(self.alphas_cumprod.sqrt(), t, x_start) * x_start
            + self._at((1.0 - self.alphas_cumprod).sqrt(), t, x_start) * noise
        )

    def q_posterior_mean_variance(
        self, x_start: Tensor, x_t: Tensor, t: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and clipped log variance of ``q(x_{t-1} | x_t, x_0)``."""
        mean = (
            self._at(self.posterior_mean_coef1, t, x_t) * x_start
            + self._at(self.posterior_mean_coef2, t, x_t) * x_t
        )
        return (
            mean, self._at(self.posterior_variance, t, x_t),
            self._at(self.posterior_log_variance_clipped, t, x_t),
        )

    def predict_xstart_from_eps(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        """``x_0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)``."""
        ac = self.alphas_cumprod
        return (
            self._at(1.0 / ac.sqrt(), t, x_t) * x_t
            - self._at((1.0 / ac - 1.0).sqrt(), t, x_t) * eps
        )

    def predict_eps_from_xstart(self, x_t: Tensor, t: Tensor, pred_xstart: Tensor) -> Tensor:
        """The inverse of :meth:`predict_xstart_from_eps`."""
        ac = self.alphas_cumprod
        return (self._at(1.0 / ac.sqrt(), t, x_t) * x_t - pred_xstart) / self._at(
            (1.0 / ac - 1.0).sqrt(), t, x_t
        )

    # ---------------------------------------------------------------- reverse process
    def split_output(self, out: Tensor, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(mean part (B, C, ...), variance values (B, C, ...) or None)`` from a model output."""
        channels = x.shape[1]
        if out.dtype != x.dtype and out.is_floating_point():
            out = out.to(
                x.dtype
            )  # bf16 autocast outputs: the diffusion arithmetic stays in x's precision
        if self.learns_sigma:
            if (
                out.shape[0] != x.shape[0]
                or out.shape[1] != 2 * channels
                or out.shape[2:] != x.shape[2:]
            ):
                raise ValueError(
                    f"a learned variance needs a model output of shape {(x.shape[0], 2 * channels)}"
                    f" + {tuple(x.shape[2:])} (learn_sigma=True), got {tuple(out.shape)}"
                )
            return out[:, :channels], out[:, channels:]
        if out.shape != x.shape:
            raise ValueError(
                f"model output shape {tuple(out.shape)} does not match x {tuple(x.shape)}; "
                "a 2C-channel (learn_sigma) model needs learn_sigma=True in create_diffusion"
            )
        return out, None

    def p_mean_variance_from_output(
        self, out: Tensor, x: Tensor, t: Tensor, clip_denoised: bool = False
    ) -> dict[str, Tensor]:
        """``p(x_{t-1} | x_t)`` from a raw model output: ``mean``, ``variance``, ``log_variance``,
        ``pred_xstart`` (clipped to [-1, 1] when ``clip_denoised``), ``eps`` (the mean part as
        noise)."""
        mean_part, var_values = self.split_output(out, x)
        if var_values is not None:
            min_log = self._at(self.posterior_log_variance_clipped, t, x)
            max_log = self._at(torch.log(self.betas), t, x)
            frac = (
                var_values + 1
            ) / 2  # IDDPM eq. 15: v in [-1, 1] interpolates log beta~_t .. log beta_t
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        else:
            var_arr, log_arr = self._fixed[self.model_var_type]
            variance, log_variance = self._at(var_arr, t, x), self._at(log_arr, t, x)
        if self.model_mean_type == "epsilon":
            pred_xstart = self.predict_xstart_from_eps(x, t, mean_part)
        else:
            pred_xstart = mean_part
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {
            "mean": mean, "variance": variance, "log_variance": log_variance,
            "pred_xstart": pred_xstart, "eps": self.predict_eps_from_xstart(x, t, pred_xstart),
        }

    def p_mean_variance(
        self, model: ModelFn, x: Tensor, t: Tensor, clip_denoised: bool = False,
        model_kwargs: dict | None = None,
    ) -> dict[str, Tensor]:
        """Call ``model(x, timestep_map[t], **model_kwargs)`` and return
        :meth:`p_mean_variance_from_output`."""
        out = model(x, self.model_timesteps(t), **(model_kwargs or {}))
        return self.p_mean_variance_from_output(out, x, t, clip_denoised)

    # ---------------------------------------------------------------- variational bound
    def vb_terms_bpd(
        self, model: ModelFn, x_start: Tensor, x_t: Tensor, t: Tensor, clip_denoised: bool = False,
        model_kwargs: dict | None = None,
    ) -> dict[str, Tensor]:
        """One VLB term per sample, in bits per dimension: ``KL(q(x_{t-1}|x_t,x_0) ||
        p(x_{t-1}|x_t))`` for t > 0 and the decoder NLL ``-log p(x_0 | x_1)`` at t = 0. Returns
        ``output (B,)``, ``pred_xstart``."""
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model, x_t, t, clip_denoised, model_kwargs)
        return self._vb_from(out, x_start, true_mean, true_log_var, t)

    def _vb_from(
        self, out: dict[str, Tensor], x_start: Tensor, true_mean: Tensor, true_log_var: Tensor,
        t: Tensor,
    ) -> dict[str, Tensor]:
        kl = mean_flat(
            normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])
        ) / math.log(2.0)
        decoder_nll = -mean_flat(
            discretized_gaussian_log_likelihood(
                x_start, means=out["mean"],
                log_scales=(0.5 * out["log_variance"]).expand_as(x_start),
            )
        )
        decoder_nll = decoder_nll / math.log(2.0)
        return {
            "output": torch.where(t.to(kl.device) == 0, decoder_nll, kl),
            "pred_xstart": out["pred_xstart"],
        }

    def prior_bpd(self, x_start: Tensor) -> Tensor:
        """``KL(q(x_{T-1} | x_0) || N(0, I))`` per sample in bits/dim ``(B,)`` (no model
        involved)."""
        t = self._timesteps(self.num_timesteps - 1, len(x_start), x_start.device)
        mean, _, log_var = self.q_mean_variance(x_start, t)
        return mean_flat(
            normal_kl(mean, log_var, torch.zeros_like(mean), torch.zeros_like(mean))
        ) / math.log(2.0)

    def calc_bpd_loop(
        self, model: ModelFn, x_start: Tensor, clip_denoised: bool = False,
        model_kwargs: dict | None = None, *, generator: GeneratorLike = None,
        progress: bool = False,
    ) -> dict[str, Tensor]:
        """The full VLB in bits/dim: ``vb (B, T)`` (one fresh ``x_t`` per term), ``prior_bpd (B,)``
        and ``total_bpd = prior_bpd + vb.sum(1)``; data on DDPM's 8-bit grid in [-1, 1]."""
        gen = resolve_generator(generator, len(x_start))
        terms = []
        with torch.no_grad():
            for index in tqdm(
                range(self.num_timesteps), disable=not progress, leave=False, desc="VLB"
            ):
                t = self._timesteps(index, len(x_start), x_start.device)
                x_t = self.q_sample(x_start, t, randn_like(x_start, gen))
                terms.append(
                    self.vb_terms_bpd(model, x_start, x_t, t, clip_denoised, model_kwargs)["output"]
                )
        vb, prior = torch.stack(terms, dim=1), self.prior_bpd(x_start)
        return {"total_bpd": prior + vb.sum(dim=1), "prior_bpd": prior, "vb": vb}

    # ---------------------------------------------------------------- training
    def sample_timesteps(
        self, batch: int, device: torch.device | str | None = None, *,
        generator: GeneratorLike = None,
    ) -> Tensor:
        """Uniform training steps ``(batch,)`` long in ``[0, T)`` (CPU draw, then moved, like the
        transport)."""
        gen = resolve_generator(generator, batch)
        if gen is None:
            t = torch.randint(0, self.num_timesteps, (batch,))
        elif isinstance(gen, torch.Generator):
            t = torch.randint(0, self.num_timesteps, (batch,), generator=gen, device=gen.device)
        else:
            t = torch.cat(
                [
                    torch.randint(0, self.num_timesteps, (1,), generator=g, device=g.device)
                    for g in gen
                ]
            )
        return to_device(t, device) if device is not None else t

    def training_losses(
        self, model: ModelFn, x_start: Tensor, t: Tensor, model_kwargs: dict | None = None,
        noise: Tensor | None = None, *, generator: GeneratorLike = None,
    ) -> dict[str, Tensor]:
        """Per-sample losses ``(B,)`` at steps ``t`` (indices of this process).

        mse losses: ``mse`` = mean ``|target - out|^2`` (target = noise or x_0) and, with a learned
        variance, ``vb`` = the VLB term of :meth:`vb_terms_bpd` computed with the mean part
        *detached* so it trains only the variance (IDDPM's L_hybrid = L_simple + L_vlb; their lambda
        = 0.001 is the 1/1000 of the bits-per-dim normalisation here); ``loss = mse + vb``. kl
        losses: ``loss`` = ``vb`` (x T when rescaled). Also returns ``pred`` (the raw model output).
        """
        model_kwargs = model_kwargs or {}
        if noise is None:
            noise = randn_like(x_start, resolve_generator(generator, len(x_start)))
        t = t.to(x_start.device)
        x_t = self.q_sample(x_start, t, noise)
        out = model(x_t, self.model_timesteps(t), **model_kwargs)
        mean_part, var_values = self.split_output(out, x_start)
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        terms: dict[str, Tensor] = {"pred": out}
        if self.loss_type in ("kl", "rescaled_kl"):
            vb = self._vb_from(
                self.p_mean_variance_from_output(out, x_t, t), x_start, true_mean, true_log_var, t
            )["output"]
            terms["vb"] = vb
            terms["loss"] = vb * self.num_timesteps if self.loss_type == "rescaled_kl" else vb
            return terms
        target = noise if self.model_mean_type == "epsilon" else x_start
        terms["mse"] = mean_flat((target - mean_part) ** 2)
        if var_values is not None:
            # stop-gradient on the mean: the VLB term trains the variance only (IDDPM sec. 3.1)
            frozen = torch.cat([mean_part.detach(), var_values], dim=1)
            vb = self._vb_from(
                self.p_mean_variance_from_output(frozen, x_t, t), x_start, true_mean, true_log_var,
                t,
            )["output"]
            if self.loss_type == "rescaled_mse":
                vb = (
                    vb * self.num_timesteps / 1000.0
                )  # IDDPM: the VLB of a T-step process, as if T = 1000
            terms["vb"] = vb
            terms["loss"] = terms["mse"] + vb
        else:
            terms["loss"] = terms["mse"]
        return terms

    # ---------------------------------------------------------------- sampling
    def _initial(
        self, shape: Sequence[int], noise: Tensor | None, device: torch.device | str | None,
        model: ModelFn, gen: Resolved,
    ) -> Tensor:
        if noise is not None:
            if tuple(noise.shape) != tuple(shape):
                raise ValueError(
                    f"noise shape {tuple(noise.shape)} differs from shape {tuple(shape)}"
                )
            return noise
        if device is None:
            params = getattr(model, "parameters", None)
            device = next(params()).device if callable(params) else torch.device("cpu")
        return randn_like(torch.empty(tuple(shape), device=device), gen)

    def p_sample(
        self, model: ModelFn, x: Tensor, t: Tensor, clip_denoised: bool = False,
        model_kwargs: dict | None = None, *, generator: GeneratorLike = None,
    ) -> dict[str, Tensor]:
        """One ancestral step ``x_{t-1} = mean + [t > 0] sqrt(var) z``; returns ``sample``,
        ``pred_xstart``. The noise ``z`` is drawn at t = 0 too (then unused), so a seeded stream
        advances once per step."""
        out = self.p_mean_variance(model, x, t, clip_denoised, model_kwargs)
        z = randn_like(x, resolve_generator(generator, len(x)))
        nonzero = (t != 0).to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return {
            "sample": out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * z,
            "pred_xstart": out["pred_xstart"],
        }

    def ddim_sample(
        self, model: ModelFn, x: Tensor, t: Tensor, clip_denoised: bool = False,
        model_kwargs: dict | None = None, eta: float = 0.0, *, generator: GeneratorLike = None,
    ) -> dict[str, Tensor]:
        """One DDIM step (Song et al. 2021, eq. 12): ``x_{t-1} = sqrt(abar_{t-1}) x0 + sqrt(1 -
        abar_{t-1} - s^2) eps + s z`` with ``s = eta sqrt((1 - abar_{t-1}) / (1 - abar_t)) sqrt(1 -
        abar_t / abar_{t-1})``."""
        out = self.p_mean_variance(model, x, t, clip_denoised, model_kwargs)
        ab, ab_prev = self._at(self.alphas_cumprod, t, x), self._at(self.alphas_cumprod_prev, t, x)
        sigma = eta * ((1 - ab_prev) / (1 - ab)).sqrt() * (1 - ab / ab_prev).sqrt()
        mean = out["pred_xstart"] * ab_prev.sqrt() + (1 - ab_prev - sigma**2).sqrt() * out["eps"]
        z = randn_like(x, resolve_generator(generator, len(x)))
        nonzero = (t != 0).to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return {"sample": mean + nonzero * sigma * z, "pred_xstart": out["pred_xstart"]}

    def _loop(
        self, step: Callable[..., dict[str, Tensor]], model: ModelFn, shape: Sequence[int],
        noise: Tensor | None, clip_denoised: bool, model_kwargs: dict | None, progress: bool,
        device: torch.device | str | None, generator: GeneratorLike, desc: str, **step_kwargs,
    ) -> Iterator[dict[str, Tensor]]:
        gen = resolve_generator(generator, shape[0])
        x = self._initial(shape, noise, device, model, gen)
        calls = [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            return model(*args, **kwargs)

        with torch.no_grad():
            for index in tqdm(
                range(self.num_timesteps)[::-1], disable=not progress, leave=False, desc=desc
            ):
                t = self._timesteps(index, shape[0], x.device)
                out = step(counted, x, t, clip_denoised, model_kwargs, generator=gen, **step_kwargs)
                x = out["sample"]
                self.last_nfe = calls[0]
                yield out

    def p_sample_loop_progressive(
        self, model: ModelFn, shape: Sequence[int], noise: Tensor | None = None,
        clip_denoised: bool = False, model_kwargs: dict | None = None, progress: bool = False,
        device: torch.device | str | None = None, *, generator: GeneratorLike = None,
    ) -> Iterator[dict[str, Tensor]]:
        """Yield each step's ``{sample, pred_xstart}`` of :meth:`p_sample_loop`."""
        yield from self._loop(
            self.p_sample, model, shape, noise, clip_denoised, model_kwargs, progress, device,
            generator, "DDPM",
        )

    def p_sample_loop(
        self, model: ModelFn, shape: Sequence[int], noise: Tensor | None = None,
        clip_denoised: bool = False, model_kwargs: dict | None = None, progress: bool = False,
        device: torch.device | str | None = None, *, generator: GeneratorLike = None,
    ) -> Tensor:
        """Ancestral (DDPM) sampling from ``noise`` (or fresh N(0, I) of ``shape``) over this
        process's T steps; returns the final sample ``shape``. One model call per step
        (``last_nfe``)."""
        steps = self.p_sample_loop_progressive(
            model, shape, noise, clip_denoised, model_kwargs, progress, device, generator=generator
        )
        return deque(steps, maxlen=1)[0]["sample"]

    def ddim_sample_loop_progressive(
        self, model: ModelFn, shape: Sequence[int], noise: Tensor | None = None,
        clip_denoised: bool = False, model_kwargs: dict | None = None, progress: bool = False,
        device: torch.device | str | None = None, eta: float = 0.0, *,
        generator: GeneratorLike = None,
    ) -> Iterator[dict[str, Tensor]]:
        """Yield each step's ``{sample, pred_xstart}`` of :meth:`ddim_sample_loop`."""
        yield from self._loop(
            self.ddim_sample, model, shape, noise, clip_denoised, model_kwargs, progress, device,
            generator, "DDIM", eta=eta,
        )

    def ddim_sample_loop(
        self, model: ModelFn, shape: Sequence[int], noise: Tensor | None = None,
        clip_denoised: bool = False, model_kwargs: dict | None = None, progress: bool = False,
        device: torch.device | str | None = None, eta: float = 0.0, *,
        generator: GeneratorLike = None,
    ) -> Tensor:
        """DDIM sampling (deterministic for ``eta = 0``) over this process's T steps; returns the
        sample."""
        steps = self.ddim_sample_loop_progressive(
            model, shape, noise, clip_denoised, model_kwargs, progress, device, eta,
            generator=generator,
        )
        return deque(steps, maxlen=1)[0]["sample"]


def create_diffusion(
    timestep_respacing: str | Sequence[int] | None, noise_schedule: str = "linear",
    use_kl: bool = False, sigma_small: bool = False, predict_xstart: bool = False,
    learn_sigma: bool = True, rescale_learned_sigmas: bool = False, diffusion_steps: int = 1000,
) -> GaussianDiffusion:
    """DiT's factory. ``timestep_respacing``: None / "" (all ``diffusion_steps``), "250", "ddim50",
    or section counts (see :func:`~.schedule.space_timesteps`); the network still receives the
    original step numbers. DiT trains with ``create_diffusion("")`` and samples with
    ``create_diffusion("250")``."""
    if use_kl:
        loss_type = "rescaled_kl"
    elif rescale_learned_sigmas:
        loss_type = "rescaled_mse"
    else:
        loss_type = "mse"
    full = GaussianDiffusion(
        betas=named_betas(noise_schedule, diffusion_steps),
        model_mean_type="start_x" if predict_xstart else "epsilon",
        model_var_type="learned_range"
        if learn_sigma
        else ("fixed_small" if sigma_small else "fixed_large"),
        loss_type=loss_type,
    )
    return full.respace(timestep_respacing)
