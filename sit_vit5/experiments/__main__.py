"""``python -m sit_vit5.experiments {digits,imagenet} ...`` (see ``--help`` of each)."""

from __future__ import annotations

import argparse
import shlex
import sys

from .digits import plan, sweep, write_report
from .imagenet import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m sit_vit5.experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("digits", help="small-scale ViT-5 vs SiT reproduction + ablation on 8x8 digits (CPU)")
    d.add_argument("--seeds", type=int, default=3, help="seeds per backbone")
    d.add_argument("--ablation-seeds", type=int, default=1, help="seeds per ablation variant")
    d.add_argument("--steps", type=int, default=2000, help="training steps per run")
    d.add_argument("--num-samples", type=int, default=1000, help="samples scored per run")
    d.add_argument("--no-ablations", action="store_true", help="only the two backbones")
    d.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    d.add_argument("--runs-dir", default="runs/digits-repro", help="run directories (checkpoints, cached results)")
    d.add_argument("--out", default="results/digits", help="where the table, CSV and plots go")
    d.add_argument("overrides", nargs="*", metavar="section.key=value", help="extra config overrides for every run")

    i = sub.add_parser("imagenet", help="evaluate ImageNet runs under a protocol; table + FID-vs-step plot")
    add_arguments(i)
    args = parser.parse_args(argv)
    command = "python -m sit_vit5.experiments " + shlex.join(argv)

    if args.command == "digits":
        specs = plan(args.seeds, args.ablation_seeds, args.steps, args.runs_dir, args.num_samples,
                     not args.no_ablations, args.overrides)
        results = sweep(specs, args.jobs)
        print(f"wrote {write_report(results, args.out, command)}")
        return 0
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
