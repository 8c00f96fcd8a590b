"""Sample quality against the number of model evaluations (NFE), every solver, digits checkpoints.

    python -m sit_vit5.experiments nfe CKPT [CKPT ...] --out results/nfe [--cfg-scales 1 4]

Each (solver, NFE, CFG scale) row samples ``--num-samples`` images with the checkpoint's EMA and
scores them with the shipped digits networks (8×8 FID; 16×16 FID too for 16-pixel models). Rows
are cached one by one in ``OUT/<name>.json`` (a rerun skips what is there); ``OUT/<name>.md`` and
``.png`` show the table and FID against NFE. NFE counts model evaluations per image as papers do:
a Heun step is 2, CFG's doubled batch counts once, adaptive solvers report what they used. The
reference row is the 250-NFE SDE.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..atomic_files import atomic_write_text
from ..models import load_model
from ..sampling import SampleSpec, SamplingPipeline
from . import report

NFES = (4, 6, 8, 12, 16, 24, 32, 64, 128, 250)
ADAPTIVE_TOLERANCES = (1e-2, 1e-3, 1e-4)  # dopri5's atol = rtol; its NFE is what it counted
SAMPLE_SEED = 0


@dataclass(frozen=True)
class Solver:
    """How one solver reaches ``nfe`` evaluations: ``spec(nfe)`` (None: not reachable) and,
    for diffusers' multistep solvers, ``scheduler()``."""

    name: str
    objective: str
    spec: Callable[[int], SampleSpec | None]
    scheduler: Callable[[], Any] | None = None


