"""Command-line entry points (installed as console scripts; the repository's train.py / sample.py
call them).

``sit-vit5-train`` = ``python train.py`` (``sit_vit5.cli.train``), ``sit-vit5-sample`` = ``python
sample.py`` (``sit_vit5.cli.sample``), ``sit-vit5-fid`` = ``python -m fid``.
"""
