"""SiT/DiT's ``sample_ddp.py``: ``python sample_ddp.py [ODE|SDE] --ckpt CKPT --num-fid-samples N ...``
is ``sample.py bulk`` (sharded under ``torchrun``, resumable); see ``python sample.py bulk --help``.
"""

import sys

from sit_vit5.cli.sample import MODE_WORDS
from sit_vit5.cli.sample import main as sample_main


def main(argv: list[str] | None = None) -> int:
    """``sample.py bulk`` with ``argv`` (SiT's mode word first is kept in front)."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = [args.pop(0)] if args[:1] and args[0] in MODE_WORDS else []
    return sample_main([*mode, "bulk", *args])


if __name__ == "__main__":
    sys.exit(main())
