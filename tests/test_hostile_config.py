"""Malformed YAML in a config file: a ConfigError naming the file, line and column (the entry points
print it on one line, exit 2), never a yaml ParserError traceback."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sit_vit5.config import ConfigError, load_config
from sit_vit5.utils.errors import SitVit5Error
from tests.helpers import assert_names

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text, where, problem",
    [
        (
            "train:\n  steps: [1, 2\nmodel:\n  depth: 3\n",
            "line 3, column 6",
            "expected ',' or ']'",
        ),  # parser
        (
            "train:\n  steps: 3\n   x: 4\n",
            "line 3, column 5",
            "mapping values",  # PyYAML's words
        ),  # scanner
        ("train:\n\tsteps: 3\n", "line 2, column 1", "'\\t'"),
    ],
)
def test_malformed_yaml_names_file_and_line(tmp_path, text, where, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}, {where}: ")
    assert_names(message, problem)
    assert "\n" not in message and isinstance(info.value, SitVit5Error)


def test_train_py_prints_one_line_for_malformed_yaml(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: [1, 2\n")
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and f"{path}, line 3" in lines[0], err
