"""Metrics on feature arrays, defined as the ADM evaluator (openai/guided-diffusion, evaluations/evaluator.py)
defines them: Fréchet distance (FID / sFID), Inception Score, and k-NN precision/recall.

Everything here works on plain arrays; no network is involved. Statistics are float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg
import torch


def feature_statistics(features: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of a feature set.

    features: [N, D] (any float dtype), N >= 2.
    Returns (mu [D], sigma [D, D]), both float64; sigma is the unbiased (N - 1) covariance, like np.cov.
    """
    x = _as_numpy(features).astype(np.float64, copy=False)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"feature_statistics needs features of shape [N >= 2, D], got {tuple(x.shape)}")
    return x.mean(axis=0), np.cov(x, rowvar=False)


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, eps: float = 1e-6
) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2):
    ‖mu1 − mu2‖² + tr(sigma1) + tr(sigma2) − 2·tr((sigma1·sigma2)^½).

    mu*: [D]; sigma*: [D, D]; computed in float64. As in the ADM evaluator: if sqrtm of the product is not
    finite, retry with eps·I added to both covariances; an imaginary part is dropped when the diagonal's
    imaginary part is within 1e-3 of 0, and is an error otherwise.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = (
        np.atleast_2d(np.asarray(sigma1, np.float64)),
        np.atleast_2d(np.asarray(sigma2, np.float64)),
    )
    if mu1.shape != mu2.shape or mu1.ndim != 1:
        raise ValueError(f"mean vectors must be 1-D of equal length, got {mu1.shape} and {mu2.shape}")
    if sigma1.shape != sigma2.shape or sigma1.shape != (mu1.shape[0], mu1.shape[0]):
        raise ValueError(
            f"covariances must both be [{mu1.shape[0]}, {mu1.shape[0]}], got {sigma1.shape} and {sigma2.shape}"
        )
    diff = mu1 - mu2
    # sqrtm is called without `disp`: SciPy >= 1.18 removed that argument, and without it every version
    # returns just the matrix.
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        warnings.warn(f"Fréchet distance: singular covariance product; adding {eps} to the diagonals", stacklevel=2)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(
                f"Fréchet distance: sqrtm has a large imaginary component "
                f"({np.abs(covmean.imag).max():.3g}); "
                "the covariances are probably estimated from too few samples"
            )
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))


def inception_score(logits: np.ndarray | torch.Tensor, splits: int = 10) -> tuple[float, float]:
    """Inception Score from classifier logits.

    logits: [N, K] (the Inception net's 1008 bias-free logits for the ADM protocol), N >= splits.
    The rows are cut into `splits` contiguous, unshuffled chunks
    (chunk i = rows [i·N//splits, (i+1)·N//splits));
    per chunk IS = exp(mean_i KL(p_i ‖ mean_j p_j)) with p = softmax(logits) in float64.
    Returns (mean, std) over the chunks. ADM reports only the mean, with chunks of 5,000 rows: the same
    chunks as splits=10 at N = 50,000.
    """
    x = torch.as_tensor(_as_numpy(logits), dtype=torch.float64)
    if x.ndim != 2:
        raise ValueError(f"inception_score needs logits of shape [N, K], got {tuple(x.shape)}")
    n = x.shape[0]
    if splits < 1 or n < splits:
        raise ValueError(f"inception_score needs 1 <= splits <= N, got splits={splits}, N={n}")
    log_p = torch.log_softmax(x, dim=1)
    scores = []
    for i in range(splits):
        chunk = log_p[i * n // splits : (i + 1) * n // splits]
        log_marginal = torch.logsumexp(chunk, dim=0) - np.log(chunk.shape[0])
        kl = (chunk.exp() * (chunk - log_marginal)).sum(dim=1).mean()
        scores.append(kl.exp().item())
    return float(np.mean(scores)), float(np.std(scores))


def pairwise_sq_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances [Na, Nb] between rows of a [Na, D] and b [Nb, D], clamped at 0."""
    d = a.pow(2).sum(1, keepdim=True) - 2.0 * (a @ b.T) + b.pow(2).sum(1).unsqueeze(0)
    return d.clamp_(min=0.0)


def manifold_radii(features: torch.Tensor, k: int = 3, batch_size: int = 10000) -> torch.Tensor:
    """Per-point radius [N] = squared distance to the k-th nearest neighbour, counting the point itself as
    the 0-th (ADM: np.partition of the full distance row, element k).

    features: [N, D] with N > k; computed on features.device in row blocks of batch_size.
    """
    n = features.shape[0]
    if n <= k:
        raise ValueError(f"precision/recall with k={k} needs more than {k} points per set, got {n}")
    radii = [
        pairwise_sq_distances(features[i : i + batch_size], features).kthvalue(k + 1, dim=1).values
        for i in range(0, n, batch_size)
    ]
    return torch.cat(radii)


def _fraction_inside(points: torch.Tensor, centers: torch.Tensor, radii: torch.Tensor, batch_size: int) -> float:
    """Fraction of points lying within (<=) the radius of at least one center (squared distances)."""
    inside = []
    for i in range(0, points.shape[0], batch_size):
        hit = torch.zeros(points[i : i + batch_size].shape[0], dtype=torch.bool, device=points.device)
        for j in range(0, centers.shape[0], batch_size):
            d = pairwise_sq_distances(points[i : i + batch_size], centers[j : j + batch_size])
            hit |= (d <= radii[j : j + batch_size].unsqueeze(0)).any(dim=1)
        inside.append(hit)
    return torch.cat(inside).double().mean().item()


def precision_recall(
    ref_features: np.ndarray | torch.Tensor,
    sample_features: np.ndarray | torch.Tensor,
    k: int = 3,
    batch_size: int = 10000,
    device: str | torch.device = "cpu",
) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) as in the ADM evaluator.

    ref_features: [Nr, D] (ADM: pool features of the reference batch's 10,000 images);
    sample_features: [Ns, D]. Each point gets a ball of radius = its k-th neighbour distance within its own
    set. precision = fraction of samples inside some reference ball; recall = fraction of reference points
    inside some sample ball. Distances are squared, float32 (ADM computes them in float16 when finite,
    which can flip points that lie on a ball's boundary).
    Returns (precision, recall) in [0, 1].
    """
    ref = torch.as_tensor(ref_features).to(device=device, dtype=torch.float32)
    sam = torch.as_tensor(sample_features).to(device=device, dtype=torch.float32)
    if ref.ndim != 2 or sam.ndim != 2 or ref.shape[1] != sam.shape[1]:
        raise ValueError(
            f"precision_recall needs [N, D] feature sets of equal D, got {tuple(ref.shape)}, {tuple(sam.shape)}"
        )
    ref_radii = manifold_radii(ref, k, batch_size)
    sam_radii = manifold_radii(sam, k, batch_size)
    precision = _fraction_inside(sam, ref, ref_radii, batch_size)
    recall = _fraction_inside(ref, sam, sam_radii, batch_size)
    return precision, recall


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