def _flow(cls_name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        import diffusers

        return getattr(diffusers, cls_name)(
            use_flow_sigmas=True, prediction_type="flow_prediction", **kwargs
        )

    return make


def _ode(method: str, per_step: int) -> Callable[[int], SampleSpec | None]:
    # num_steps grid points = num_steps - 1 steps of ``per_step`` evaluations
    return lambda nfe: (
        SampleSpec(method="ode", sampling_method=method, num_steps=nfe // per_step + 1)
        if nfe % per_step == 0
        else None
    )


def _sde(last_step: str) -> Callable[[int], SampleSpec | None]:
    # Euler-Maruyama: num_steps - 1 steps and one last-step evaluation
    return lambda nfe: (
        SampleSpec(method="sde", sampling_method="Euler", num_steps=nfe, last_step=last_step)
        if nfe >= 2
        else None
    )


SOLVERS = {
    s.name: s
    for s in (
        Solver("ode-euler", "sit", _ode("euler", 1)),
        Solver("ode-heun", "sit", _ode("heun2", 2)),
        Solver("sde-euler-mean", "sit", _sde("Mean")),
        Solver("sde-euler-tweedie", "sit", _sde("Tweedie")),
        Solver("unipc", "sit", _ode("euler", 1), _flow("UniPCMultistepScheduler")),
        Solver(
            "dpm++2m",
            "sit",
            _ode("euler", 1),
            _flow("DPMSolverMultistepScheduler", algorithm_type="dpmsolver++", solver_order=2),
        ),
        Solver(
            "dpm++3m",
            "sit",
            _ode("euler", 1),
            _flow("DPMSolverMultistepScheduler", algorithm_type="dpmsolver++", solver_order=3),
        ),
        Solver("ddim", "ddpm", lambda nfe: SampleSpec(method="ddim", num_steps=nfe)),
        Solver("ddpm", "ddpm", lambda nfe: SampleSpec(method="ddpm", num_steps=nfe)),
    )
}
#: dopri5 at several tolerances: its rows are keyed by the tolerance, plotted at the NFE it counted
ADAPTIVE = Solver(
    "ode-dopri5",
    "sit",
    lambda tol: SampleSpec(method="ode", sampling_method="dopri5", num_steps=2, atol=tol, rtol=tol),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoints", nargs="+", help="digits checkpoints (ours: the run's EMA is sampled)"
    )
    p.add_argument(
        "--out", default="results/nfe", help="folder of the cached rows, tables and plots"
    )
    p.add_argument(
        "--solvers", nargs="+", default=[*SOLVERS, ADAPTIVE.name], choices=[*SOLVERS, ADAPTIVE.name]
    )
    p.add_argument("--nfe", nargs="+", type=int, default=list(NFES), help="target NFEs per image")
    p.add_argument("--cfg-scales", nargs="+", type=float, default=[1.0], help="1 = no guidance")
    p.add_argument("--num-samples", type=int, default=1000, help="images per row (FID sample size)")
    p.add_argument("--batch-size", type=int, default=250)


def score(images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Digits FID (8×8 network; and the 16×16 network for 16-pixel images) and class accuracy."""
    from fid.digits import digits_metrics, load_digits_net

    out = digits_metrics(images, labels)
    row = {"fid": out["digits_fid"], "accuracy": out["digits_accuracy"]}
    if images.shape[-1] >= 16:
        row["fid16"] = digits_metrics(images, labels, load_digits_net(resolution=16))["digits_fid"]
    return row


def run_row(
    loaded: Any, solver: Solver, spec: SampleSpec, num_samples: int, batch_size: int
) -> dict[str, Any]:
    """Sample and score one row: NFE per image as counted, FID, accuracy."""
    pipe = SamplingPipeline.for_model(loaded, spec)
    steps = pipe.steps(solver.scheduler()) if solver.scheduler else None
    images, labels, nfe = [], [], set()
    for lo in range(0, num_samples, batch_size):
        indices = range(lo, min(lo + batch_size, num_samples))
        batch = pipe.generate(
            indices, SAMPLE_SEED, labels=[i % pipe.num_classes for i in indices], steps=steps
        )
        images.append(batch.pixels)
        labels.append(torch.as_tensor(batch.labels))
        nfe.add(batch.nfe)
    return {"nfe": max(nfe), **score(torch.cat(images), torch.cat(labels))}


def checkpoint_name(path: str | Path) -> str:
    """A file name for a checkpoint's rows: ``dataset-variant-seed3-0002000`` for a run's
    ``.../dataset/variant/seed3/checkpoints/0002000.pt`` (three folders above), else the stem."""
    path = Path(path)
    if path.parent.name != "checkpoints":
        return path.stem
    return "-".join([*path.parent.parent.parts[-3:], path.stem])


def study(
    path: str | Path,
    solvers: Sequence[str],
    nfes: Sequence[int],
    cfg_scales: Sequence[float],
    num_samples: int,
    batch_size: int,
    out: str | Path,
) -> list[dict[str, Any]]:
    """Every row of one checkpoint, computed or read from ``OUT/<name>.json``; writes the table and
    the plot."""
    loaded = load_model(path)
    name = checkpoint_name(path)
    cache = Path(out) / f"{name}.json"
    rows: dict[str, dict[str, Any]] = json.loads(cache.read_text()) if cache.is_file() else {}
    for solver_name in solvers:
        solver = ADAPTIVE if solver_name == ADAPTIVE.name else SOLVERS[solver_name]
        if solver.objective != loaded.objective_name:
            continue
        targets = ADAPTIVE_TOLERANCES if solver is ADAPTIVE else nfes
        for cfg in cfg_scales:
            for target in targets:
                key = f"{solver.name} {target:g} cfg{cfg:g}"
                spec = solver.spec(target)
                if key in rows or spec is None:
                    continue
                spec = SampleSpec.resolve({"cfg_scale": cfg}, vars(spec))
                rows[key] = {
                    "solver": solver.name,
                    "target": target,
                    "cfg_scale": cfg,
                    **run_row(loaded, solver, spec, num_samples, batch_size),
                }
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(cache, json.dumps(rows, indent=1, sort_keys=True))
    table = sorted(rows.values(), key=lambda r: (r["cfg_scale"], r["solver"], r["nfe"]))
    columns = [
        c
        for c in ("solver", "cfg_scale", "target", "nfe", "fid", "fid16", "accuracy")
        if any(c in r for r in table)
    ]
    atomic_write_text(
        Path(out) / f"{name}.md",
        f"# FID against NFE: {path}\n\n" + report.markdown_table(table, columns) + "\n",
    )
    _plot(table, Path(out) / f"{name}.png", name)
    return table


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    metric = "fid16" if any("fid16" in r for r in rows) else "fid"
    for solver, cfg in sorted({(r["solver"], r["cfg_scale"]) for r in rows}):
        points = sorted(
            (r["nfe"], r[metric]) for r in rows if (r["solver"], r["cfg_scale"]) == (solver, cfg)
        )
        ax.plot(
            *zip(*points), marker="o", label=f"{solver}" + (f", CFG {cfg:g}" if cfg != 1 else "")
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="NFE per image",
        ylabel=f"digits {metric.upper()}",
        title=title,
    )
    ax.legend(fontsize=7)
    report.save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """Every checkpoint's rows, table and plot; prints the best row of each."""
    for path in args.checkpoints:
        table = study(path, args.solvers, args.nfe, args.cfg_scales, args.num_samples,
                      args.batch_size, args.out)
        line = f"{path}: {len(table)} rows -> {args.out}"
        if table:
            best = min(table, key=lambda r: r.get("fid16", r["fid"]))
            fid = best.get("fid16", best["fid"])
            line += f"; best {best['solver']} at NFE {best['nfe']}: FID {fid:.2f}"
        print(line)
    return 0
