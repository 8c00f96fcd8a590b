"""Experiments: the ViT-5 vs SiT comparison.

* ``python -m sit_vit5.experiments imagenet RUN_DIR ... --protocol configs/eval/scaling.yaml``: evaluate
  ImageNet runs (bulk sampling + FID suite), cache the results, write the comparison table and plot.
* ``report``: markdown / CSV tables and plots, shared with the digits study.

The small-scale reproduction on the embedded digits (CPU) is a finished study kept beside its results, not
in the package: ``python results/digits/study`` (see results/digits/study/__init__.py).
"""
