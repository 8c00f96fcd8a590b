"""FID / IS / precision-recall against closed forms and independent computations."""

import numpy as np
import pytest
import torch

import fid
from fid import metrics
from tests.helpers import naming


def _random_spd(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


# ---------------------------------------------------------------------------------------------- Fréchet


def test_frechet_diagonal_closed_form():
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.1, 3.0, 20), rng.uniform(0.1, 3.0, 20)
    mu1, mu2 = rng.normal(size=20), rng.normal(size=20)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    got = fid.frechet_distance(mu1, np.diag(a), mu2, np.diag(b))
    assert got == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("c", [0.5, 1.0, 2.5])
def test_frechet_scaled_covariance_closed_form(c):
    rng = np.random.default_rng(1)
    sigma = _random_spd(rng, 32)
    mu1, mu2 = rng.normal(size=32), rng.normal(size=32)
    expected = np.sum((mu1 - mu2) ** 2) + (1 - c) ** 2 * np.trace(sigma)
    assert fid.frechet_distance(mu1, sigma, mu2, c**2 * sigma) == pytest.approx(expected, rel=1e-8, abs=1e-9)


def test_frechet_identical_sets_is_zero_and_matches_eigenvalue_form():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(500, 64)), rng.normal(size=(400, 64)) * 1.3 + 0.2
    mu1, s1 = fid.feature_statistics(x)
    mu2, s2 = fid.feature_statistics(y)
    assert abs(fid.frechet_distance(mu1, s1, mu1, s1)) < 1e-8
    # independent route: tr((S1 S2)^½) = Σ sqrt(eig(S1 S2)) (the eigenvalues are real and >= 0)
    tr_covmean = np.sum(np.sqrt(np.linalg.eigvals(s1 @ s2).astype(complex)).real)
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * tr_covmean
    assert fid.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-9)


def test_frechet_retries_with_eps_when_sqrtm_is_not_finite(monkeypatch):
    real_sqrtm = metrics.scipy.linalg.sqrtm
    calls = []

    def flaky_sqrtm(a):  # no `disp` parameter: passing one would fail, as on SciPy >= 1.18
        calls.append(a)
        return np.full_like(a, np.nan) if len(calls) == 1 else real_sqrtm(a)

    monkeypatch.setattr(metrics.scipy.linalg, "sqrtm", flaky_sqrtm)
    a, b, eps = np.array([1.0, 2.0, 0.5]), np.array([0.3, 2.0, 4.0]), 1e-3
    with pytest.warns(UserWarning, match="singular"):
        got = fid.frechet_distance(np.zeros(3), np.diag(a), np.ones(3), np.diag(b), eps=eps)
    expected = 3.0 + a.sum() + b.sum() - 2 * np.sum(np.sqrt((a + eps) * (b + eps)))
    assert len(calls) == 2 and got == pytest.approx(expected, rel=1e-10)


def test_frechet_small_imaginary_part_dropped_large_one_rejected(monkeypatch):
    eye = np.eye(3)
    monkeypatch.setattr(metrics.scipy.linalg, "sqrtm", lambda a: eye + 1e-6j * eye)
    assert fid.frechet_distance(np.zeros(3), eye, np.zeros(3), eye) == pytest.approx(0.0, abs=1e-12)
    monkeypatch.setattr(metrics.scipy.linalg, "sqrtm", lambda a: eye + 0.5j * eye)
    with pytest.raises(ValueError, match="imaginary"):
        fid.frechet_distance(np.zeros(3), eye, np.zeros(3), eye)


def test_frechet_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=naming("(3,)", "(4,)")):
        fid.frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(ValueError, match="covariances"):
        fid.frechet_distance(np.zeros(3), np.eye(3), np.zeros(3), np.eye(4))


def test_feature_statistics_float64_and_unbiased():
    x = torch.randn(50, 7, generator=torch.Generator().manual_seed(0))
    mu, sigma = fid.feature_statistics(x)
    xd = x.double().numpy()
    assert mu.dtype == np.float64 and sigma.dtype == np.float64
    np.testing.assert_allclose(mu, xd.mean(0), rtol=1e-12)
    centered = xd - xd.mean(0)
    np.testing.assert_allclose(sigma, centered.T @ centered / 49, rtol=1e-10)
    with pytest.raises(ValueError, match="N >= 2"):
        fid.feature_statistics(x[:1])


# ---------------------------------------------------------------------------------------------- IS


