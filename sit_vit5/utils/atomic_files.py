"""Atomic file writes (a file is replaced whole or not at all), and checks that an output
folder can be written."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from .checksums import sidecar
from .errors import SitVit5Error

T = TypeVar("T")
TMP_PREFIX = ".tmp-"  # temporary files start with this (a killed writer's leftovers)


class OutputPathError(SitVit5Error, NotADirectoryError):
    """An output folder that is a file, or lies under one."""


def output_dir(path: str | os.PathLike) -> Path:
    """``path`` as a folder, created if needed; OutputPathError naming the file in the way."""
    out = Path(path)
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise OutputPathError(f"{out}: cannot be the output folder: {blocking} is a file")
    out.mkdir(parents=True, exist_ok=True)
    return out


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
    """Call ``write(file)`` on a temporary file next to ``path``, fsync, rename over ``path``;
    returns its result. A crash leaves the old or the new file; an error removes the temporary
    (an OSError that names no file, such as a full disk's, is raised again naming ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.filename is not None:
            raise
        # a write through the file object (a full disk) names no file: name the one being written
        raise OSError(err.errno, err.strerror or str(err), os.fspath(path)) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return result


def unwritable_dir_reason(path: str | os.PathLike) -> str | None:
    """Why a directory could not be created or written at ``path`` (None when it can), tried with
    a temporary folder (``os.access`` says yes to root on read-only mounts); leaves nothing."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing folder above {path}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=probe))
    except OSError as err:
        return f"cannot create a folder in {probe}: {err.strerror or err}"
    return None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(text.encode()))


class _HashingWriter:
    """File-like object that hashes the bytes on their way to ``file`` (no re-read)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def atomic_torch_save(obj: Any, path: str | os.PathLike, checksum: bool = True) -> str:
    """``torch.save(obj)`` to ``path`` atomically; returns the bytes' SHA-256 and, with
    ``checksum``, writes the ``.sha256`` sidecar after the data file."""
    import torch

    def write(f: IO[bytes]) -> str:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        return writer.sha256.hexdigest()

    digest = atomic_write(path, write)
    if checksum:
        atomic_write_text(sidecar(path), f"{digest}  {Path(path).name}\n")
    return digest
