"""Verified Inception loading, sFID feature layout, and the whole pipeline on a randomly initialised copy of
torch-fidelity's network saved to a temporary file (its hash passed as the test-only override)."""

import math
import os
import pickle
from unittest import mock

import numpy as np
import pytest
import torch
import torch_fidelity.feature_extractor_inceptionv3 as tfi
from torch_fidelity.metric_isc import isc_features_to_metric
from torch_fidelity.metric_prc import calculate_precision_recall_full

import fid
import fid.__main__ as cli
from fid import inception
from fid.inception import InceptionWeightsError, load_inception, sha256_of, spatial_features
from tests.helpers import naming


def test_spatial_features_flatten_in_hwc_order():
    n, c, h, w = 2, 9, 3, 4
    x = torch.arange(n * c * h * w, dtype=torch.float32).reshape(n, c, h, w)
    out = spatial_features(x)
    assert out.shape == (n, h * w * 7)
    for b in range(n):
        for i in range(h):
            for j in range(w):
                for k in range(7):
                    assert out[b, (i * w + j) * 7 + k] == x[b, k, i, j]
    assert inception.SPATIAL_DIM == 2023 == spatial_features(torch.zeros(1, 192, 17, 17)).shape[1]


def test_missing_weights_error_says_what_to_download(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    with pytest.raises(InceptionWeightsError) as err:
        load_inception()
    message = str(err.value)
    for needle in (fid.INCEPTION_FILENAME, fid.INCEPTION_SHA256, fid.INCEPTION_URL, str(tmp_path / "hub")):
        assert needle in message


class _Armed:
    """A pickle that creates a marker directory when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_hash_mismatch_is_refused_before_unpickling(tmp_path):
    marker = str(tmp_path / "unpickled")
    weights = tmp_path / "weights.pth"
    weights.write_bytes(pickle.dumps(_Armed(marker)))
    with pytest.raises(InceptionWeightsError, match=naming("weights.pth", "SHA-256")):
        load_inception(weights)  # the official hash: mismatch
    assert not os.path.exists(marker)
    pickle.loads(weights.read_bytes())  # the file really was armed
    assert os.path.exists(marker)


def _random_inception_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """torch-fidelity's network with random weights (He-normal convs so activations neither vanish nor
    explode through ~50 layers; random BN statistics; fc weights/bias random)."""
    with (
        mock.patch.object(tfi, "load_state_dict_from_url", lambda *a, **k: None),
        mock.patch.object(tfi.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None),
    ):
        net = tfi.FeatureExtractorInceptionV3("random", ["2048"])  # architecture only, nothing loaded
    g = torch.Generator().manual_seed(seed)
    for module in net.modules():
        if isinstance(module, torch.nn.Conv2d):
            module.weight.data = torch.randn(module.weight.shape, generator=g) * math.sqrt(2 / module.weight[0].numel())
        elif isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.data = 0.1 * torch.randn(module.running_mean.shape, generator=g)
            module.running_var.data = 1 + 0.1 * torch.rand(module.running_var.shape, generator=g)
    net.fc.weight.data = torch.randn(net.fc.weight.shape, generator=g) * 30 / math.sqrt(2048)
    net.fc.bias.data = torch.randn(net.fc.bias.shape, generator=g)
    return net.state_dict()


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("inception") / "random-inception.pth"
    torch.save(_random_inception_state_dict(), path)
    return str(path), sha256_of(path)


def _patterns(levels, size: int = 32) -> np.ndarray:
    """uint8 [N, size, size, 3]: a gray level plus a coloured stripe pattern per image."""
    yy, xx = np.mgrid[0:size, 0:size]
    out = [
        np.clip(v + 40 * np.sin((xx + 2 * yy) / (2 + i % 3))[..., None] * np.array([1, 0.5, -1]), 0, 255)
        for i, v in enumerate(levels)
    ]
    return np.stack(out).astype(np.uint8)


@pytest.mark.slow
def test_features_match_torch_fidelity_network(random_weights):
    path, sha = random_weights
    extractor = load_inception(path, sha256=sha)
    direct = tfi.FeatureExtractorInceptionV3("direct", ["2048", "logits_unbiased"], feature_extractor_weights_path=path)
    mixed_6d_input = {}
    direct.Mixed_6d.register_forward_pre_hook(lambda m, args: mixed_6d_input.setdefault("x", args[0].clone()))
    images = torch.from_numpy(_patterns([50, 200])).permute(0, 3, 1, 2).contiguous()
    feats = extractor(images)
    with torch.no_grad():
        pool, logits = direct(images)
        branch1x1 = direct.Mixed_6d.branch1x1(mixed_6d_input["x"])
    assert feats["pool"].shape == (2, 2048) and feats["logits"].shape == (2, 1008)
    assert feats["spatial"].shape == (2, 2023)
    torch.testing.assert_close(feats["pool"], pool)
    torch.testing.assert_close(feats["logits"], logits)
    torch.testing.assert_close(feats["logits"], pool @ direct.fc.weight.T)  # bias-free
    torch.testing.assert_close(feats["spatial"], branch1x1[:, :7].permute(0, 2, 3, 1).reshape(2, -1))
    assert (feats["pool"][0] - feats["pool"][1]).abs().max() > 1e-4  # the random network is not degenerate


class _Recorder(torch.nn.Module):
    """Passes through to the extractor and keeps every output, so the test can recompute metrics itself."""

    def __init__(self, extractor):
        super().__init__()
        self.extractor, self.outputs = extractor, []

    def forward(self, images):
        out = self.extractor(images)
        self.outputs.append({k: v.clone() for k, v in out.items()})
        return out

    def features(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        return {k: torch.cat([o[k] for o in self.outputs])[start:stop] for k in ("pool", "spatial", "logits")}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Matrix is singular")  # 4 samples: rank-3 covariances
def test_pipeline_end_to_end(random_weights, tmp_path):
    """images → verified network (loaded through the CLI's make-reference and through the API) → features →
    reference npz → FID / sFID / IS / PR, checked against torch-fidelity's own metric implementations."""
    path, sha = random_weights
    samples, refs = _patterns([0, 50, 100, 150]), _patterns([60, 120, 180, 240])  # 4 = the fewest PR allows
    np.savez(tmp_path / "samples.npz", arr_0=samples)
    np.savez(tmp_path / "refs.npz", arr_0=refs)
    rc = cli.main(
        [
            "make-reference",
            str(tmp_path / "refs.npz"),
            str(tmp_path / "ref.npz"),
            "--inception-weights",
            path,
            "--weights-sha256",
            sha,
            "--device",
            "cpu",
        ]
    )
    assert rc == 0

    recorder = _Recorder(load_inception(path, sha256=sha))
    reference = fid.read_reference(tmp_path / "ref.npz")
    # sFID is the same Fréchet code on mu_s/sigma_s (its wiring is checked in test_fid_cli.py); leaving it out
    # here saves a 2023×2023 sqrtm, ~10-50 s on 2 cores
    metrics = ["fid", "is", "pr"]
    got = fid.evaluate(fid.open_images(tmp_path / "samples.npz"), reference, recorder, metrics, splits=2, batch_size=3)
    s, r = recorder.features(0, 4), recorder.features(4, 8)  # samples first, then the reference images

    # the reference file holds the statistics of these reference features, and the reference images
    ref_stats = fid.FeatureStats.from_features({k: v.numpy() for k, v in r.items()})
    np.testing.assert_allclose(reference.stats.mu, ref_stats.mu, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(reference.stats.sigma_s, ref_stats.sigma_s, rtol=1e-4, atol=1e-9)
    np.testing.assert_array_equal(reference.images.read(0, 4), refs)

    # independent Fréchet route for few samples: with centred features X1 [n1, D], X2 [n2, D],
    # tr((Σ1 Σ2)^½) = ‖X1 X2ᵀ‖_* / sqrt((n1 − 1)(n2 − 1)) (nuclear norm of an n1×n2 matrix, no D×D sqrtm)
    x1, x2 = s["pool"].double().numpy(), r["pool"].double().numpy()
    c1, c2 = x1 - x1.mean(0), x2 - x2.mean(0)
    tr_covmean = np.linalg.svd(c1 @ c2.T, compute_uv=False).sum() / math.sqrt(3 * 3)
    diff = x1.mean(0) - x2.mean(0)
    expected = diff @ diff + (c1**2).sum() / 3 + (c2**2).sum() / 3 - 2 * tr_covmean
    assert got["fid"] > 0 and got["fid"] == pytest.approx(expected, rel=1e-4)
    isc = isc_features_to_metric(s["logits"], splits=2, shuffle=False)
    assert got["inception_score"] == pytest.approx(isc["inception_score_mean"], rel=1e-6)
    assert got["inception_score_std"] == pytest.approx(isc["inception_score_std"], rel=1e-5, abs=1e-9)
    assert got["inception_score"] > 1.0 + 1e-6
    precision, recall = calculate_precision_recall_full(s["pool"], r["pool"], neighborhood=3)
    assert (got["precision"], got["recall"]) == pytest.approx((precision, recall))
    assert got["num_samples"] == 4 and got["num_reference_images"] == 4
