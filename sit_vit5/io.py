"""Safe file helpers: SHA-256 checksums and atomic writes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise ValueError naming the file when its SHA-256 differs from ``expected``."""
    actual = sha256_file(path)
    if actual.lower() != expected.lower():
        raise ValueError(f"{path}: SHA-256 mismatch (expected {expected}, got {actual}); refusing to load it")


def sidecar(path: str | os.PathLike) -> Path:
    """The ``<file>.sha256`` checksum file written next to ``path``."""
    return Path(str(path) + ".sha256")


def verify_sidecar(path: str | os.PathLike) -> bool:
    """Check ``path`` against its ``.sha256`` sidecar when one exists; returns whether one was checked."""
    side = sidecar(path)
    if not side.exists():
        return False
    verify_sha256(path, side.read_text().split()[0])
    return True


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], checksum: bool = True) -> Path:
    """Write via ``write(tmp_path)`` into a temporary file in the same folder, fsync, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never a half-written file. With
    ``checksum`` a ``.sha256`` sidecar is written (atomically too) before the data file is renamed into place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if checksum:
            side_tmp = tmp + ".sha256"
            Path(side_tmp).write_text(f"{sha256_file(tmp)}  {path.name}\n")
            os.replace(side_tmp, sidecar(path))
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, tmp + ".sha256"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path
