"""Sample quality against the number of model evaluations (NFE), every solver, digits checkpoints.

    python -m sit_vit5.experiments nfe CKPT [CKPT ...] --out results/nfe [--cfg-scales 1 4]
                                        [--time-shifts 1 3]

Each (solver, NFE, CFG scale) row samples ``--num-samples`` images with the checkpoint's EMA and
scores them with the shipped digits networks (8×8 FID; 16×16 FID too for 16-pixel models). Rows
are cached one by one in ``OUT/<name>.json`` (a rerun skips what is there); ``OUT/<name>.md`` and
``.png`` show the table and FID against NFE. NFE counts model evaluations per image as papers do:
a Heun step is 2, CFG's doubled batch counts once, adaptive solvers report what they used. The
reference row is the 250-NFE SDE. A time shift other than 1 makes its own rows, labelled
``<solver> shift<S>``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cli.sample_flags import finite_float, positive_float, positive_int
from ..models import load_model
from ..names import DIFFUSION_SOLVERS, FLOW_SOLVERS
from ..objective import create_objective
from ..sampling import SampleSpec, SamplingPipeline
from ..utils.atomic_files import atomic_write_text
from ..utils.errors import SettingError, one_line
from . import report

NFES = (4, 6, 8, 12, 16, 24, 32, 64, 128, 250)
ADAPTIVE_TOLERANCES = (1e-2, 1e-3, 1e-4)  # dopri5's atol = rtol; its NFE is what it counted
SAMPLE_SEED = 0  # the one sample seed of every row written before 2026-12-06
LABELS = ("cycle", "random")  # i mod 10 (the study's) or sample.py bulk's uniform random labels


@dataclass(frozen=True)
class Solver:
    """One solver of the study: the ``SampleSpec`` fields that choose it (method,
    sampling_method, ...) and the objective it samples; ``spec(nfe)`` sets its steps."""

    name: str
    objective: str
    fields: Mapping[str, Any]

    def spec(self, nfe: int, time_shift: float = 1.0) -> SampleSpec:
        """The spec making ``nfe`` evaluations per image on a grid shifted by ``time_shift`` (SD3's
        shift; 1 = uniform). SettingError naming ``nfe`` when this solver cannot make exactly that
        many, naming ``time_shift`` when it takes no shift (ddim / ddpm)."""
        shift = None if time_shift == 1 else time_shift
        return SampleSpec(**self.fields, time_shift=shift).with_nfe(nfe)


def row_label(solver: str, time_shift: float, labels: str = "cycle") -> str:
    """A row's solver label: the solver's name, ``<name> shift<S>`` on a shifted grid, with
    `` random-labels`` appended when the classes are sample.py bulk's random draw."""
    label = solver if time_shift == 1 else f"{solver} shift{time_shift:g}"
    return label if labels == "cycle" else f"{label} {labels}-labels"


SOLVERS = {
    s.name: s
    for s in (
        Solver("ode-euler", "sit", {"method": "ode", "sampling_method": "euler"}),
        Solver("ode-heun", "sit", {"method": "ode", "sampling_method": "heun2"}),
        Solver("sde-euler-mean", "sit", {"method": "sde", "sampling_method": "Euler",
                                         "last_step": "Mean"}),
        Solver("sde-euler-tweedie", "sit", {"method": "sde", "sampling_method": "Euler",
                                            "last_step": "Tweedie"}),
        # diffusers' multistep solvers with flow sigmas (unipc)
        *(Solver(name, "sit", {"method": "ode", "sampling_method": name}) for name in FLOW_SOLVERS),
        Solver("ddim", "ddpm", {"method": "ddim"}),
        Solver("ddpm", "ddpm", {"method": "ddpm"}),
        # diffusers' multistep solvers of the same ODE (ddim-*) / SDE (ddpm-*)
        *(Solver(f"{method}-{name}", "ddpm", {"method": method, "sampling_method": name})
          for method, solvers in DIFFUSION_SOLVERS.items() for name in solvers),
    )
}


