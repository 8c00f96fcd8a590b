"""A local folder laid out as the Hugging Face hub cache, so hub look-ups run offline in tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache: Path, repo: str, filename: str, content: bytes, kind: str = "models") -> Path:
    """Store ``content`` as ``repo``'s ``filename`` at revision main: ``blobs/<sha256>`` (the hub
    names an LFS blob by its SHA-256), ``refs/main`` -> COMMIT, ``snapshots/COMMIT/filename`` -> the
    blob."""
    repo_dir = Path(cache) / f"{kind}--{repo.replace('/', '--')}"
    sha = hashlib.sha256(content).hexdigest()
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs" / sha).write_bytes(content)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    link = repo_dir / "snapshots" / COMMIT / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path("../" * (len(Path(filename).parts) + 1)) / "blobs" / sha)
    return link


def add_folder_to_hub_cache(cache: Path, repo: str, folder: Path) -> None:
    """Every file under ``folder`` (e.g. a ``save_pretrained`` output) as ``repo``'s files."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            add_to_hub_cache(cache, repo, path.relative_to(folder).as_posix(), path.read_bytes())
