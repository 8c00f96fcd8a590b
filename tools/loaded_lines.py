"""Lines of this project's code that one command loads: the project's files in ``sys.modules`` at exit.

    OMP_NUM_THREADS=2 python tools/loaded_lines.py train.py train.steps=2 train.out_dir=/tmp/demo
    OMP_NUM_THREADS=2 python tools/loaded_lines.py sample.py grid --ckpt /tmp/demo --out /tmp/grid.png
    python tools/loaded_lines.py --files train.py ...    # also one line per file: lines, path

The script runs in this process (``runpy``, as ``__main__``), so its imports are the ones counted. A file
counts once, with all its lines (blank lines and comments included), whatever part of it ran. The count
is printed last, as ``loaded: N files, M lines`` on standard error, after the command's own output.
"""

from __future__ import annotations

import atexit
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_files() -> dict[Path, int]:
    """The project's source files imported so far (under the checkout, outside tests/ and the virtualenv)
    -> their line counts."""
    files: dict[Path, int] = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not name.endswith(".py"):
            continue
        path = Path(name)
        if not path.is_absolute() or not path.is_file():  # a frozen or generated module
            continue
        path = path.resolve()
        try:
            rel = path.relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts[0] in {".venv", "tests", "tools"} or rel.parts[0].startswith("."):
            continue
        files[rel] = len(path.read_text(encoding="utf-8").splitlines())
    return files


def report(show_files: bool) -> None:
    files = project_files()
    if show_files:
        for rel, n in sorted(files.items()):
            print(f"{n:6d}  {rel}", file=sys.stderr)
    print(f"loaded: {len(files)} files, {sum(files.values())} lines", file=sys.stderr)


def main(argv: list[str]) -> None:
    show_files = "--files" in argv[:1]
    argv = argv[1:] if show_files else argv
    if not argv:
        sys.exit("usage: python tools/loaded_lines.py [--files] SCRIPT [ARGS ...]")
    script = (Path.cwd() / argv[0]).resolve()
    atexit.register(report, show_files)  # runs after the script, also when it calls sys.exit
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