@dataclass(frozen=True)
class Adaptive:
    """dopri5 at several tolerances: its rows are keyed by the tolerance (atol = rtol) and plotted
    at the NFE it counted."""

    name: str
    objective: str

    def spec(self, tol: float, time_shift: float = 1.0) -> SampleSpec:
        if time_shift != 1:  # the shift moves only the points it reports, not its steps
            raise SettingError("time_shift", time_shift, f": {self.name} chooses its own steps")
        return SampleSpec(method="ode", sampling_method="dopri5", num_steps=2, atol=tol, rtol=tol)


ADAPTIVE = Adaptive("ode-dopri5", "sit")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoints", nargs="+", help="digits checkpoints (ours: the run's EMA is sampled)"
    )
    p.add_argument(
        "--out", default="results/nfe", help="folder of the cached rows, tables and plots"
    )
    p.add_argument(
        "--solvers", nargs="+", default=None, choices=[*SOLVERS, ADAPTIVE.name],
        help="default: every solver of each checkpoint's objective; named ones must all sample "
        "every checkpoint (ddim / ddpm: DiT-objective models only, the others SiT's)"
    )
    p.add_argument("--nfe", nargs="+", type=positive_int, default=list(NFES),
                   help="target NFEs per image; each solver asked for must make every one "
                   "exactly (ode-heun: even; the SDE: >= 2), else nothing runs")
    p.add_argument("--cfg-scales", nargs="+", type=finite_float, default=[1.0],
                   help="1 = no guidance")
    p.add_argument("--time-shifts", nargs="+", type=positive_float, default=[1.0],
                   help="SD3 shifts of the time grid, each its own rows (1 = uniform; s > 1 "
                   "spends more steps at high noise); every solver asked for must take them")
    p.add_argument("--num-samples", type=positive_int, default=1000,
                   help="images per row (FID sample size)")
    p.add_argument("--batch-size", type=positive_int, default=250)
    p.add_argument("--sample-seeds", nargs="+", type=int, default=[SAMPLE_SEED],
                   help="global sample seeds (initial and SDE noise); each row stores each seed's "
                   "FID and reports their mean and sd; seeds done are skipped")
    p.add_argument("--labels", choices=LABELS, default="cycle",
                   help="class of sample i: i mod 10 (cycle, the study's), or uniform random "
                   "(sample.py bulk's default; rows labelled '<solver> random-labels')")


def check_grid(solvers: Sequence[str], nfes: Sequence[int],
               time_shifts: Sequence[float] = (1.0,)) -> None:
    """Every (solver, NFE, shift) row the arguments ask for can run: its spec exists and its
    sampler builds (a diffusers scheduler's timesteps stay distinct). Raises SettingError naming
    the NFE (or the shift) and the solver, before any checkpoint is read or row written."""
    for name, shift in itertools.product(solvers, time_shifts):
        solver = SOLVERS.get(name, ADAPTIVE)
        objective = create_objective({"objective": solver.objective})
        for nfe in [None] if solver is ADAPTIVE else nfes:  # adaptive: rows keyed by tolerance
            try:
                if nfe is None:
                    solver.spec(ADAPTIVE_TOLERANCES[0], shift)
                else:
                    objective.sampler(solver.spec(nfe, shift))
            except ValueError as err:  # SettingError, or a respacing the diffusion cannot do
                raise grid_error(name, nfe, shift, err) from None


def grid_error(name: str, nfe: int | None, shift: float, err: ValueError) -> SettingError:
    """The one-line refusal of solver ``name``'s row at ``nfe`` (None: an adaptive solver's) and
    ``shift``: naming the shift when it is at fault, else the NFE."""
    key = err.key if isinstance(err, SettingError) else None
    detail = (err.reason.removeprefix(": ").strip() if key in ("nfe", "time_shift")
              else one_line(err))
    if key == "time_shift" or nfe is None:
        return SettingError("time_shifts", shift, f" for solver {name}: {detail}")
    return SettingError("nfe", nfe, f" for solver {name}: {detail}")


