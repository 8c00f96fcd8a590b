"""The files of a run's ``checkpoints/`` folder, read without torch: names, the latest pointer,
and whether a checkpoint is complete (so ``--resume`` reports a truncated file at once)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from .checksums import sidecar
from .errors import SettingError

CKPT_DIR = "checkpoints"
LATEST = "latest.json"
CKPT_NAME = re.compile(r"^(\d+)(-milestone)?\.pt$")
ZIP_LOCAL_HEADER = b"PK\x03\x04"  # torch.save files are zip archives (since torch 1.6)
ZIP_END_RECORD = b"PK\x05\x06"  # end of central directory: within the last 22 + 65535 bytes
_ZIP_TAIL = 22 + 65535
#: in a run directory: flock-ed by the living run's rank 0, and holding its pid
RUN_LOCK = ".train.lock"
#: flock errors of a filesystem without locks (some network mounts): the run goes on unlocked
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def checkpoint_name(step: int, milestone: bool) -> str:
    """``0005000.pt`` or ``0100000-milestone.pt``."""
    return f"{step:07d}{'-milestone' if milestone else ''}.pt"


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path, bool]]:
    """Complete checkpoints (those with a sidecar) as (step, path, is_milestone), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in ckpt_dir.iterdir():
        match = CKPT_NAME.match(path.name)
        if match and sidecar(path).is_file():
            found.append((int(match[1]), path, bool(match[2])))
    return sorted(found, key=lambda item: (item[0], item[2]))


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The file ``latest.json`` names, else the newest complete checkpoint, else None."""
    ckpt_dir = Path(ckpt_dir)
    try:
        target = ckpt_dir / json.loads((ckpt_dir / LATEST).read_text())["file"]
        if target.is_file():
            return target
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def resume_target(spec: str, out_dir: str | os.PathLike) -> Path:
    """What ``--resume spec`` points at: ``out_dir`` for ``latest``, else the path given."""
    return Path(out_dir) if spec == "latest" else Path(spec)


def checkpoints_of(run_or_ckpt_dir: Path) -> Path:
    """The checkpoint folder of a run directory (its ``checkpoints/``), or the folder itself."""
    return run_or_ckpt_dir / CKPT_DIR if (run_or_ckpt_dir / CKPT_DIR).is_dir() else run_or_ckpt_dir


def resume_file(spec: str, out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``--resume spec`` names (``latest`` or a run directory: the newest; a file:
    itself), or None (the trainer's ``resolve_resume`` then says why)."""
    target = resume_target(spec, out_dir)
    if target.is_file():
        return target
    return latest_checkpoint(checkpoints_of(target)) if target.is_dir() else None


def truncation(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a whole ``torch.save`` file (a zip without its end record: cut
    short), from its first and last bytes; None when it may be one or is another format."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(ZIP_LOCAL_HEADER))
        if size == 0:
            return "0 bytes"
        if head != ZIP_LOCAL_HEADER:
            return None
        f.seek(max(0, size - _ZIP_TAIL))
        tail = f.read()
    if ZIP_END_RECORD not in tail:
        return f"{size:,} bytes, and the zip archive torch.save writes has no end record"
    return None


def previous_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``path``'s folder older than ``path``, or None."""
    path = Path(path)
    match = CKPT_NAME.match(path.name)
    step = int(match[1]) if match else None
    older = [p for s, p, _ in list_checkpoints(path.parent)
             if p != path and (step is None or s < step) and truncation(p) is None]
    return older[-1] if older else None


@contextmanager
def hold_run_dir(out_dir: str | os.PathLike, main: bool = True) -> Iterator[Path | None]:
    """Hold the run directory ``out_dir`` while the body runs: rank 0 (``main``) creates it and
    takes an exclusive ``fcntl.flock`` on ``out_dir/.train.lock``, writing its pid there; the
    kernel drops the lock when the process dies, so a crashed run never leaves a stale one (the
    file stays). A folder another living run holds is a SettingError naming it and the holder's
    pid. Other ranks (``main=False``) take nothing and never wait. When the body raises, the
    folders this call created are removed again if they hold only the lock file. Yields the lock
    file (None: not main, or the filesystem has no locks)."""
    if not main:
        yield None
        return
    run_dir = Path(out_dir)
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # deepest first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise SettingError("train.out_dir", os.fspath(out_dir),
                               f" is in use by another training run (pid {holder}); wait for it "
                               "to end, or choose another train.out_dir") from None
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                raise
            warnings.warn(f"{path}: this filesystem has no file locks ({err.strerror}); nothing "
                          "stops a second run from writing into the same folder", stacklevel=3)
            path = None
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        done = False
        try:
            yield path
            done = True
        finally:
            if not done and created and [p.name for p in run_dir.iterdir()] == [RUN_LOCK]:
                (run_dir / RUN_LOCK).unlink()
                for folder in created:  # a refused run leaves no empty run folder behind
                    folder.rmdir()
    finally:
        # forked DataLoader workers share this lock until they exit: unlock it for all of them
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
