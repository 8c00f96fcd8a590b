"""Dependency floors: every requirement has a ``>=`` floor, docs/DEPENDENCIES.md's table states
the same floor with the API that sets it, environment-cpu.yml pins torch/torchvision alike, and
tools/check_floors.sh (large downloads) stays out of CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENT = re.compile(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)")


def _floors() -> dict[str, str]:
    """{name: floor} of ``dependencies`` and the dev extra, as tools/check_floors.sh reads them."""
    floors = {}
    for req in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]:
        match = REQUIREMENT.fullmatch(req.strip())
        assert match, f"{req!r}: tools/check_floors.sh needs the form name>=floor"
        floors[match[1].lower()] = match[2]
    return floors


def _table() -> dict[str, str]:
    """{name: floor} from docs/DEPENDENCIES.md's table (a row may name several libraries)."""
    rows = {}
    for line in (ROOT / "docs" / "DEPENDENCIES.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("library", "---"):
            continue
        names = [re.sub(r"\s*\(dev\)", "", n).strip().lower() for n in cells[0].split(",")]
        floors = [f.strip() for f in cells[1].split(",")]
        assert len(names) == len(floors), line
        assert cells[2], f"{line}: no API named"
        rows.update(zip(names, floors))
    return rows


def test_every_floor_is_in_the_table_with_the_same_version():
    floors, table = _floors(), _table()
    assert {"torch", "accelerate", "diffusers", "numpy"} <= set(floors)  # the parse found them
    assert floors == table


def test_environment_cpu_pins_torch_like_pyproject():
    floors = _floors()
    text = (ROOT / "environment-cpu.yml").read_text()
    pins = dict(re.findall(r"^\s*-\s*(torch|torchvision)>=([0-9.]+)\s*$", text, re.M))
    assert pins == {"torch": floors["torch"], "torchvision": floors["torchvision"]}


def test_check_floors_script_exists_and_is_not_part_of_ci():
    script = ROOT / "tools" / "check_floors.sh"
    assert script.is_file() and "pytest" in script.read_text()
    assert "check_floors" not in (ROOT / ".ci" / "run").read_text()
