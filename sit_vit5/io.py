"""Safe file helpers shared by checkpoints, latent caches and sample shards: SHA-256 and atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from .errors import SitVit5Error

T = TypeVar("T")
TMP_PREFIX = ".tmp-"  # temporary files start with this; a killed writer's leftovers are recognisable


class ChecksumError(SitVit5Error, ValueError):
    """A file whose SHA-256 differs from the one recorded for it."""


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


def unwritable_dir_reason(path: str | os.PathLike) -> str | None:
    """Why a directory could not be created or written at ``path`` (None when it can), leaving nothing
    behind: the nearest existing ancestor must be a directory in which a folder can be made (tried
    with a temporary one, removed at once: ``os.access`` says yes to root on /proc or a read-only
    mount)."""
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


# ----------------------------------------------------------------------------- self-verifying payloads

#: Key under which a checkpoint stores the SHA-256 of everything else it holds (see ``payload_sha256``).
PAYLOAD_DIGEST_KEY = "payload_sha256"


def _feed(digest: Any, obj: Any) -> None:
    """Hash ``obj`` canonically: type tags, lengths and shapes frame every value, so that no two different
    structures share a byte stream; tensors contribute dtype, shape and raw bytes (not their pickle)."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        digest.update(f"D{len(obj)};".encode())
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)};".encode())
        for value in obj:
            _feed(digest, value)
    elif isinstance(obj, str):
        data = obj.encode()
        digest.update(f"S{len(data)};".encode() + data)
    elif obj is None or isinstance(obj, (bool, int, float)):
        digest.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:  # anything else a weights-only pickle can hold (e.g. an argparse.Namespace): its repr
        text = repr(obj).encode()
        digest.update(f"O{type(obj).__name__}{len(text)};".encode() + text)


def json_safe(obj: Any) -> Any:
    """``obj`` as JSON would store it (tuples -> lists, other types -> their ``str``)."""
    return json.loads(json.dumps(obj, default=str))


def payload_sha256(state: dict[str, Any]) -> str:
    """Hex SHA-256 of a checkpoint dict's content (every key but ``PAYLOAD_DIGEST_KEY``), independent of
    how it was pickled: the same tensors and values give the same digest after a save/load round trip."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != PAYLOAD_DIGEST_KEY})
    return digest.hexdigest()


def verify_payload_digest(state: dict[str, Any], name: str | os.PathLike) -> bool:
    """Check a loaded checkpoint dict against the digest stored inside it (raises ChecksumError naming
    ``name`` on a mismatch); returns False when it stores none (older files, foreign checkpoints)."""
    expected = state.get(PAYLOAD_DIGEST_KEY) if isinstance(state, dict) else None
    if expected is None:
        return False
    actual = payload_sha256(state)
    if not isinstance(expected, str) or actual != expected.lower():
        raise ChecksumError(f"{name}: the content does not match the SHA-256 stored inside the file "
                            f"(stored {expected}, computed {actual}); refusing to use it")
    return True
