"""Experiments: the ViT-5 vs SiT comparison.

* ``python -m sit_vit5.experiments imagenet RUN_DIR ... --protocol configs/eval/scaling.yaml``:
  evaluate ImageNet runs (bulk sampling + FID suite), cache them, write the table and plot.
* ``report``: markdown / CSV tables and plots, shared with the digits study.

The small-scale digits reproduction (CPU) is a finished study kept beside its results:
``python results/digits/study`` (see results/digits/study/__init__.py).
"""
