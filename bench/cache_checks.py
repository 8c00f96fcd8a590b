"""What the latent cache's read checks cost: the layout check at open, the finite check per item, and
the full ``--verify`` pass (sit_vit5.latent_cache.LatentCacheDataset, verify_cache).

    python -m bench.cache_checks                                  # ImageNet-256 shapes, 2 shards
    python -m bench.cache_checks --images 2000 --shards 4 --json results/bench/cpu/cache_checks.json

A synthetic cache is written with the real layout (SD-VAE latents of ``--image-size`` images:
[n, 2, 4, S/8, S/8] float16 mean and std per shard, manifest, labels, done markers with digests),
then timed in this process (CPU time, ``time.process_time``: a shared machine's neighbours add
none of theirs):

* open: ``LatentCacheDataset(cache)`` (manifest, and the header / size check of every file), per file;
* item: ``dataset.moments(i, flip)`` over ``--items`` random items (finite check included), and the
  check alone (``np.isfinite(row).all()`` on the item's mean and std rows);
* verify: ``verify_cache`` (SHA-256 of each shard file, then every value for NaN / inf), per GB;
* per-channel normalisation: an item read through ``normalize_to`` (the stored scale converted to
  per-channel statistics, as ``vae.latent_stats: cache`` trains), against the plain read; and
  ``cache_stats`` (the statistics cache_latents records: one pass over the means), per GB of means.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from sit_vit5.latent_cache import CACHE_FORMAT, LatentCacheDataset, cache_stats, verify_cache
from sit_vit5.latent_norm import LatentNorm


def write_cache(root: Path, images: int, shards: int, image_size: int) -> Path:
    """A complete latent cache of random moments in the writer's layout; returns its folder."""
    latent = [4, image_size // 8, image_size // 8]
    rng = np.random.default_rng(0)
    per = -(-images // shards)
    entries = []
    for k, start in enumerate(range(0, images, per)):
        stop = min(start + per, images)
        name = f"shard_{k:05d}"
        entry = {"name": name, "mean": f"{name}.mean.npy", "std": f"{name}.std.npy", "start": start,
                 "stop": stop, "sha256": {}}
        for key in ("mean", "std"):
            array = rng.standard_normal((stop - start, 2, *latent), dtype=np.float32)
            np.save(root / entry[key], array.astype(np.float16))
            entry["sha256"][key] = hashlib.sha256((root / entry[key]).read_bytes()).hexdigest()
        (root / f"{name}.done").write_text(json.dumps({"start": start, "stop": stop, "bad": []}))
        entries.append(entry)
    np.save(root / "labels.npy", rng.integers(0, 1000, images).astype(np.int64))
    (root / "files.txt").write_text("".join(f"c/{i}.JPEG\n" for i in range(images)))
    manifest = {"format": CACHE_FORMAT, "complete": True, "num_images": images, "classes": ["c"],
                "image_size": image_size, "vae": "synthetic", "scaling_factor": 0.18215,
                "dtype": "float16", "shards": entries, "labels": "labels.npy", "files": "files.txt",
                "latent_shape": latent, "bad_indices": []}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def cpu_seconds(fn, repeat: int = 1) -> float:
    """Median CPU time of ``fn()`` over ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache_checks", description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=4000, help="images in the cache (default 4000)")
    p.add_argument("--shards", type=int, default=2, help="shards (default 2)")
    p.add_argument("--image-size", type=int, default=256, help="pixel side (latents S/8; default 256)")
    p.add_argument("--items", type=int, default=5000, help="items read per timing (default 5000)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cache-checks-") as tmp:
        cache = write_cache(Path(tmp), args.images, args.shards, args.image_size)
        files = 2 * args.shards + 1
        open_s = cpu_seconds(lambda: LatentCacheDataset(cache), repeat=5)
        dataset = LatentCacheDataset(cache)
        rng = np.random.default_rng(1)
        picks = [(int(i), int(f)) for i, f in zip(rng.integers(0, args.images, args.items),
                                                   rng.integers(0, 2, args.items))]
        for i, f in picks[:200]:  # map the shards and warm the page cache
            dataset.moments(i, f)

        def read_all() -> None:
            for i, f in picks:
                dataset.moments(i, f)

        checked = cpu_seconds(read_all, repeat=3)
        manifest = json.loads((cache / "manifest.json").read_text())
        stats = cache_stats(cache, manifest)
        mean_gb = sum(f.stat().st_size for f in cache.glob("shard_*.mean.npy")) / 1e9
        stats_s = cpu_seconds(lambda: cache_stats(cache, manifest))
        dataset.normalize_to(LatentNorm.from_stats(stats["mean"], stats["std"]))
        converted = cpu_seconds(read_all, repeat=3)
        dataset.normalize_to(dataset.norm)
        rows = [np.asarray(dataset.moments(i, f)[0]) for i, f in picks[:2]]

        def finite_checks() -> None:  # the check alone: two rows (mean, std) per item
            for _ in range(args.items):
                for row in rows:
                    np.isfinite(row).all()

        check = cpu_seconds(finite_checks, repeat=3)
        size = sum(f.stat().st_size for f in cache.glob("shard_*.npy"))
        verify_s = cpu_seconds(lambda: verify_cache(cache))
    result = {
        "images": args.images, "shards": args.shards,
        "latent_shape": [4, args.image_size // 8, args.image_size // 8],
        "open_us_per_file": 1e6 * open_s / files,
        "item_us": 1e6 * checked / args.items,
        "finite_check_us_per_item": 1e6 * check / args.items,
        "verify_s_per_gb": verify_s / (size / 1e9), "cache_gb": size / 1e9,
        "item_per_channel_us": 1e6 * converted / args.items,
        "per_channel_vs_plain_item": converted / checked,
        "stats_s_per_gb_of_means": stats_s / mean_gb,
    }
    for key, value in result.items():
        print(f"{key:<26} {value:.3f}" if isinstance(value, float) else f"{key:<26} {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
