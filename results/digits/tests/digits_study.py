"""The digits study for its tests (this folder, results/digits/tests): the study lives beside its results in
results/digits/study, outside the installed package, so its folder's parent goes on ``sys.path`` and it
imports as the package ``study``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

STUDY = Path(__file__).resolve().parents[1] / "study"
assert (STUDY / "__main__.py").is_file(), STUDY  # fail loudly if the study moves again
if str(STUDY.parent) not in sys.path:
    sys.path.insert(0, str(STUDY.parent))

digits = importlib.import_module("study.digits")
claims = importlib.import_module("study.claims")
repa = importlib.import_module("study.repa")
featnet = importlib.import_module("study.featnet")
stats = importlib.import_module("study.stats")
cli = importlib.import_module("study.__main__")
samples = importlib.import_module("study.samples")
meanflow = importlib.import_module("study.meanflow")
