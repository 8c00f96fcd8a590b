"""``python results/digits/study ...``: the digits proxy, ViT-5 vs SiT curves + ablations (CPU;
see results/digits/PROTOCOL.md); ``--claims``: the claims addition; ``--repa``: the REPA addition;
``--samples``: the sample-quality addition; ``--meanflow``: the MeanFlow addition (pilot first).
Run from the repository root: the cached runs are read from and written to ``--out`` (default
``results/digits``), checkpoints to ``--runs-dir``."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

if not __package__:  # run as a folder: import it as the package ``study``, not file by file
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    sys.path.insert(0, str(_HERE.parent))

from sit_vit5.experiments.report import markdown_table  # noqa: E402
from sit_vit5.utils.errors import EXIT_TERMINATED, run_cli  # noqa: E402
from study.claims import BUDGET_CORE_HOURS, plan_claims, write_claims  # noqa: E402
from study.digits import (  # noqa: E402
    DATASETS,
    REPO,
    RESULTS,
    STOP_BY_MARGIN,
    RunStopped,
    claims_spent,
    ends_by,
    load_results,
    plan,
    sweep,
    sweep_status,
    write_report,
)
from study.meanflow import MEANFLOW_BUDGET_CORE_HOURS, PILOT_FILE, meanflow_report, plan_meanflow, write_pilot  # noqa: E402
from study.meanflow import spent as meanflow_spent  # noqa: E402
from study.repa import REPA_BUDGET_CORE_HOURS, plan_repa, repa_report, spent  # noqa: E402
from study.samples import (  # noqa: E402
    COMPARISON_PAGE,
    SAMPLES_BUDGET_CORE_HOURS,
    bottom_line,
    plan_samples,
    samples_report,
    update_marked_block,
)
from study.samples import spent as samples_spent  # noqa: E402

PROG = "python results/digits/study"


def parser() -> argparse.ArgumentParser:
    """The command line of the study (the old ``python -m sit_vit5.experiments digits``)."""
    d = argparse.ArgumentParser(prog=PROG, description=__doc__)
    d.add_argument("--seeds", type=int, default=3, help="seeds per main variant")
    d.add_argument("--ablation-seeds", type=int, default=2, help="seeds per ablation variant")
    d.add_argument("--steps", type=int, default=2000, help="training steps per run")
    d.add_argument("--num-samples", type=int, default=1000, help="samples scored per checkpoint")
    d.add_argument("--datasets", nargs="+", default=None, help="subset of: digits8 digits16")
    d.add_argument("--variants", nargs="+", default=None,
                   help="subset of the variant names (default: all)")
    d.add_argument("--jobs", type=int, default=2,
                   help="runs in parallel (processes of one thread each)")
    d.add_argument("--runs-dir", default="runs/digits-proxy", help="run directories (checkpoints)")
    d.add_argument("--out", default=None,
                   help="report and cached results (default: results/digits)")
    d.add_argument("--report-only", action="store_true",
                   help="rewrite the report from the cached runs")
    d.add_argument("--claims", action="store_true",
                   help="run the claims addition of PROTOCOL.md (2026-12-01) in its order, within "
                        "its core-hour budget (--jobs 1 or 2: one-thread runs), instead of the original sweep")
    d.add_argument("--repa", action="store_true",
                   help="run the REPA addition of PROTOCOL.md (2026-12-02) in its order, within "
                        "its core-hour budget (use --jobs 1), instead of the original sweep")
    d.add_argument("--samples", action="store_true",
                   help="run the sample-quality addition of PROTOCOL.md (2026-12-04) in its order, within its "
                        "core-hour budget (--jobs 1 or 2: one-thread runs), instead of the original sweep")
    d.add_argument("--meanflow", action="store_true",
                   help="run the MeanFlow addition of PROTOCOL.md (2026-12-06) in its order, within its core-hour "
                        f"budget: first the pilot alone, which then writes {PILOT_FILE} (n per dataset; commit it), "
                        "then, on the next start, the arms and the flow references")
    d.add_argument("--featnet-check", action="store_true",
                   help="retrain one committed run and score its samples by the shipped and by re-trained digits "
                        "feature networks (study/featnet.py), then exit")
    d.add_argument("--status", action="store_true",
                   help="print what the chosen sweep has done and what is left (runs, core-hours "
                        "estimated from the finished runs), then exit; runs nothing")
    d.add_argument("--stop-by", type=stop_by_time, default=None, metavar="HH:MM",
                   help="start only the runs estimated (from the finished runs, with a margin of "
                        f"{STOP_BY_MARGIN:g}×) to end by this local time (its next occurrence; or an ISO "
                        "date-time), skipping the others: for sessions or jobs with a hard end")
    d.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="extra config overrides for every run")
    return d


def stop_by_time(text: str, now: datetime | None = None) -> float:
    """``--stop-by``: "HH:MM" (the next such local time after ``now``) or an ISO date-time, as seconds
    since the epoch."""
    now = now or datetime.now()
    try:
        if len(text) <= 5 and ":" in text:
            hour, minute = (int(x) for x in text.split(":"))
            when = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
            return (when + timedelta(days=1) if when <= now else when).timestamp()
        return datetime.fromisoformat(text).timestamp()
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--stop-by {text!r}: not HH:MM or an ISO date-time ({err})") from None


def status_report(specs: list, jobs: int, budget_core_hours: float | None = None,
                  spent: Callable[[str], float] | None = None) -> str:
    """The ``--status`` text: a table per dataset and model size (runs planned / complete / left,
    core-hours per run and left), the total and, with a budget, what of it is spent."""
    rows = sweep_status(specs)
    left = [r["core_h_left"] for r in rows if r["left"]]
    known = sum(x for x in left if x is not None)
    table = [{"dataset": r["dataset"], "model size": r["size"], "runs planned": r["planned"],
              "complete": r["complete"], "left": r["left"],
              "core-hours per run": _hours(r["core_h_per_run"]),
              "core-hours left": _hours(r["core_h_left"])} for r in rows]
    lines = [markdown_table(table, list(table[0])) if table else "no runs planned"]
    total = f"{sum(r['left'] for r in rows)} of {len(specs)} runs left, ≈ {known:.1f} core-hours"
    if None in left:
        total += " (and runs of sizes no finished run allows estimating)"
    lines.append(total + f": ≈ {known / max(jobs, 1):.1f} h of wall time at --jobs {jobs}")
    if budget_core_hours is not None and specs:
        used = (spent or claims_spent)(specs[0].results_dir)
        lines.append(f"budget: {used:.1f} of {budget_core_hours:g} core-hours spent")
    return "\n".join(lines)


def _hours(x: float | None) -> str:
    return "?" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or the claims addition), then write README.md and CLAIMS.md (and the bottom line of
    docs/comparison.md); returns the exit status (1: no complete run to report)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    command = f"{PROG} " + shlex.join(argv)
    out = args.out or str(RESULTS)
    common = dict(steps=args.steps, runs_dir=args.runs_dir, num_samples=args.num_samples,
                  extra_overrides=list(args.overrides))
    if sum((args.claims, args.repa, args.samples, args.meanflow)) > 1:
        parser().error("--claims, --repa, --samples and --meanflow are separate sweeps: run one, then the next")
    datasets = args.datasets or tuple(DATASETS)
    if args.meanflow:
        specs = plan_meanflow(datasets, out, **common)
        budget = dict(budget_core_hours=MEANFLOW_BUDGET_CORE_HOURS, spent=meanflow_spent)
    elif args.samples:
        specs = plan_samples(datasets, out, **common)
        budget = dict(budget_core_hours=SAMPLES_BUDGET_CORE_HOURS, spent=samples_spent)
    elif args.repa:
        specs = plan_repa(datasets, out, **common)
        budget = dict(budget_core_hours=REPA_BUDGET_CORE_HOURS, spent=spent)
    elif args.claims:
        specs = plan_claims(datasets, out, **common)
        budget = dict(budget_core_hours=BUDGET_CORE_HOURS)
    else:
        specs = plan(args.seeds, args.ablation_seeds, datasets, args.variants, results_dir=out, **common)
        budget = {}
    if args.variants:
        specs = [s for s in specs if s.variant in args.variants]
    if args.featnet_check:
        from study.featnet import featnet_check

        featnet_check(out, args.runs_dir)
        print(f"wrote {out}/featnet_check-*.json and .md")
        return 0
    if args.status:
        print(status_report(specs, args.jobs, **budget))
        return 0
    if not args.report_only:
        sweep(specs, args.jobs, **budget, fits=None if args.stop_by is None else ends_by(args.stop_by))
    pilot = write_pilot(out, datasets) if args.meanflow and not args.report_only else None
    if pilot:  # n is fixed now, before any test run: the next start plans the arms and the references
        print(f"the pilot is read: n per dataset in {pilot}; commit it, then rerun the same command")
    results = load_results(out)
    if not results:
        print(f"no complete runs under {out}/runs", file=sys.stderr)
        return 1
    (repa_rows, repa_lines), (sample_rows, sample_lines) = repa_report(results, out), samples_report(results, out)
    mf_rows, mf_lines = meanflow_report(results, out)
    claims_md = write_claims(results, out, command, extra=(repa_rows + sample_rows + mf_rows,
                                                           repa_lines + sample_lines + mf_lines))
    preface = bottom_line(results)
    page = REPO / COMPARISON_PAGE  # the manual quotes the committed study only, never a scratch --out
    committed = Path(out).resolve() == (REPO / RESULTS).resolve()
    also = f" and the bottom line of {COMPARISON_PAGE}" if committed and update_marked_block(page, preface) else ""
    print(f"wrote {write_report(results, out, command, preface)} and {claims_md}{also}")
    return 0


if __name__ == "__main__":
    # SIGTERM / Ctrl-C and a stopped run: one line, status 3 / 130; the checkpointed runs resume on rerun
    sys.exit(run_cli(PROG, main, resumable=True, statuses={RunStopped: EXIT_TERMINATED}))
