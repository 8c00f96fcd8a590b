"""Small-sample statistics for the experiment reports: Welch's t (two groups or any linear contrast
of group means, with its confidence interval) and Holm's step-down correction."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Contrast:
    """A linear contrast sum_i c_i * mean_i of independent groups: estimate, standard error, Welch–
    Satterthwaite degrees of freedom, two-sided p (H0: contrast = 0) and the ``level`` confidence
    interval."""

    estimate: float
    se: float
    df: float
    p: float
    ci: tuple[float, float]


def welch_contrast(
    groups: Sequence[Sequence[float]], coefs: Sequence[float], level: float = 0.95
) -> Contrast:
    """Welch's test of sum_i coefs[i] * mean(groups[i]) = 0 (unequal variances, each group n >= 2).

    Two groups with coefs (1, -1) is Welch's two-sample t-test
    (``scipy.stats.ttest_ind(equal_var=False)``). Zero variance in every group gives se = 0: p = 0
    for a non-zero estimate, nan for a zero one."""
    from scipy import stats

    if len(groups) != len(coefs) or any(len(g) < 2 for g in groups):
        raise ValueError(
            f"welch_contrast needs one coefficient per group and n >= 2 each, got sizes "
            f"{[len(g) for g in groups]} and {len(coefs)} coefficients"
        )
    estimate = sum(c * statistics.fmean(g) for c, g in zip(coefs, groups))
    terms = [c * c * statistics.variance(g) / len(g) for c, g in zip(coefs, groups)]
    var = sum(terms)
    if var == 0:
        p = math.nan if estimate == 0 else 0.0
        return Contrast(estimate, 0.0, math.inf, p, (estimate, estimate))
    se = math.sqrt(var)
    df = var**2 / sum(t * t / (len(g) - 1) for t, g in zip(terms, groups) if t > 0)
    p = float(2 * stats.t.sf(abs(estimate) / se, df))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    return Contrast(estimate, se, df, p, (estimate - half, estimate + half))


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Contrast:
    """Welch's two-sample test of mean(a) − mean(b) = 0, with its ``level`` confidence interval."""
    return welch_contrast([a, b], [1.0, -1.0], level)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order.

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max over j <= i of min(1, (m − j + 1)
    p_(j)). A nan p (no test possible) counts as 1, the conservative choice."""
    m = len(pvalues)
    clean = [1.0 if math.isnan(p) else float(p) for p in pvalues]
    order = sorted(range(m), key=lambda i: clean[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * clean[i]))
        adjusted[i] = running
    return adjusted


def power_two_sample(n: int, delta: float, sd: float, alpha: float = 0.05) -> float:
    """Power of the two-sided two-sample t-test with n per group, true difference ``delta`` and common
    standard deviation ``sd`` at level ``alpha`` (noncentral t with 2n − 2 degrees of freedom)."""
    from scipy import stats

    if n < 2 or sd <= 0:
        raise ValueError(f"power_two_sample needs n >= 2 and sd > 0, got n={n}, sd={sd}")
    df, shift = 2 * n - 2, delta / (sd * math.sqrt(2 / n))
    critical = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift))


def n_for_power(delta: float, sd: float, alpha: float = 0.05, power: float = 0.8, n_max: int = 10_000) -> int:
    """The smallest n per group whose ``power_two_sample`` reaches ``power``."""
    return next(n for n in range(2, n_max + 1) if power_two_sample(n, delta, sd, alpha) >= power)


def welch_summary(a: Sequence[float], b: Sequence[float], scale: float = 1.0) -> dict[str, object]:
    """The report fields of a vs b: ``effect`` = scale × (mean a − mean b), its 95 % ``ci`` (scaled), Welch's
    two-sided ``p``, and each side's ``mean`` and ``sd`` (unscaled); each side n >= 2."""
    c = welch(a, b)
    return {"effect": scale * c.estimate, "ci": (scale * c.ci[0], scale * c.ci[1]), "p": c.p,
            "mean": (statistics.fmean(a), statistics.fmean(b)), "sd": (statistics.stdev(a), statistics.stdev(b))}
