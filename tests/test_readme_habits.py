"""Every SiT/DiT command line quoted in the manual's habits section (docs/sampling.md) parses as typed,
into the settings it promises (train.py: the config keys; sample.py / sample_ddp.py: the command and flags);
and the README stays an entry: at most 200 lines, every manual page it links there."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sit_vit5.cli import sample as cli_sample
from sit_vit5.cli import train as cli_train
from sit_vit5.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def habit_lines() -> list[list[str]]:
    page = (ROOT / "docs" / "sampling.md").read_text()
    section = page[page.index("## SiT and DiT habits"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the habits section has no bash block"
    lines = [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) >= 6
    return lines


def script_args(words: list[str]) -> tuple[str, list[str]]:
    """(script, its arguments) of ``python X.py ...`` / ``torchrun [opts] X.py ...``."""
    i = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[i], words[i + 1 :]


@pytest.mark.parametrize("words", habit_lines(), ids=lambda w: " ".join(w[:4]))
def test_each_habit_line_parses_as_typed(words):
    script, argv = script_args(words)
    if script == "train.py":
        args = cli_train.parser().parse_args(argv)
        cfg = load_config(args.config, cli_train.habit_overrides(args) + args.overrides)
        model = argv[argv.index("--model") + 1]
        assert cfg["model"]["name"] == model and cfg["data"]["root"] == argv[argv.index("--data-path") + 1]
        assert cfg["data"]["kind"] == "imagefolder" and cfg["vae"]["name"].startswith("stabilityai/")
        assert cfg["transport"]["objective"] == ("ddpm" if model.startswith("DiT") else "sit")
        return
    if script == "sample_ddp.py":
        mode = [argv.pop(0)] if argv[:1] and argv[0] in cli_sample.MODE_WORDS else []
        argv = [*mode, "bulk", *argv]
    else:
        assert script == "sample.py"
    translated = cli_sample.translate_mode_word(argv)
    args = cli_sample.build_parser().parse_args(translated)
    assert args.command == ("bulk" if "--num-fid-samples" in argv else "grid")
    if "--ckpt" not in argv:  # DiT's sample.py: the official file of --model at --image-size
        assert cli_sample.default_checkpoint(args.model, args.image_size) in {"DiT-XL-2-256x256.pt"}
    if "--last-step" in argv:
        assert cli_sample.resolve_spec(args, {}).last_step is None


def test_the_readme_is_an_entry_of_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert 0 < len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail to a page under docs/"


#: the line each page of the manual opens with
MANUAL_PAGE = "Part of the manual; the entry point is the [README](../README.md)."


def test_every_manual_page_the_readme_links_exists_and_every_page_is_linked():
    links = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10, links  # the manual: one page per topic, linked from the README
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing, f"README.md links pages that do not exist: {missing}"
    manual = [path for path in sorted((ROOT / "docs").glob("*.md")) if MANUAL_PAGE in path.read_text()]
    assert len(manual) >= 10, manual
    unlinked = [path.name for path in manual if f"docs/{path.name}" not in links]
    assert not unlinked, f"manual pages the README does not link: {unlinked}"
