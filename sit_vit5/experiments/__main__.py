"""``python -m sit_vit5.experiments {digits,imagenet} ...`` (see ``--help`` of each)."""

from __future__ import annotations

import argparse
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m sit_vit5.experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("digits", help="the digits proxy: ViT-5 vs SiT curves + ablations (CPU; see "
                                      "results/digits/PROTOCOL.md)")
    d.add_argument("--seeds", type=int, default=3, help="seeds per main variant")
    d.add_argument("--ablation-seeds", type=int, default=2, help="seeds per ablation variant")
    d.add_argument("--steps", type=int, default=2000, help="training steps per run")
    d.add_argument("--num-samples", type=int, default=1000, help="samples scored per checkpoint")
    d.add_argument("--datasets", nargs="+", default=None, help="subset of: digits8 digits16")
    d.add_argument("--variants", nargs="+", default=None, help="subset of the variant names (default: all)")
    d.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes of one thread each)")
    d.add_argument("--runs-dir", default="runs/digits-proxy", help="run directories (checkpoints)")
    d.add_argument("--out", default=None, help="report and cached results (default: results/digits)")
    d.add_argument("--report-only", action="store_true", help="rewrite the report from the cached runs")
    d.add_argument("--claims", action="store_true",
                   help="run the claims addition of PROTOCOL.md (2026-12-01) in its order, within its core-hour "
                        "budget (use --jobs 1), instead of the original sweep")
    d.add_argument("overrides", nargs="*", metavar="section.key=value", help="extra config overrides for every run")

    i = sub.add_parser("imagenet", help="evaluate ImageNet runs under a protocol; table + FID-vs-step plot")
    from .imagenet import add_arguments

    add_arguments(i)
    args = parser.parse_args(argv)
    command = "python -m sit_vit5.experiments " + shlex.join(argv)

    if args.command == "digits":
        from .digits import DATASETS, RESULTS, load_results, plan, sweep, write_report

        out = args.out or str(RESULTS)
        common = dict(steps=args.steps, runs_dir=args.runs_dir, num_samples=args.num_samples,
                      extra_overrides=list(args.overrides))
        if args.claims and not args.report_only:
            from .digits_claims import BUDGET_CORE_HOURS, plan_claims

            specs = plan_claims(args.datasets or tuple(DATASETS), out, **common)
            if args.variants:
                specs = [s for s in specs if s.variant in args.variants]
            sweep(specs, args.jobs, budget_core_hours=BUDGET_CORE_HOURS)
        elif not args.report_only:
            specs = plan(args.seeds, args.ablation_seeds, args.datasets or tuple(DATASETS), args.variants,
                         results_dir=out, **common)
            sweep(specs, args.jobs)
        results = load_results(out)
        if not results:
            print(f"no complete runs under {out}/runs", file=sys.stderr)
            return 1
        from .digits_claims import write_claims

        print(f"wrote {write_report(results, out, command)} and {write_claims(results, out, command)}")
        return 0
    from .imagenet import run

    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