def test_inception_score_known_value():
    # p_i = (1 - a)·onehot(c_i) + a/K with classes balanced inside every split → marginal is uniform and
    # KL(p_i ‖ u) = big·log(big·K) + (K − 1)·small·log(small·K) for every row.
    k, a, n = 5, 0.2, 40
    probs = np.full((n, k), a / k)
    probs[np.arange(n), np.arange(n) % k] += 1 - a
    big, small = 1 - a + a / k, a / k
    expected = np.exp(big * np.log(big * k) + (k - 1) * small * np.log(small * k))
    mean, std = fid.inception_score(np.log(probs), splits=4)
    assert mean == pytest.approx(expected, rel=1e-12) and std == pytest.approx(0.0, abs=1e-12)
    # softmax is shift invariant per row
    assert fid.inception_score(np.log(probs) + 3.0, splits=4)[0] == pytest.approx(expected, rel=1e-12)


def test_inception_score_constant_predictions_is_one():
    logits = np.tile(np.random.default_rng(0).normal(size=(1, 10)), (30, 1))
    assert fid.inception_score(logits, splits=3)[0] == pytest.approx(1.0, abs=1e-12)


def test_inception_score_splits_are_contiguous_and_unshuffled():
    logits = np.zeros((20, 2))
    logits[:10, 0] = logits[10:, 1] = 50.0  # first half class 0, second half class 1
    assert fid.inception_score(logits, splits=2)[0] == pytest.approx(1.0, abs=1e-9)  # each split pure
    assert fid.inception_score(logits, splits=1)[0] == pytest.approx(2.0, rel=1e-9)


def test_inception_score_matches_adm_loop_at_divisible_sizes():
    logits = np.random.default_rng(3).normal(size=(60, 12)) * 3
    # ADM: chunks of split_size rows, float softmax, KL with np.log, exp of mean KL, mean over chunks
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    scores = []
    for i in range(0, 60, 10):
        part = p[i : i + 10]
        kl = part * (np.log(part) - np.log(part.mean(0, keepdims=True)))
        scores.append(np.exp(kl.sum(1).mean()))
    mean, std = fid.inception_score(torch.from_numpy(logits), splits=6)
    assert mean == pytest.approx(np.mean(scores), rel=1e-10)
    assert std == pytest.approx(np.std(scores), rel=1e-8)


def test_inception_score_rejects_too_few_rows():
    with pytest.raises(ValueError, match="splits"):
        fid.inception_score(np.zeros((5, 3)), splits=10)


# ---------------------------------------------------------------------------------------------- precision/recall


def _brute_force_pr(ref: np.ndarray, sam: np.ndarray, k: int) -> tuple[float, float]:
    def sq(a, b):
        return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)

    r_ref = np.sort(sq(ref, ref), axis=1)[:, k]
    r_sam = np.sort(sq(sam, sam), axis=1)[:, k]
    precision = (sq(sam, ref) <= r_ref[None, :]).any(1).mean()
    recall = (sq(ref, sam) <= r_sam[None, :]).any(1).mean()
    return precision, recall


@pytest.mark.parametrize("batch_size", [7, 10000])
def test_precision_recall_matches_brute_force(batch_size):
    rng = np.random.default_rng(4)
    ref = rng.normal(size=(45, 6))
    sam = rng.normal(size=(31, 6)) * 1.5 + 0.7
    expected = _brute_force_pr(ref, sam, 3)
    assert 0 < expected[0] < 1 and 0 < expected[1] < 1  # a case that distinguishes the two
    got = fid.precision_recall(ref, sam, k=3, batch_size=batch_size)
    assert got == pytest.approx(expected, abs=1e-12)


def test_precision_recall_hand_computed_1d():
    ref = np.arange(10.0)[:, None]  # radius² (k=3): point 9 → 9, point 4 → 4
    sam = np.array([[4.5], [100.0], [101.0], [102.0]])  # 4.5's radius² = 97.5², covering every ref point
    assert fid.precision_recall(ref, sam, k=3) == pytest.approx((0.25, 1.0))


def test_precision_recall_identical_and_disjoint_sets():
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    assert fid.precision_recall(x, x.clone()) == (1.0, 1.0)
    assert fid.precision_recall(x, x + 1000.0) == (0.0, 0.0)


def test_precision_recall_needs_more_than_k_points():
    with pytest.raises(ValueError, match=naming("k=3", "3")):
        fid.precision_recall(np.zeros((3, 2)), np.ones((10, 2)))
