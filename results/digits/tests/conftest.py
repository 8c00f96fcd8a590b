"""The digits study's tests run under the repository's test fixtures (tests/conftest.py: one torch
thread, the sample-output log). This folder has no ``__init__.py``: its modules import by their own
names (``digits_study``, ``test_digits_*``), which no module under tests/ shares."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # ``pytest results/digits/tests`` alone: the repository's tests package
    sys.path.insert(0, str(REPO))

from tests.conftest import one_thread, record_sample_outputs  # noqa: E402, F401
