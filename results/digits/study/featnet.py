"""Do the cached digits-FIDs mean the same on every machine? The check behind the shipped feature networks.

Until 2026-12-03 every machine trained the digits feature networks (``fid.digits``) itself, from a seeded
one-thread recipe. That is deterministic on one machine but not across machines (CPU kernels round
differently and 30 epochs amplify it), and the cached runs were scored on several machines. This check
(``python results/digits/study --featnet-check``, ~15 min on one core):

1. retrains one committed run (default: digits16 ViT-5 (γ0=1) seed 3, the first non-REPA run scored with
   FID16, on an earlier machine) and compares its held-out loss, FID (8×8 network) and FID16 at every
   checkpoint with the committed JSON;
2. scores that run's samples at every checkpoint by the shipped networks and by networks trained with two
   threads (another reduction order: a stand-in for another machine), so the FID difference between two
   equally valid networks is measured over the whole FID range, real-vs-real floor included.

Writes ``featnet_check-<dataset>-<run>.json`` and ``.md`` beside the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fid.digits import digits_metrics, digits_split, load_digits_net, train_digits_net
from sit_vit5.experiments.report import markdown_table
from sit_vit5.models import load_model
from sit_vit5.sampling import SampleSpec, SamplingPipeline
from sit_vit5.training.checkpoint import checkpoint_name

from .digits import RESULTS, RunSpec, generate_digits, run_one

CHECKED = ("digits16", "ViT-5 (γ0=1)", 3)


def featnet_check(out: str | Path = RESULTS, runs_dir: str = "runs/digits-proxy", run: tuple[str, str, int] = CHECKED,
                  **common: Any) -> dict[str, Any]:
    """Run the check on ``run`` (dataset, variant, seed) cached under ``out`` (``common``: RunSpec's settings, for
    tests; default the protocol's); returns (and writes to ``out``/featnet_check-<run>.json and .md) one row per
    checkpoint and one for real images."""
    out = Path(out)
    scratch = f"{runs_dir}/featnet-check"
    spec = RunSpec(*run, runs_dir=scratch, results_dir=scratch, **common)
    retrained = run_one(spec, threads=1)
    committed = json.loads((out / "runs" / spec.dataset / spec.result_path.name).read_text())
    nets = {(r, source): (load_digits_net(resolution=r) if source == "shipped" else train_digits_net(r, threads=2))
            for r in (8, 16) for source in ("shipped", "two-thread")}
    rows = []
    for step in spec.checkpoint_steps:
        loaded = load_model(spec.run_dir / "checkpoints" / checkpoint_name(step, False))
        pipeline = SamplingPipeline.for_model(loaded, SampleSpec(method="ode", sampling_method="euler",
                                                                 num_steps=spec.sample_steps))
        images, labels = generate_digits(pipeline, spec.num_samples)
        rows.append(_row(str(step), committed["checkpoints"][str(step)], retrained["checkpoints"][str(step)],
                         {key: digits_metrics(images, labels, net)["digits_fid"] for key, net in nets.items()}))
    real, real_labels = digits_split("all", 16 if spec.dataset == "digits16" else 8)
    subset = torch.randperm(len(real_labels), generator=torch.Generator().manual_seed(0))[:spec.num_samples]
    floor = {key: digits_metrics(real[subset], None, net)["digits_fid"] for key, net in nets.items()}
    rows.append(_row(f"real {spec.dataset}", {}, {}, floor))
    data = {"run": list(run), "num_samples": spec.num_samples, "rows": rows, "torch": torch.__version__}
    stem = f"featnet_check-{spec.dataset}-{spec.result_path.stem}"  # slugs may hold dots (lr=0.003)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(featnet_markdown(data))
    return data


def _row(what: str, committed: dict[str, float], here: dict[str, float],
         fids: dict[tuple[int, str], float]) -> dict[str, Any]:
    row: dict[str, Any] = {"samples": what}
    for key in ("heldout_loss", "digits_fid", "digits_fid16"):
        row[f"committed {key}"], row[f"retrained {key}"] = committed.get(key), here.get(key)
    for (resolution, source), value in fids.items():
        row[f"FID{resolution} {source}"] = value
    return row


def featnet_markdown(data: dict[str, Any]) -> str:
    """The check as a table: per checkpoint, committed vs retrained-here numbers, and the FIDs of the same
    samples by the shipped and the two-thread networks with their relative difference."""
    def num(x: float | None, digits: int = 4) -> str:
        return "–" if x is None else f"{x:.{digits}g}"

    def rel(a: float, b: float) -> str:
        return f"{100 * (a - b) / b:+.2f} %"

    table = [{
        "samples": r["samples"],
        "held-out loss: committed / here": f"{num(r['committed heldout_loss'])} / {num(r['retrained heldout_loss'])}",
        "FID (8×8 net): committed / here": f"{num(r['committed digits_fid'])} / {num(r['retrained digits_fid'])}",
        "FID16: committed / here": f"{num(r['committed digits_fid16'])} / {num(r['retrained digits_fid16'])}",
        "FID8 shipped / two-thread net": f"{num(r['FID8 shipped'])} / {num(r['FID8 two-thread'])} "
                                         f"({rel(r['FID8 two-thread'], r['FID8 shipped'])})",
        "FID16 shipped / two-thread net": f"{num(r['FID16 shipped'])} / {num(r['FID16 two-thread'])} "
                                          f"({rel(r['FID16 two-thread'], r['FID16 shipped'])})",
    } for r in data["rows"]]
    run = "{} {} seed {}".format(*data["run"])
    n = data["num_samples"]
    return (f"Run checked: {run}, retrained here (torch {data['torch']}); {n} samples per checkpoint, the real "
            f"row {n} real {data['run'][0]} images.\n\n" + markdown_table(table, list(table[0])))
