"""The cluster user's path through the shipped XL configs at reduced size (depth 1, 32-px images
through the SD-VAE ft-EMA architecture; width 8 for the plain XL configs): latent cache from a
folder of mixed image modes, train, checkpoint, resume, sample.py grid, export, and the diffusers
pipeline giving sample.py's pixels (``bench.cluster_paths``; the full-size run is in
docs/PERFORMANCE.md)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from bench import cluster_paths

STAGES = ["train 2 steps", "resume +1 step", "sample.py grid", "export", "pipeline"]


def test_image_folder_has_the_modes_a_real_one_has(tmp_path):
    root = cluster_paths.make_image_folder(tmp_path)
    modes = {Image.open(root / name).mode for name, *_ in cluster_paths.IMAGES}
    assert modes == {"RGB", "L", "CMYK", "RGBA"}
    assert min(min(Image.open(root / name).size) for name, *_ in cluster_paths.IMAGES) < 256  # one upscaled


@pytest.mark.slow
def test_every_xl_config_runs_the_cluster_path_at_reduced_size(tmp_path):
    out = tmp_path / "rows.json"
    # --vae tiny: SD-VAE ft-EMA's blocks, levels (factor 8) and 4 latent channels at width 8: the
    # same AutoencoderKL code path through cache, sample.py, export and pipeline, minus 330 MB per copy
    rows = cluster_paths.main(["--configs", *cluster_paths.CONFIGS, "--depth", "1", "--image-size", "32",
                               "--vae", "tiny",
                               "--work", str(tmp_path / "work"), "--json", str(out)])
    assert [(r["config"], r["stage"]) for r in rows] == [("(all)", "cache_latents")] + [
        (c, s) for c in cluster_paths.CONFIGS for s in STAGES]
    saved = json.loads(out.read_text())
    for stage in saved["stages"]:
        # >=, not >: on Linux a child's ru_maxrss starts at its parent's RSS at fork (kept across exec), so
        # under a long pytest run a small stage and the baseline can both read the parent's peak
        assert stage["peak_rss"] >= saved["baseline_rss"] > 0, stage["stage"]
        if stage["stage"] == "sample.py grid":
            assert stage["extra"]["image_sizes"] == [[32, 32]]  # decoded by the VAE: 4 latents x 8
        if stage["stage"].startswith(("train", "resume")):
            assert stage["s_per_step"] > 0 and stage["plan_bytes"] > 0
    for config in cluster_paths.CONFIGS:  # the resumed run continued to step 3 in the config's precision
        lines = (tmp_path / "work" / config / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


@pytest.mark.slow
def test_the_repa_xl_configs_run_the_cluster_path_at_reduced_size(tmp_path):
    """From the ImageFolder (the encoder sees the images), with DINOv2-B/14's architecture as a
    local timm folder; checkpoint, resume, sample.py, export and pipeline as for the other XL
    configs (~2.5 min)."""
    rows = cluster_paths.main(["--configs", *cluster_paths.REPA_CONFIGS, "--depth", "1",
                               "--image-size", "32", "--work", str(tmp_path / "work")])
    assert [(r["config"], r["stage"]) for r in rows] == [("(all)", "cache_latents")] + [
        (c, s) for c in cluster_paths.REPA_CONFIGS for s in STAGES]
    for config in cluster_paths.REPA_CONFIGS:
        lines = (tmp_path / "work" / config / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
        assert all("loss_repa" in json.loads(line) for line in lines)
