"""Train a SiT / ViT-5 diffusion model: ``python train.py [--config FILE] [--resume ...] [section.key=value ...]``.

The command lives in ``sit_vit5.cli.train`` (installed as ``sit-vit5-train``); see ``python train.py --help``.
"""

import sys

from sit_vit5.cli.train import default_config, main

__all__ = ["default_config", "main"]

if __name__ == "__main__":
    sys.exit(main())
