"""Welch's test (two groups and contrasts) against scipy and closed forms; Holm against a hand
computation."""

from __future__ import annotations

import math

import pytest
from digits_study import stats
from scipy import stats as sps

holm, welch, welch_contrast = stats.holm, stats.welch, stats.welch_contrast


@pytest.mark.parametrize(
    "a, b",
    [
        ([1.0, 1.1, 1.3], [2.0, 2.2, 2.1, 2.5]),
        ([0.39, 0.41], [0.40, 0.43, 0.38]),
        ([5, 7, 6], [0, 1, 0]),
    ],
)
def test_welch_p_matches_scipy(a, b):
    c = welch(a, b)
    assert c.p == pytest.approx(sps.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-10)
    assert c.estimate == pytest.approx(sum(a) / len(a) - sum(b) / len(b))


def test_welch_ci_by_hand():
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0]  # variances 1 and 4, n = 3: se^2 = 1/3 + 4/3 = 5/3
    c = welch(a, b)
    assert c.se == pytest.approx(math.sqrt(5 / 3))
    df = (5 / 3) ** 2 / ((1 / 3) ** 2 / 2 + (4 / 3) ** 2 / 2)  # Welch–Satterthwaite = 25/8.5
    assert c.df == pytest.approx(df)
    half = sps.t.ppf(0.975, df) * math.sqrt(5 / 3)
    assert c.ci == pytest.approx((-2 - half, -2 + half))
    assert c.ci[0] < c.estimate < c.ci[1]


def test_contrast_of_two_differences():
    groups = [[1.0, 2.0, 3.0], [0.0, 1.0, 2.0], [4.0, 6.0, 8.0], [1.0, 1.5, 2.0]]
    c = welch_contrast(groups, [1, -1, -1, 1])  # (2 - 1) - (6 - 1.5) = -3.5
    assert c.estimate == pytest.approx(-3.5)
    var = 1 / 3 + 1 / 3 + 4 / 3 + 0.25 / 3
    assert c.se == pytest.approx(math.sqrt(var))
    assert c.p == pytest.approx(2 * sps.t.sf(3.5 / math.sqrt(var), c.df))
    assert min(len(g) for g in groups) - 1 <= c.df <= sum(len(g) - 1 for g in groups)


def test_zero_variance_and_bad_input():
    assert math.isnan(welch([0, 0, 0], [0, 0]).p)  # no difference and no spread: nothing to test
    assert welch([1, 1], [0, 0]).p == 0.0
    with pytest.raises(ValueError, match="n >= 2"):
        welch([1.0], [1.0, 2.0])


def test_holm_against_a_hand_computation():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04; times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04 -> running max
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([float("nan"), 0.01]) == pytest.approx(
        [1.0, 0.02]
    )  # a missing test counts as p = 1
    assert holm([]) == []
