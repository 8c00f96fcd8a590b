"""Safe file helpers shared by checkpoints, latent caches and sample shards: SHA-256 and atomic writes."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")
TMP_PREFIX = ".tmp-"  # temporary files start with this; a killed writer's leftovers are recognisable


class ChecksumError(ValueError):
    """A file whose SHA-256 differs from the one recorded for it."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise ChecksumError naming the file when its SHA-256 differs from ``expected``."""
    actual = sha256_file(path)
    if actual.lower() != expected.lower():
        raise ChecksumError(f"{path}: SHA-256 mismatch (expected {expected}, got {actual}); refusing to load it")


def sidecar(path: str | os.PathLike) -> Path:
    """The ``<file>.sha256`` checksum file (``sha256sum`` format) written next to ``path``."""
    return Path(str(path) + ".sha256")


def verify_sidecar(path: str | os.PathLike) -> bool:
    """Check ``path`` against its ``.sha256`` sidecar when one exists; returns whether one was checked."""
    side = sidecar(path)
    if not side.is_file():
        return False
    verify_sha256(path, side.read_text().split()[0])
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], T]) -> T:
    """Call ``write(file)`` on a temporary file next to ``path``, fsync, rename over ``path``; returns its result.

    A crash at any point leaves either the old file or the new one, never a half-written file; on an error
    the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return result


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(text.encode()))


class _HashingWriter:
    """File-like object that hashes the bytes on their way to ``file`` (one pass instead of a re-read)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def atomic_torch_save(obj: Any, path: str | os.PathLike, checksum: bool = True) -> str:
    """``torch.save(obj)`` to ``path`` atomically; returns the SHA-256 of the bytes and, with ``checksum``,
    writes the ``.sha256`` sidecar (after the data file, so a sidecar never names a missing file)."""
    import torch

    def write(f: IO[bytes]) -> str:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        return writer.sha256.hexdigest()

    digest = atomic_write(path, write)
    if checksum:
        atomic_write_text(sidecar(path), f"{digest}  {Path(path).name}\n")
    return digest
