"""Experiments: the ViT-5 vs SiT comparison.

* ``python -m sit_vit5.experiments digits``: the small-scale reproduction on the embedded digits (CPU).
* ``python -m sit_vit5.experiments imagenet RUN_DIR ... --protocol configs/eval/scaling.yaml``: evaluate
  ImageNet runs (bulk sampling + FID suite), cache the results, write the comparison table and plot.
"""
