"""``python results/digits/study ...``: the digits proxy, ViT-5 vs SiT curves + ablations (CPU;
see results/digits/PROTOCOL.md); ``--claims``: the claims addition; ``--repa``: the REPA addition.
Run from the repository root: the cached runs are read from and written to ``--out`` (default
``results/digits``), checkpoints to ``--runs-dir``."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

if not __package__:  # run as a folder: import it as the package ``study``, not file by file
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    sys.path.insert(0, str(_HERE.parent))

from study.claims import BUDGET_CORE_HOURS, plan_claims, write_claims  # noqa: E402
from study.digits import DATASETS, RESULTS, load_results, plan, sweep, write_report  # noqa: E402
from study.repa import REPA_BUDGET_CORE_HOURS, plan_repa, repa_report, spent  # noqa: E402

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
    d.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="extra config overrides for every run")
    return d


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or the claims addition), then write README.md and CLAIMS.md; returns the exit
    status (1: no complete run to report)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    command = f"{PROG} " + shlex.join(argv)
    out = args.out or str(RESULTS)
    common = dict(steps=args.steps, runs_dir=args.runs_dir, num_samples=args.num_samples,
                  extra_overrides=list(args.overrides))
    if args.claims and args.repa:
        parser().error("--claims and --repa are two sweeps: run one, then the other")
    if args.repa and not args.report_only:
        specs = plan_repa(args.datasets or tuple(DATASETS), out, **common)
        if args.variants:
            specs = [s for s in specs if s.variant in args.variants]
        sweep(specs, args.jobs, budget_core_hours=REPA_BUDGET_CORE_HOURS, spent=spent)
    elif args.claims and not args.report_only:
        specs = plan_claims(args.datasets or tuple(DATASETS), out, **common)
        if args.variants:
            specs = [s for s in specs if s.variant in args.variants]
        sweep(specs, args.jobs, budget_core_hours=BUDGET_CORE_HOURS)
    elif not args.report_only:
        specs = plan(args.seeds, args.ablation_seeds, args.datasets or tuple(DATASETS),
                     args.variants, results_dir=out, **common)
        sweep(specs, args.jobs)
    results = load_results(out)
    if not results:
        print(f"no complete runs under {out}/runs", file=sys.stderr)
        return 1
    claims_md = write_claims(results, out, command, extra=repa_report(results, out))
    print(f"wrote {write_report(results, out, command)} and {claims_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
