"""Placement lint: every tensor constructor in the package (sit_vit5/, fid/) either names its device or says
why the CPU (the default device) is right, so a tensor made on the CPU inside a CUDA forward or sampler cannot
come in unnoticed.

A call ``torch.<ctor>(...)`` without ``device=`` must carry ``# on cpu: <reason>`` on one of its lines, or sit
in ``ALLOWED`` (files another owner edits) with the reason. Found with ``ast``, so strings, comments and
``x.new_zeros`` / ``torch.zeros_like`` (which follow their argument's device) are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sit_vit5", "fid")
CONSTRUCTORS = {"arange", "zeros", "ones", "empty", "full", "randn", "rand", "tensor", "linspace"}
MARKER = "# on cpu:"
#: (path, the call's source text) -> why the CPU is right; for files whose owner keeps markers out
ALLOWED: dict[tuple[str, str], str] = {
    ("sit_vit5/sampling/sampling_pipeline.py", "torch.empty(0)"):
        "a dtype probe for a model without parameters; never data",
    ("fid/digits.py", "torch.arange(len(labels))"):
        "the test/train split mask over the host-side digits data set",
}


def constructor_calls(path: Path) -> list[tuple[int, int, str]]:
    """(first line, last line, source) of each ``torch.<ctor>(...)`` call in ``path`` without ``device=``."""
    text = path.read_text()
    calls = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in CONSTRUCTORS and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch" and not any(k.arg == "device" for k in node.keywords)):
            calls.append((node.lineno, node.end_lineno, ast.get_source_segment(text, node)))
    return calls


def all_calls() -> dict[str, list[tuple[int, int, str]]]:
    files = sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 20, files  # the packages were found
    return {str(f.relative_to(ROOT)): constructor_calls(f) for f in files}


def test_every_device_less_constructor_is_marked():
    found = all_calls()
    total = sum(map(len, found.values()))
    assert total > 10, found  # the scan sees the calls that exist (21 when this test was written)
    unmarked = []
    for path, calls in found.items():
        lines = (ROOT / path).read_text().splitlines()
        for first, last, source in calls:
            marked = any(MARKER in line for line in lines[first - 1 : last])
            if not marked and (path, source) not in ALLOWED:
                unmarked.append(f"{path}:{first}: {source}")
    assert not unmarked, ("tensor constructors without device= and without '# on cpu: <why>':\n"
                          + "\n".join(unmarked))


def test_allowlist_entries_still_exist():
    found = all_calls()
    for path, source in ALLOWED:
        assert source in [call[2] for call in found.get(path, [])], (path, source)


def test_the_scan_flags_an_unmarked_call_and_accepts_marked_and_placed_ones(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n"
                     "a = torch.zeros(3)\n"
                     "b = torch.ones(2, device=x.device)\n"
                     "c = torch.arange(\n    4,\n)  # on cpu: a host index\n"
                     "d = x.new_zeros(3)\n"
                     "e = '''torch.randn(3)'''\n")
    calls = constructor_calls(probe)
    assert [(c[0], c[2]) for c in calls] == [(2, "torch.zeros(3)"), (4, "torch.arange(\n    4,\n)")]
    lines = probe.read_text().splitlines()
    assert [any(MARKER in line for line in lines[c[0] - 1 : c[1]]) for c in calls] == [False, True]
