"""The few-step study's harness against ``sample.py bulk`` + ``python -m fid`` on the demo (issue 55).

    OMP_NUM_THREADS=1 python results/nfe/harness_vs_bulk.py [--seeds 0 1 2 3 4] [--setting unipc8]

Runs ``sample.py bulk`` (1,000 samples of runs/demo's EMA) with ``--label-sampling random`` (its
default) and ``equal`` at each global seed, scores each npz with ``python -m fid ... digits`` and
stores the digits FID per (setting, labels, seed) in ``results/nfe/harness-vs-bulk.json`` with the
start time (UTC) and commit; a rerun skips what is there. The study's own rows (labels i mod 10 or
random, float pixels) are in ``sample-seeds/runs-demo-0002000.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sit_vit5.experiments.nfe import git_commit, utc_now
from sit_vit5.utils.atomic_files import atomic_write_text

CKPT = "runs/demo/checkpoints/0002000.pt"
OUT = Path(__file__).with_name("harness-vs-bulk.json")
#: setting -> sample.py flags (the study's ``unipc 8`` and ``sde-euler-mean 250`` rows)
SETTINGS = {"unipc8": ["--method", "ode", "--sampling-method", "unipc", "--nfe", "8"],
            "sde250": ["--method", "sde", "--sampling-method", "Euler", "--num-steps", "250",
                       "--last-step", "Mean"]}


def bulk_fid(flags: list[str], labels: str, seed: int, work: Path) -> dict[str, float]:
    """digits FID and class accuracy of one ``sample.py bulk`` run (1,000 samples)."""
    out = work / f"{labels}-{seed}"
    subprocess.run([sys.executable, "sample.py", "bulk", "--ckpt", CKPT, *flags, "--seed",
                    str(seed), "--num-samples", "1000", "--batch-size", "250", "--label-sampling",
                    labels, "--no-progress", "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    npz = next(out.glob("samples_*.npz"))
    subprocess.run([sys.executable, "-m", "fid", str(npz), "digits", "--out",
                    str(out / "metrics.json")], check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads((out / "metrics.json").read_text())
    found = {k: v for k, v in _flat(metrics).items() if k.endswith(("digits_fid", "fid"))}
    accuracy = {k: v for k, v in _flat(metrics).items() if k.endswith("accuracy")}
    return {"fid": float(next(iter(found.values()))),
            "accuracy": float(next(iter(accuracy.values())))}


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    """Leaves of a JSON tree keyed by their dotted path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--setting", choices=list(SETTINGS), default="unipc8")
    p.add_argument("--labels", nargs="+", choices=["random", "equal"], default=["random", "equal"])
    args = p.parse_args(argv)
    rows = json.loads(OUT.read_text()) if OUT.is_file() else {}
    commit = git_commit()
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for labels in args.labels:
                key = f"{args.setting} bulk {labels}-labels seed{seed}"
                if key in rows:
                    continue
                started = utc_now()
                rows[key] = {**bulk_fid(SETTINGS[args.setting], labels, seed, Path(work)),
                             "setting": args.setting, "labels": labels, "seed": seed,
                             "started_utc": started, "commit": commit}
                atomic_write_text(OUT, json.dumps(rows, indent=1, sort_keys=True))
                print(key, rows[key]["fid"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
