"""Evaluate training runs under an evaluation protocol and compare them.

For each run directory (a ``train.py`` output) and each checkpoint step the protocol asks for:
bulk-sample ``eval.num_samples`` images (sharded over the processes of ``torchrun`` / ``accelerate
launch``, resumable), score them with the ADM-compatible FID suite (``fid``), and cache the numbers
in ``<run>/eval/<protocol>/<step>.json`` with how they were made (the ``fid`` CLI's provenance
record: sampler, NFE, label sampling, checkpoint and reference digests). Then write
``comparison.md`` / ``comparison.csv`` (model, params, GFLOPs, step, FID, sFID, IS, precision,
recall) and ``fid_vs_step.png`` with the paper's points as reference markers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import PartialState

import fid
from fid.provenance import check_reference_match, provenance, read_class_labels, read_metadata

from ..models import count_params, flops, load_model
from ..sampling import SampleSpec, SamplingPipeline, sample_bulk
from ..sampling.labels import LABEL_SAMPLINGS
from ..training.checkpoint import list_checkpoints
from ..utils.checksums import checkpoint_sha256, sha256_file
from ..utils.precision import PRECISIONS
from . import report

SAMPLE_KEYS = SampleSpec.keys()  # a protocol's sample section: SampleSpec's fields

#: label_sampling: random = SiT / DiT's sample_ddp (behind their FIDs), equal = ADM / REPA-E
EVAL_DEFAULTS = {"num_samples": 50_000, "reference": None, "metrics": ["fid", "sfid", "is", "pr"],
                 "steps": ["last"], "seed": 0, "label_sampling": "random"}
COLUMNS = ["model", "params (M)", "GFLOPs", "step", "FID", "sFID", "IS", "precision", "recall",
           "source"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run directories written by train.py")
    parser.add_argument("--protocol", type=Path, required=True, help="configs/eval/*.yaml")
    parser.add_argument("--out", type=Path, default=Path("results/imagenet"),
                        help="table + plot folder")
    parser.add_argument("--reference", type=Path,
                        help="override eval.reference (ADM reference npz)")
    parser.add_argument("--num-samples", type=int, help="override eval.num_samples")
    parser.add_argument("--steps", nargs="+", help="override eval.steps (numbers or 'last')")
    parser.add_argument("--batch-size", type=int, default=64, help="sampling batch per process")
    parser.add_argument("--fid-batch-size", type=int, default=64, help="Inception batch")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS),
                        help="sampling precision")
    parser.add_argument("--inception-weights", type=Path, default=None,
                        help="torch-fidelity Inception file")
    parser.add_argument("--inception-sha256", default=None, help=argparse.SUPPRESS)  # tests only


def load_protocol(path: str | os.PathLike) -> dict[str, Any]:
    """Read an evaluation protocol (sections ``sample``, ``eval``, ``paper``) and check its keys."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"protocol file {path} does not exist (see configs/eval/)")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - {"sample", "eval", "paper"}
    bad_sample = set(raw.get("sample") or {}) - set(SAMPLE_KEYS)
    bad_eval = set(raw.get("eval") or {}) - set(EVAL_DEFAULTS)
    for where, bad, valid in (("", unknown, ("sample", "eval", "paper")),
                              ("sample.", bad_sample, SAMPLE_KEYS),
                              ("eval.", bad_eval, tuple(EVAL_DEFAULTS))):
        if bad:
            raise ValueError(f"{path}: unknown key(s) {sorted(where + b for b in bad)}; "
                             f"valid: {', '.join(valid)}")
    ev = {**EVAL_DEFAULTS, **(raw.get("eval") or {})}
    if ev["label_sampling"] not in LABEL_SAMPLINGS:
        raise ValueError(f"{path}: eval.label_sampling={ev['label_sampling']!r}; valid: "
                         f"{', '.join(LABEL_SAMPLINGS)}")
    return {"name": path.stem, "sample": dict(raw.get("sample") or {}), "eval": ev,
            "paper": dict(raw.get("paper") or {})}


def sample_spec(sample: dict[str, Any]) -> SampleSpec:
    """The protocol's ``sample`` section as a ``SampleSpec`` (unset keys: the spec's defaults)."""
    return SampleSpec.resolve(sample)


def checkpoints_to_evaluate(run_dir: Path, steps: list[Any]) -> list[tuple[int, Path]]:
    """(step, file) for each requested step ('last' = the newest checkpoint); a missing step is an
    error."""
    found = {step: path for step, path, _ in list_checkpoints(run_dir / "checkpoints")}
    if not found:
        raise FileNotFoundError(f"{run_dir}: no checkpoints in {run_dir / 'checkpoints'}")
    chosen = []
    for step in steps:
        step = max(found) if step == "last" else int(step)
        if step not in found:
            raise FileNotFoundError(
                f"{run_dir}: no checkpoint for step {step} (have {sorted(found)})")
        chosen.append((step, found[step]))
    return sorted(set(chosen))


#: the reference batch's SHA-256, read once per process (every checkpoint is scored against it)
reference_sha256 = functools.cache(sha256_file)


