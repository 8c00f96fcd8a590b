"""``python -m sit_vit5.experiments imagenet | nfe ...`` (see their ``--help``). The digits study
lives beside its results: ``python results/digits/study`` (results/digits/study/__main__.py)."""

from __future__ import annotations

import argparse
import shlex
import sys

from ..utils.errors import KNOWN_ERRORS, SettingError, one_line, run_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m sit_vit5.experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    i = sub.add_parser("imagenet",
                       help="evaluate ImageNet runs under a protocol; table + FID-vs-step plot")
    from .imagenet import add_arguments

    add_arguments(i)
    n = sub.add_parser("nfe", help="FID against NFE for every solver on digits checkpoints")
    from .nfe import add_arguments as add_nfe_arguments

    add_nfe_arguments(n)
    summary = sub.add_parser("nfe-summary", help="the few-step settings' FID ratio to the 250-NFE "
                             "SDE over training seeds, from an nfe study's row files")
    summary.add_argument("--out", default="results/nfe", help="the nfe study's folder")
    args = parser.parse_args(argv)
    if args.command == "nfe-summary":
        from .nfe import summarize

        return run_cli("python -m sit_vit5.experiments nfe-summary",
                       lambda: print(f"wrote {summarize(args.out)}") or 0)
    command = "python -m sit_vit5.experiments " + shlex.join(argv)
    if args.command == "nfe":
        from .nfe import run as run_nfe

        return run_cli("python -m sit_vit5.experiments nfe", lambda: run_nfe(args),
                       render=lambda e: e.as_flag() if isinstance(e, SettingError) else one_line(e))
    from .imagenet import run

    # sampling resumes per checkpoint (bulk parts): a rerun continues after Ctrl-C / SIGTERM
    return run_cli("python -m sit_vit5.experiments", lambda: run(args, command),
                   errors=(*KNOWN_ERRORS, ValueError), resumable=True)


if __name__ == "__main__":
    sys.exit(main())
