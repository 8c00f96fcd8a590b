"""Generate images: ``python sample.py {grid,bulk} --ckpt CKPT ...`` (also SiT's ``sample.py ODE|SDE ...``).

The command lives in ``sit_vit5.cli.sample`` (installed as ``sit-vit5-sample``); see ``python sample.py
--help``.
"""

import sys

from sit_vit5.cli.sample import build_parser, main, resolve_spec, translate_mode_word

__all__ = ["build_parser", "main", "resolve_spec", "translate_mode_word"]

if __name__ == "__main__":
    sys.exit(main())
