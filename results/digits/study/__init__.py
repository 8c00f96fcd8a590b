"""The digits study: ViT-5 vs SiT on scikit-learn's digits (CPU), kept beside its results.

Run from the repository root: ``python results/digits/study [--claims | --repa] [--report-only]
...`` (see ``--help``). Not part of the installed ``sit_vit5`` package: a finished study that uses
the library.

* ``digits``: the variants, one resumable cached run each
  (``runs/<dataset>/<variant>-seed<k>.json``), the sweep and the original report (``README.md``,
  protocol of 2026-11-30);
* ``claims``: the claims addition (``CLAIMS.md``, protocol of 2026-12-01): plan, Holm family,
  verdicts;
* ``repa``: the REPA addition (rows C8a / C8b of ``CLAIMS.md``, protocol of 2026-12-02): plan, its
  own Holm family, verdicts;
* ``meanflow``: the MeanFlow addition (row C10 of ``CLAIMS.md``, protocol of 2026-12-06): the pilot and its
  n, families M and N, the gap to the retrained flow references;
* ``stats``: Welch's t for two groups or a contrast, and Holm's correction.
"""