def evaluate_checkpoint(ckpt: Path, out_dir: Path, protocol: dict[str, Any],
                        args: argparse.Namespace, state: PartialState) -> dict[str, Any] | None:
    """Sample (all processes) and score (main process) one checkpoint; returns the metrics on the
    main process."""
    ev = protocol["eval"]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if state.num_processes > 1 and device.type == "cuda":
        device = state.device
    info = load_model(ckpt)
    model = info.model
    pipeline = SamplingPipeline.for_model(info, sample_spec(protocol["sample"]),
                                          vae=info.vae.get("name", "none"), device=device,
                                          precision=args.precision)
    settings = {"ckpt": str(ckpt.resolve()), "model": info.name, "objective": info.objective_name,
                "checkpoint_sha256": checkpoint_sha256(ckpt), **pipeline.input_digests()}
    bulk = sample_bulk(pipeline, ev["num_samples"], out_dir, global_seed=ev["seed"],
                       batch_size=args.batch_size, rank=state.process_index,
                       world_size=state.num_processes, settings=settings,
                       label_sampling=ev["label_sampling"],
                       barrier=state.wait_for_everyone if state.num_processes > 1 else None)
    if not state.is_main_process:
        return None
    weights_kwargs = {"sha256": args.inception_sha256} if args.inception_sha256 else {}
    extractor = fid.load_inception(args.inception_weights, device=device, **weights_kwargs)
    samples, reference = fid.open_images(bulk.npz), fid.read_reference(ev["reference"])
    fid.check_sample_size(samples, reference)  # a size mismatch gives a number that means nothing
    metadata, labels = read_metadata(bulk.npz), read_class_labels(bulk.npz)
    check_reference_match(str(bulk.npz), ev["reference"], labels, metadata, reference.labels,
                          reference.metadata, len(samples))  # another label set or sample count
    metrics = fid.evaluate(samples, reference, extractor, metrics=ev["metrics"],
                           batch_size=args.fid_batch_size, device=str(device))
    record = provenance(metadata, labels, len(samples), len(samples),
                        reference_sha256(ev["reference"]))
    return {**metrics, "model": info.name, "params": count_params(model), "gflops": flops(model),
            "samples": str(bulk.npz), "provenance": record}


def _row(result: dict[str, Any], step: int) -> dict[str, Any]:
    return {"model": result["model"], "params (M)": result["params"] / 1e6,
            "GFLOPs": result["gflops"], "step": step, "FID": result.get("fid"),
            "sFID": result.get("sfid"), "IS": result.get("inception_score"),
            "precision": result.get("precision"), "recall": result.get("recall"), "source": "ours"}


def run(args: argparse.Namespace, command: str) -> int:
    """Evaluate every run x step (cached), then write the comparison table and plot (main process).
    """
    protocol = load_protocol(args.protocol)
    ev = protocol["eval"]
    ev.update({k: v for k, v in (("reference", args.reference), ("num_samples", args.num_samples),
                                 ("steps", args.steps)) if v is not None})
    if not ev["reference"] or not Path(ev["reference"]).is_file():
        raise SystemExit(f"error: reference batch {ev['reference']!r} not found: download the ADM "
                         "reference (VIRTUAL_imagenet256_labeled.npz) and pass --reference PATH")
    state = PartialState()
    rows: list[dict[str, Any]] = []
    for run_dir in args.runs:
        for step, ckpt in checkpoints_to_evaluate(run_dir, ev["steps"]):
            cache = run_dir / "eval" / protocol["name"] / f"{step:07d}.json"
            if cache.is_file():
                result = json.loads(cache.read_text())
            else:
                result = evaluate_checkpoint(ckpt, cache.with_suffix(""), protocol, args, state)
                if state.is_main_process:
                    cache.write_text(json.dumps(result, indent=1))
            if state.is_main_process:
                rows.append(_row(result, step))
    if not state.is_main_process:
        return 0
    rows.sort(key=lambda r: (r["model"], r["step"]))
    rows += [{"model": m, "FID": fid_value, "source": "paper"}
             for m, fid_value in protocol["paper"].items()]
    write_comparison(rows, protocol, args.out, command)
    print(report.markdown_table(rows, COLUMNS))
    return 0


def write_comparison(rows: list[dict[str, Any]], protocol: dict[str, Any], out: Path,
                     command: str) -> None:
    """comparison.md, comparison.csv and fid_vs_step.png (paper points as markers at the last step).
    """
    out.mkdir(parents=True, exist_ok=True)
    name = protocol["name"]
    report.write_csv(rows, COLUMNS, out / f"{name}.csv")
    ours = [r for r in rows if r["source"] == "ours" and r["FID"] is not None]
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for r in ours:
        xs, ys = curves.setdefault(r["model"], ([], []))
        xs.append(r["step"])
        ys.append(r["FID"])
    last = max((r["step"] for r in ours), default=400_000)
    paper = {m: (last, v) for m, v in protocol["paper"].items() if m in curves or not curves}
    if curves or paper:
        report.plot_curves(curves, out / f"{name}_fid_vs_step.png", "training step", "FID-50K",
                           f"protocol: {name}", reference_points=paper)
    table = report.markdown_table(rows, COLUMNS)
    (out / f"{name}.md").write_text(f"# {name}\n\nCommand: `{command}`\n\n{table}\n"
                                    f"![FID vs step]({name}_fid_vs_step.png)\n")
