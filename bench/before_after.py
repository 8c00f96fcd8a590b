"""Train-step time of the models as of an earlier commit vs now, side by side in one process.

    python -m bench.before_after --ref 279a774 --device cpu --threads 1 --sizes S --batch-size 8 \
        --warmup 2 --steps 1 --rounds 15
    python -m bench.before_after --ref 279a774 --device cpu --threads 1 --sizes XL --batch-size 2 \
        --optimizer none --warmup 1 --steps 1 --rounds 7

The package ``sit_vit5`` at ``--ref`` is extracted (``git archive``) and imported as ``sit_vit5_ref``; for
every backbone the reference model is built from it and shares the current model's weight tensors
(``load_state_dict(assign=True)``: one copy of the weights in memory, so XL/2 pairs fit). All variants are
warmed up, then timed in interleaved rounds (``bench.common.interleaved_timings``, the step of
``bench.train_step``). Before timing, one forward + backward on the same batch checks the numerics: the
output's and the gradients' largest difference, relative to their largest magnitude.

Ratios are medians of per-round ratios: ``now / ref`` per backbone, and ViT5 / SiT before and after.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch
from torch import nn

from bench.common import (
    add_common_args,
    build_for,
    interleaved_timings,
    print_table,
    ratios,
    setup,
    write_json,
)
from bench.train_step import make_train_step
from sit_vit5.models import SIZES
from sit_vit5.transport import create_transport

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ("variant", "size", "batch", "step_ms", "step_ms_min", "step_ms_max", "rounds")
RATIO_COLUMNS = ("size", "batch", "rounds", "ratio", "median", "min_round", "max_round")
CHECK_COLUMNS = ("model", "size", "out_equal", "out_rel_diff", "grad_rel_diff")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.before_after", description=__doc__.split("\n")[0])
    p.add_argument("--ref", required=True, help="git commit (or any rev) whose sit_vit5 is the reference")
    p.add_argument("--models", nargs="+", default=["SiT", "ViT5"], choices=("SiT", "ViT5"))
    p.add_argument("--ref-models", nargs="+", default=None, choices=("SiT", "ViT5"),
                   help="backbones also timed at --ref (default: all of --models); the others' ratios use "
                        "their current build (e.g. SiT, whose code did not change, to save an XL/2 model)")
    p.add_argument("--sizes", nargs="+", default=["S"], choices=SIZES)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32, help="latent side (32 = 256 px images)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="none: forward + backward only (XL/2 pairs in a small CPU memory)")
    add_common_args(p, steps=1, warmup=2, rounds=9)
    args = p.parse_args(argv)
    args.ref_models = args.ref_models or args.models
    return args


def import_ref(rev: str, into: Path) -> object:
    """``sit_vit5.models`` as of ``rev``, imported as ``sit_vit5_ref.models`` (relative imports only)."""
    try:
        blob = subprocess.run(["git", "archive", rev, "sit_vit5"], cwd=REPO, capture_output=True,
                              check=True, timeout=60).stdout
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"--ref {rev!r}: git archive failed: {err.stderr.decode().strip()}") from err
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    (into / "sit_vit5").rename(into / "sit_vit5_ref")
    sys.path.insert(0, str(into))
    return importlib.import_module("sit_vit5_ref.models")


def share_weights(model: nn.Module, ref_package: object, name: str, **kw) -> nn.Module:
    """The reference build of ``name`` holding ``model``'s weight tensors (no second copy)."""
    ref = ref_package.create_model(name, **kw).to(next(model.parameters()).device).train()
    ref.load_state_dict(model.state_dict(), assign=True)
    for (key, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        q.requires_grad_(p.requires_grad)
        assert p.data_ptr() == q.data_ptr(), key
    return ref


def numerics(model: nn.Module, ref: nn.Module, args: argparse.Namespace, device: torch.device) -> dict:
    """Largest |now - ref| of the output and of all gradients, each relative to the largest |ref|."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    b, s = min(args.batch_size, 2), args.input_size
    x = torch.randn(b, 4, s, s, generator=gen).to(device)
    t = torch.rand(b, generator=gen).to(device)
    y = torch.randint(0, args.num_classes, (b,), generator=gen).to(device)
    results = []
    for m in (model, ref):
        torch.manual_seed(args.seed)  # the label dropout draws the same labels
        out = m(x, t, y)
        out.square().mean().backward()
        results.append((out.detach(), [p.grad for p in m.parameters() if p.requires_grad]))
        for p in m.parameters():
            p.grad = None
    (out_now, g_now), (out_ref, g_ref) = results
    grad_diff = max(((a - c).abs().max() / c.abs().max().clamp_min(1e-30)).item() for a, c in zip(g_now, g_ref))
    return dict(out_equal=torch.equal(out_now, out_ref),
                out_rel_diff=((out_now - out_ref).abs().max() / out_ref.abs().max()).item(),
                grad_rel_diff=grad_diff)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    tmp = tempfile.TemporaryDirectory(prefix="bench_ref_")
    ref_package = import_ref(args.ref, Path(tmp.name))
    create_transport()  # import cost out of the timings
    rows, ratio_rows, checks = [], [], []
    for size in args.sizes:
        steps, kw = {}, dict(input_size=args.input_size, num_classes=args.num_classes,
                             depth=args.depth or SIZES[size][0])
        for backbone in args.models:
            model = build_for(args, backbone, size).to(device).train()
            variants = [(f"{backbone} now", model)]
            if backbone in args.ref_models:
                ref = share_weights(model, ref_package, f"{backbone}-{size}/{args.patch}", **kw)
                checks.append(dict(model=backbone, size=f"{size}/{args.patch}",
                                   **numerics(model, ref, args, device)))
                variants.append((f"{backbone} ref", ref))
            for label, m in variants:
                steps[label] = make_train_step(m, device, "fp32", "eager", args.batch_size, args.input_size,
                                               args.num_classes, args.seed, optimizer=args.optimizer == "adamw")
                for _ in range(args.warmup):
                    steps[label]()
            del model, variants
        gc.collect()
        times = interleaved_timings(steps, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
        steps.clear()
        gc.collect()
        for label, secs in times.items():
            rows.append(dict(variant=label, size=f"{size}/{args.patch}", batch=args.batch_size,
                             step_ms=statistics.median(secs) * 1e3, step_ms_min=min(secs) * 1e3,
                             step_ms_max=max(secs) * 1e3, rounds=len(secs),
                             rounds_ms=[round(v * 1e3, 3) for v in secs]))
        pairs = [(f"{b} now", f"{b} ref", f"{b} now / ref") for b in args.ref_models]
        if {"SiT", "ViT5"} <= set(args.models):
            before = {b: f"{b} {'ref' if b in args.ref_models else 'now'}" for b in args.models}
            pairs += [(before["ViT5"], before["SiT"], f"{before['ViT5']} / {before['SiT']}"),
                      ("ViT5 now", "SiT now", "ViT5 now / SiT now")]
        for num, den, label in pairs:
            per_round = [a / b for a, b in zip(times[num], times[den])]
            ratio_rows.append(dict(size=f"{size}/{args.patch}", batch=args.batch_size, rounds=len(per_round),
                                   ratio=label, median=ratios(times, num, den, "r")["r"],
                                   min_round=min(per_round), max_round=max(per_round)))
    print_table(checks, CHECK_COLUMNS, f"numerics: now vs {args.ref} (same weights, same batch)")
    unit = "wall" if args.clock == "wall" else "process-CPU"
    print_table(rows, COLUMNS, f"train step ({args.device}, {unit} ms; optimizer {args.optimizer})")
    print_table(ratio_rows, RATIO_COLUMNS, "ratios: median of per-round ratios (interleaved, same run)")
    write_json(args.json, "before_after", args, device, ref=args.ref, rows=rows, ratios=ratio_rows,
               numerics=checks)
    tmp.cleanup()
    return dict(rows=rows, ratios=ratio_rows, numerics=checks)


if __name__ == "__main__":
    main()
