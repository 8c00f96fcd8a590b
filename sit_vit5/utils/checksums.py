"""SHA-256 digests of files (``sha256_file``, ``.sha256`` sidecars) and of a checkpoint's content,
independent of its pickle (``payload_sha256``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .errors import SitVit5Error


class ChecksumError(SitVit5Error, ValueError):
    """A file whose SHA-256 differs from the one recorded for it."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_tree(folder: str | os.PathLike) -> str:
    """Hex SHA-256 of a folder's files: of its ``sha256sum`` listing (``<digest>  <relative
    path>`` per file, sorted by path, ``/`` separators), so renaming, changing, adding or removing
    any file changes it."""
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    listing = "".join(f"{sha256_file(p)}  {p.relative_to(root).as_posix()}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def checkpoint_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 a run records for the checkpoint it loaded: a folder's :func:`sha256_tree`; a
    file's ``.sha256`` sidecar when it has one (loading checks the file against it, so reading the
    file again would only repeat that), else the file's own digest."""
    if os.path.isdir(path):
        return sha256_tree(path)
    return (sidecar_sha256(path) or sha256_file(path)).lower()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise ChecksumError naming the file when its SHA-256 differs from ``expected``."""
    actual = sha256_file(path)
    if actual.lower() != expected.lower():
        raise ChecksumError(f"{path}: SHA-256 mismatch (expected {expected}, got {actual}); "
                            "refusing to load it")


def sidecar(path: str | os.PathLike) -> Path:
    """The ``<file>.sha256`` checksum file (``sha256sum`` format) written next to ``path``."""
    return Path(str(path) + ".sha256")


def sidecar_sha256(path: str | os.PathLike) -> str | None:
    """The digest ``path``'s ``.sha256`` sidecar records ("" for an empty one), None without one."""
    side = sidecar(path)
    return (side.read_text().split() or [""])[0] if side.is_file() else None


def verify_sidecar(path: str | os.PathLike) -> bool:
    """Check ``path`` against its ``.sha256`` sidecar if any; returns whether one was checked."""
    recorded = sidecar_sha256(path)
    if recorded is None:
        return False
    verify_sha256(path, recorded)
    return True


# ----------------------------------------------------------------------------- payload digests

#: Key under which a checkpoint stores the SHA-256 of everything else it holds.
PAYLOAD_DIGEST_KEY = "payload_sha256"


def _feed(digest: Any, obj: Any) -> None:
    """Hash ``obj`` canonically: type tags, lengths and shapes frame every value; tensors give
    dtype, shape and raw bytes."""
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
    """Hex SHA-256 of a checkpoint dict's content (all keys but ``PAYLOAD_DIGEST_KEY``), stable
    across a save/load round trip."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != PAYLOAD_DIGEST_KEY})
    return digest.hexdigest()


def verify_payload_digest(state: dict[str, Any], name: str | os.PathLike) -> bool:
    """Check a loaded checkpoint dict against its stored digest (ChecksumError naming ``name``);
    returns False when it stores none."""
    expected = state.get(PAYLOAD_DIGEST_KEY) if isinstance(state, dict) else None
    if expected is None:
        return False
    actual = payload_sha256(state)
    if not isinstance(expected, str) or actual != expected.lower():
        raise ChecksumError(f"{name}: the content does not match the SHA-256 stored inside the "
                            f"file (stored {expected}, computed {actual}); refusing to use it")
    return True