def score(images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Digits FID (8×8 network; and the 16×16 network for 16-pixel images) and class accuracy."""
    from fid.digits import digits_metrics, load_digits_net

    out = digits_metrics(images, labels)
    row = {"fid": out["digits_fid"], "accuracy": out["digits_accuracy"]}
    if images.shape[-1] >= 16:
        row["fid16"] = digits_metrics(images, labels, load_digits_net(resolution=16))["digits_fid"]
    return row


def run_row(
    loaded: Any, solver: Solver | Adaptive, spec: SampleSpec, num_samples: int, batch_size: int,
    sample_seed: int = SAMPLE_SEED, labels_kind: str = "cycle",
) -> dict[str, Any]:
    """Sample and score one row of ``solver`` (``spec``: its settings at this row's NFE) with
    global seed ``sample_seed``: NFE per image as counted, FID, accuracy. ``labels_kind``:
    ``cycle`` gives sample i class i mod K; ``random`` the pipeline's uniform draw (sample.py
    bulk's default), from the same per-sample seeds."""
    pipe = SamplingPipeline.for_model(loaded, spec)
    images, labels, nfe = [], [], set()
    for lo in range(0, num_samples, batch_size):
        indices = range(lo, min(lo + batch_size, num_samples))
        classes = None if labels_kind == "random" else [i % pipe.num_classes for i in indices]
        batch = pipe.generate(indices, sample_seed, labels=classes)
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


def solver_objective(name: str) -> str:
    """The objective solver ``name`` samples (sit or ddpm)."""
    return ADAPTIVE.objective if name == ADAPTIVE.name else SOLVERS[name].objective


def check_solvers(solvers: Sequence[str], path: str | Path, objective: str) -> None:
    """SettingError naming the first of ``solvers`` that cannot sample checkpoint ``path`` (a
    model trained with ``objective``) and that checkpoint's solvers."""
    for name in solvers:
        if solver_objective(name) != objective:
            own = [n for n in (*SOLVERS, ADAPTIVE.name) if solver_objective(n) == objective]
            raise SettingError("solvers", name, f": cannot sample {path}, a model trained with the "
                               f"{objective} objective; its solvers: {', '.join(own)}")


def git_commit(root: str | Path | None = None) -> str | None:
    """The commit HEAD of the checkout holding this file (40 hex digits; ``-dirty`` appended when
    tracked files outside ``results/`` differ from it: result files being written do not change
    what code ran), None outside a git checkout."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ":/", ":(exclude,top)results"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.strip() else "")


def utc_now() -> str:
    """The current time, UTC, ISO 8601 to the second (``2026-12-06T07:30:00Z``)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


METRICS = ("fid", "fid16", "accuracy")


def seed_results(row: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A row's results per sample seed (str seed -> nfe, fid, [fid16], accuracy, and for runs
    from 2026-12-06 on ``started_utc`` and ``commit``). A row written before per-seed storage
    holds one result, at :data:`SAMPLE_SEED` (the harness's only seed then)."""
    if "seeds" in row:
        return dict(row["seeds"])
    return {str(SAMPLE_SEED): {k: row[k] for k in ("nfe", *METRICS) if k in row}}


def with_seed_summary(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its headline fields set from its seeds: ``fid`` / ``fid16`` / ``accuracy`` the
    mean over seeds, ``<metric>_sd`` the sample sd (ddof 1; 0 for one seed), ``n_seeds``, and
    ``nfe`` the largest NFE any seed counted."""
    seeds = seed_results(row)
    out = {**row, "seeds": seeds, "n_seeds": len(seeds),
           "nfe": max(r["nfe"] for r in seeds.values())}
    for metric in METRICS:
        values = [r[metric] for r in seeds.values() if metric in r]
        if values:
            out[metric] = float(np.mean(values))
            out[f"{metric}_sd"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return out


def study(
    path: str | Path,
    solvers: Sequence[str],
    nfes: Sequence[int],
    cfg_scales: Sequence[float],
    num_samples: int,
    batch_size: int,
    out: str | Path,
    loaded: Any = None,
    time_shifts: Sequence[float] = (1.0,),
    sample_seeds: Sequence[int] = (SAMPLE_SEED,),
    labels: str = "cycle",
) -> list[dict[str, Any]]:
    """Every row of one checkpoint (``loaded``: it, already loaded), computed or read from
    ``OUT/<name>.json``; writes the table and the plot. Solvers of another objective are
    skipped. Each row runs once per sample seed (seeds outermost, so a stopped run leaves every
    row with about as many seeds); the file is rewritten after each, and a rerun skips the
    (row, seed) pairs it holds. Each new result records its start time (UTC) and commit."""
    loaded = loaded if loaded is not None else load_model(path)
    name = checkpoint_name(path)
    cache = Path(out) / f"{name}.json"
    rows: dict[str, dict[str, Any]] = json.loads(cache.read_text()) if cache.is_file() else {}
    commit = git_commit()
    for seed, solver_name in itertools.product(sample_seeds, solvers):
        solver = ADAPTIVE if solver_name == ADAPTIVE.name else SOLVERS[solver_name]
        if solver.objective != loaded.objective_name:
            continue
        targets = ADAPTIVE_TOLERANCES if solver is ADAPTIVE else nfes
        for shift, cfg, target in itertools.product(time_shifts, cfg_scales, targets):
            label = row_label(solver.name, shift, labels)
            key = f"{label} {target:g} cfg{cfg:g}"
            done = seed_results(rows[key]) if key in rows else {}
            if str(seed) in done:
                continue
            spec = SampleSpec.resolve({"cfg_scale": cfg}, vars(solver.spec(target, shift)))
            started = utc_now()
            result = run_row(loaded, solver, spec, num_samples, batch_size, seed, labels)
            done[str(seed)] = {**result, "started_utc": started, "commit": commit}
            rows[key] = with_seed_summary({"solver": label, "target": target, "cfg_scale": cfg,
                                           "seeds": done})
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache, json.dumps(rows, indent=1, sort_keys=True))
    table = sorted((with_seed_summary(r) for r in rows.values()),
                   key=lambda r: (r["cfg_scale"], r["solver"], r["nfe"]))
    for row in table:
        row.pop("seeds")
    columns = [
        c
        for c in ("solver", "cfg_scale", "target", "nfe", "n_seeds", "fid", "fid_sd", "fid16",
                  "fid16_sd", "accuracy")
        if any(c in r for r in table)
    ]
    atomic_write_text(
        Path(out) / f"{name}.md",
        f"# FID against NFE: {path}\n\nMean over the row's sample seeds (`n_seeds`), sd with "
        "ddof 1 (0 for one seed).\n\n" + report.markdown_table(table, columns) + "\n",
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
    """Every checkpoint's rows, table and plot; prints the best row of each. Bad arguments (a
    missing checkpoint, an NFE a solver cannot make) are refused before anything is written."""
    missing = [path for path in args.checkpoints if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint not found: {', '.join(missing)}")
    models = {path: load_model(path) for path in args.checkpoints}  # digits models: small
    if args.solvers:  # named solvers: each must sample every checkpoint
        for path, loaded in models.items():
            check_solvers(args.solvers, path, loaded.objective_name)
    objectives = {loaded.objective_name for loaded in models.values()}
    solvers = args.solvers or [n for n in (*SOLVERS, ADAPTIVE.name)
                               if solver_objective(n) in objectives]  # those that will run
    check_grid(solvers, args.nfe, args.time_shifts)
    for path in args.checkpoints:
        table = study(path, solvers, args.nfe, args.cfg_scales, args.num_samples,
                      args.batch_size, args.out, models.pop(path, None), args.time_shifts,
                      args.sample_seeds, args.labels)
        line = f"{path}: {len(table)} rows -> {args.out}"
        if table:
            best = min(table, key=lambda r: r.get("fid16", r["fid"]))
            fid = best.get("fid16", best["fid"])
            line += f"; best {best['solver']} at NFE {best['nfe']}: FID {fid:.2f}"
        print(line)
    return 0


#: a row file's name: dataset-arm-seedN-step (``checkpoint_name`` of a digits-study checkpoint)
ROW_FILE = re.compile(r"(?P<kind>.+)-seed(?P<seed>\d+)-(?P<step>\d+)\.json")
REFERENCE = ("sde-euler-mean", 250)  # SiT's default sampler: the row each setting is held against


#: kind -> training seed -> (cfg scale, solver, NFE) -> FID (FID16 on digits16, else the 8×8 FID)
SeedFids = dict[str, dict[int, dict[tuple[float, str, int], float]]]


def seed_fids(out: str | Path) -> SeedFids:
    """Every row file of ``out`` named ``<kind>-seed<N>-<step>.json``, read once."""
    fids: SeedFids = {}
    for path in sorted(Path(out).glob("*.json")):
        match = ROW_FILE.fullmatch(path.name)
        if match is None:
            continue
        kind = match["kind"]
        metric = "fid16" if kind.startswith("digits16") else "fid"
        fids.setdefault(kind, {})[int(match["seed"])] = {
            (r["cfg_scale"], r["solver"], r["nfe"]): r[metric]
            for r in json.loads(path.read_text()).values()}
    return fids


def summary_rows(fids: SeedFids, settings: Sequence[tuple[str, int]] = (("unipc", 8),
                                                                         ("unipc", 16))
                 ) -> list[dict[str, Any]]:
    """Per checkpoint kind (dataset-arm), CFG scale and setting: the ratio of the setting's FID to
    the same checkpoint's 250-NFE SDE FID over the training seeds that have both
    (:func:`seed_fids`): n, mean, min, max and the seeds."""
    ratios: dict[tuple[str, float, str, int], dict[int, float]] = {}
    for kind, seeds in fids.items():
        for seed, at in seeds.items():
            for cfg in sorted({c for c, _, _ in at}):
                if (cfg, *REFERENCE) not in at:
                    continue
                for solver, nfe in settings:
                    if (cfg, solver, nfe) in at:
                        ratio = at[cfg, solver, nfe] / at[(cfg, *REFERENCE)]
                        ratios.setdefault((kind, cfg, solver, nfe), {})[seed] = ratio
    table = []
    for (kind, cfg, solver, nfe), by_seed in sorted(ratios.items()):
        values = np.array(list(by_seed.values()))
        table.append({"checkpoint": kind, "cfg_scale": cfg, "setting": f"{solver} {nfe}",
                      "n": len(values), "mean_ratio": float(values.mean()),
                      "min_ratio": float(values.min()), "max_ratio": float(values.max()),
                      "seeds": " ".join(map(str, sorted(by_seed)))})
    return table


def _plot_seeds(fids: SeedFids, path: Path,
                solvers: Sequence[str] = ("unipc", "sde-euler-mean")) -> None:
    """One panel per checkpoint kind: each solver's FID (FID16 on digits16) against the NFE at CFG
    1, the mean over the training seeds with their min-max band, at NFEs every seed has."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(fids), figsize=(4.5 * len(fids), 3.8), squeeze=False)
    for ax, (kind, seeds) in zip(axes[0], sorted(fids.items()), strict=True):
        for solver in solvers:
            nfes = sorted(set.intersection(*({n for c, s, n in at if (c, s) == (1, solver)}
                                              for at in seeds.values())))
            if not nfes:
                continue
            values = np.array([[at[1, solver, n] for n in nfes] for at in seeds.values()])
            ax.plot(nfes, values.mean(0), marker="o", label=f"{solver} (n = {len(values)})")
            ax.fill_between(nfes, values.min(0), values.max(0), alpha=0.2)
        ax.set(xscale="log", yscale="log", xlabel="NFE per image", title=kind,
               ylabel="FID16" if kind.startswith("digits16") else "FID (8×8)")
        ax.legend(fontsize=7)
    report.save_figure(fig, path)


def summarize(out: str | Path) -> Path:
    """Write ``OUT/summary.md`` (:func:`summary_rows` as a table) and ``OUT/summary.png`` (FID
    against NFE over the training seeds); returns the table's path. A folder whose rows carry
    several sample seeds gets :func:`write_seed_summary` instead."""
    if any("seeds" in row for path in Path(out).glob("*.json")
           for row in json.loads(path.read_text()).values()):
        return write_seed_summary(out)
    fids = seed_fids(out)
    table = summary_rows(fids)
    if not table:
        raise FileNotFoundError(f"{out}: no row files with a 250-NFE SDE reference "
                                "(python -m sit_vit5.experiments nfe CKPT --out ...)")
    _plot_seeds(fids, Path(out) / "summary.png")
    for row in table:
        for key in ("mean_ratio", "min_ratio", "max_ratio"):
            row[key] = f"{row[key]:.3f}"
    path = Path(out) / "summary.md"
    atomic_write_text(path, "# Few-step settings against the 250-NFE SDE (FID ratio; < 1 = "
                      "better)\n\nWritten by `python -m sit_vit5.experiments nfe-summary --out "
                      f"{out}` from the row files beside it; summary.png: FID against NFE, "
                      "seed mean and min-max band.\n\n"
                      + report.markdown_table(table, list(table[0])) + "\n")
    return path


# ---- issue 55: rows over sample seeds, ratios with intervals -------------------------------------

#: each objective's reference row: SiT's 250-NFE SDE, DiT's own DDPM at 250 steps
REFERENCES = {"sit": ("sde-euler-mean", 250), "ddpm": ("ddpm", 250)}
#: the settings the verdicts read (results/nfe/README.md, rules of 12-04 23:40, 12-05 02:05), per
#: objective; every other row of a file is shown against its reference too
VERDICT_SETTINGS = {"sit": (("unipc", 8), ("unipc", 16)),
                    "ddpm": (("ddpm-dpm++2m-sde", 8), ("ddpm-dpm++2m-sde", 12))}


def metric_of(name: str) -> str:
    """The FID a checkpoint's file is read by: FID16 on digits16, else the 8×8 FID."""
    return "fid16" if name.startswith("digits16") else "fid"


def seed_values(row: Mapping[str, Any], metric: str) -> list[float]:
    """``metric`` of each sample seed of ``row`` (seed order)."""
    return list(seed_map(row, metric).values())


def seed_map(row: Mapping[str, Any], metric: str) -> dict[str, float]:
    """str sample seed -> ``metric`` of ``row`` (seed order)."""
    seeds = seed_results(row)
    return {k: seeds[k][metric] for k in sorted(seeds, key=int) if metric in seeds[k]}


def ratio_interval(setting: Sequence[float], reference: Sequence[float],
                   level: float = 0.95, power: float = 0.8) -> dict[str, float]:
    """R = mean(setting) / mean(reference) over sample seeds, with the delta method on log R (the
    two rows independent): se^2 = sd_s^2 / (n_s m_s^2) + sd_r^2 / (n_r m_r^2), interval
    exp(log R ± t se), t Student's at ``level`` two-sided with min(n) - 1 df. ``detectable``: the
    smallest relative ratio difference found at two-sided ``1 - level`` with ``power``,
    exp((t_level + t_power) se) - 1. NaN interval and detectable below two seeds a row."""
    from scipy import stats

    s, r = np.asarray(setting, dtype=float), np.asarray(reference, dtype=float)
    ratio = float(s.mean() / r.mean())
    out = {"ratio": ratio, "n_setting": len(s), "n_reference": len(r),
           "lo": math.nan, "hi": math.nan, "se_log": math.nan, "detectable": math.nan}
    df = min(len(s), len(r)) - 1
    if df < 1:
        return out
    se = math.sqrt(s.var(ddof=1) / (len(s) * s.mean() ** 2)
                   + r.var(ddof=1) / (len(r) * r.mean() ** 2))
    t = float(stats.t.ppf(0.5 + level / 2, df))
    out.update(lo=ratio * math.exp(-t * se), hi=ratio * math.exp(t * se), se_log=se,
               detectable=math.expm1((t + float(stats.t.ppf(power, df))) * se))
    return out


def paired_ratio(setting: Mapping[str, float], reference: Mapping[str, float],
                 level: float = 0.95) -> dict[str, float]:
    """Over the sample seeds both rows have (same seed: same initial noise and labels): the
    geometric mean of the per-seed ratios with a t interval over their logs (n - 1 df). Added
    2026-12-06 after the first demo rows (exploratory; the reading uses :func:`ratio_interval`)."""
    common = sorted(set(setting) & set(reference), key=int)
    return {"n": len(common), **{k: v for k, v in log_ratio_over_training_seeds(
        [setting[k] / reference[k] for k in common] or [math.nan], level).items() if k != "n"}}


def _common(a: Mapping[str, float], b: Mapping[str, float]) -> tuple[dict[str, float], ...]:
    """``a`` and ``b`` restricted to the seeds both have, in seed order."""
    keys = sorted(set(a) & set(b), key=int)
    return {k: a[k] for k in keys}, {k: b[k] for k in keys}


def reading(lo: float, hi: float, margin: float = 1.05) -> str:
    """The 2026-12-06 reading of a ratio's interval [lo, hi] against the 5 % margin."""
    if math.isnan(lo):
        return "no interval (one seed)"
    if hi < 1:
        return "below the reference"
    if hi <= margin:
        return "within 5 %"
    if lo > margin:
        return "more than 5 % above"
    return "not resolved"


def log_ratio_over_training_seeds(ratios: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Geometric mean of per-training-seed ratios with a t interval over their logs (n - 1 df)."""
    from scipy import stats

    logs = np.log(np.asarray(ratios, dtype=float))
    out = {"ratio": float(np.exp(logs.mean())), "n": len(logs), "lo": math.nan, "hi": math.nan}
    if len(logs) > 1:
        half = float(stats.t.ppf(0.5 + level / 2, len(logs) - 1)) * logs.std(ddof=1) / math.sqrt(
            len(logs))
        out.update(lo=float(np.exp(logs.mean() - half)), hi=float(np.exp(logs.mean() + half)))
    return out


def seed_summary_rows(out: str | Path) -> list[dict[str, Any]]:
    """Per row file of ``out``, CFG scale and non-reference row: the row's mean ± sd over its
    sample seeds, the reference's, R with its delta-method interval (:func:`ratio_interval`), the
    detectable difference and the reading; ``verdict`` marks the settings a rule reads."""
    table = []
    for path in sorted(Path(out).glob("*.json")):
        name = path.name.removesuffix(".json")
        metric = metric_of(name)
        rows = list(json.loads(path.read_text()).values())
        solvers = {r["solver"].split(" ")[0] for r in rows}
        objective = "ddpm" if {"ddpm", "ddim"} & solvers or any(
            s.startswith(("ddim-", "ddpm-")) for s in solvers) else "sit"
        ref_solver, ref_nfe = REFERENCES[objective]
        for cfg in sorted({r["cfg_scale"] for r in rows}):
            at = {(r["solver"], r["target"]): r for r in rows if r["cfg_scale"] == cfg}
            for (solver, target), row in sorted(at.items(), key=lambda kv: (kv[0][0], kv[0][1])):
                # a random-labels row is held against the random-labels reference, if it ran
                own = ref_solver + (" random-labels" if solver.endswith(" random-labels") else "")
                reference = at.get((own, ref_nfe))
                if reference is None or (solver, target) == (own, ref_nfe):
                    continue
                ref = seed_values(reference, metric)
                values = seed_values(row, metric)
                ratio = ratio_interval(values, ref)
                paired = paired_ratio(seed_map(row, metric), seed_map(reference, metric))
                table.append({
                    "checkpoint": name, "cfg_scale": cfg, "setting": f"{solver} {target:g}",
                    "verdict": (solver, target) in VERDICT_SETTINGS[objective],
                    "n": len(values), "fid": float(np.mean(values)),
                    "fid_sd": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                    "reference": f"{own} {ref_nfe}", "n_reference": len(ref),
                    "reference_fid": float(np.mean(ref)),
                    "reference_sd": float(np.std(ref, ddof=1)) if len(ref) > 1 else 0.0,
                    **{k: ratio[k] for k in ("ratio", "lo", "hi", "detectable")},
                    "reading": reading(ratio["lo"], ratio["hi"]),
                    "paired": paired["ratio"], "paired_lo": paired["lo"],
                    "paired_hi": paired["hi"],
                    "paired_logs": [math.log(a / b) for a, b in zip(
                        *(list(m.values()) for m in _common(seed_map(row, metric),
                                                            seed_map(reference, metric))))]})
    return table


def kind_summary_rows(table: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per digits kind (dataset-arm), CFG scale and verdict setting: the geometric mean of the
    training seeds' ratios with a t interval over them (rows of :func:`seed_summary_rows`)."""
    groups: dict[tuple[str, float, str], dict[int, float]] = {}
    pooled: dict[tuple[str, float, str], list[float]] = {}
    for row in table:
        match = ROW_FILE.fullmatch(row["checkpoint"] + ".json")
        if match is None or not row["verdict"]:
            continue
        key = (match["kind"], row["cfg_scale"], row["setting"])
        groups.setdefault(key, {})[int(match["seed"])] = row["ratio"]
        pooled.setdefault(key, []).extend(row.get("paired_logs", []))
    out = []
    for (kind, cfg, setting), by_seed in sorted(groups.items()):
        over = log_ratio_over_training_seeds([by_seed[s] for s in sorted(by_seed)])
        # added 2026-12-06 after the digits8 rows (exploratory): every (training, sample) seed's
        # paired log ratio pooled, t interval with n - 1 df (clustering by training seed ignored)
        paired = log_ratio_over_training_seeds(
            [math.exp(v) for v in pooled[kind, cfg, setting]] or [math.nan])
        out.append({"kind": kind, "cfg_scale": cfg, "setting": setting,
                    "n_training_seeds": over["n"],
                    "seeds": " ".join(map(str, sorted(by_seed))), "ratio": over["ratio"],
                    "lo": over["lo"], "hi": over["hi"], "reading": reading(over["lo"], over["hi"]),
                    "n_paired": len(pooled[kind, cfg, setting]), "paired": paired["ratio"],
                    "paired_lo": paired["lo"], "paired_hi": paired["hi"],
                    "paired_reading": reading(paired["lo"], paired["hi"])})
    return out


def _fmt(row: Mapping[str, Any]) -> dict[str, str]:
    """A summary row as printed: FIDs to 2 decimals with ± sd, ratios to 3."""
    out = {}
    for key, value in row.items():
        if key in ("fid_sd", "reference_sd", "paired_logs"):
            continue
        if key in ("fid", "reference_fid"):
            sd = row["fid_sd" if key == "fid" else "reference_sd"]
            out[key] = f"{value:.2f} ± {sd:.2f}"
        elif key in ("ratio", "lo", "hi", "paired", "paired_lo", "paired_hi"):
            out[key] = "–" if math.isnan(value) else f"{value:.3f}"
        elif key == "detectable":
            out[key] = "–" if math.isnan(value) else f"{100 * value:.1f} %"
        elif key == "verdict":
            out[key] = "yes" if value else ""
        else:
            out[key] = str(value)
    return out


def write_seed_summary(out: str | Path) -> Path:
    """``OUT/summary.md``: :func:`seed_summary_rows` and :func:`kind_summary_rows` as tables."""
    table = seed_summary_rows(out)
    if not table:
        raise FileNotFoundError(f"{out}: no row files with a reference row")
    kinds = kind_summary_rows(table)
    text = (
        "# Few-step settings against the reference, over sample seeds (FID ratio; < 1 = better)\n\n"
        f"Written by `python -m sit_vit5.experiments nfe-summary --out {out}` from the row files "
        "beside it. FID: mean ± sd (ddof 1) over the row's sample seeds (n); FID16 on digits16. "
        "Reference: the 250-NFE SDE (SiT objective) or DDPM 250 (DiT objective). `ratio` = "
        "mean / reference mean; `lo`–`hi`: 95 % interval, delta method on log ratio, rows "
        "independent, Student's t with min(n) − 1 df; `detectable`: smallest ratio difference "
        "found at 5 % two-sided with 80 % power at this n. `reading` (rule of 2026-12-06): below "
        "the reference (hi < 1), within 5 % (hi ≤ 1.05), more than 5 % above (lo > 1.05), else "
        "not resolved. `verdict`: a setting the written rules read. `paired` (added 2026-12-06 "
        "after the first demo rows, exploratory): geometric mean of the per-seed ratios over the "
        "seeds both rows have (a seed gives both the same initial noise and labels), with a 95 % "
        "t interval over their logs.\n\n"
        + report.markdown_table([_fmt(r) for r in table], list(_fmt(table[0]))) + "\n")
    if kinds:
        text += ("\n## Over training seeds (digits)\n\nGeometric mean of each training seed's "
                 "ratio; 95 % t interval over their logs (n − 1 df). `paired` (added 2026-12-06 "
                 "after the digits8 rows, exploratory): every (training seed, sample seed) pair's "
                 "ratio pooled (`n_paired`), geometric mean with a t interval over their logs, "
                 "clustering by training seed ignored; `paired_reading`: the same words.\n\n"
                 + report.markdown_table([_fmt(r) for r in kinds], list(_fmt(kinds[0]))) + "\n")
    path = Path(out) / "summary.md"
    atomic_write_text(path, text)
    return path
