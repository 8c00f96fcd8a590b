"""Official SiT / DiT weights by name: ``--ckpt SiT-XL-2-256.pt`` resolves to a verified local file.

One table, ``OFFICIAL_WEIGHTS``: name -> where the file lives (a Hugging Face repo, or DiT's own
file host), its SHA-256 when pinned, its licence and how its outputs are to be read.
``resolve_checkpoint`` turns a ``--ckpt`` value into a path: an existing local path is returned as
is; a table name is found in (or downloaded to) the Hugging Face cache with ``hf_hub_download`` (so
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` apply), or in torch's hub cache for DiT's files, and its
SHA-256 is checked before anything reads it.

Checks, in order: a pinned ``sha256`` in the table; else, for hub files, the hub's own record (the
cache stores a Git-LFS file under its SHA-256, so the content must hash to its blob name); else, for
DiT's files, the ``<file>.sha256`` sidecar written when the file was first downloaded (trust on
first use). No digest is pinned yet: none of these files could be downloaded where this table was
written.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..utils import hub_access
from ..utils.checksums import ChecksumError, sha256_file, sidecar, verify_sha256, verify_sidecar
from .checkpoint_files import CheckpointError

# announced in willisma/SiT issue #42 (SiT's old Dropbox link is dead)
SIT_REPO = "nyu-visionx/SiT-collections"
# DiT's download.py host (not the hub: facebook/DiT-XL-2-256 there is diffusers' converted format)
DIT_URL = "https://dl.fbaipublicfiles.com/DiT/models/{filename}"
SIT_LICENCE = "MIT (willisma/SiT licence; check the hub repo's card)"
DIT_LICENCE = "CC-BY-NC 4.0 (facebookresearch/DiT: code and weights; non-commercial use only)"


@dataclass(frozen=True)
class OfficialWeights:
    """One released file. ``repo`` set: a Hugging Face repo; else ``url`` (a plain file host).

    ``model``/``image_size``: the architecture to build and the pixel side it was trained at.
    ``objective``: ``sit`` (Linear path, velocity, t in [0, 1]) or ``ddpm`` (DiT's epsilon DDPM,
    integer timesteps) -- DiT files share SiT's keys, so this must be told, never guessed.
    ``sha256``: the pinned digest, None where it is not yet known.
    """

    filename: str
    model: str
    image_size: int
    licence: str
    objective: str = "sit"
    repo: str | None = None
    url: str | None = None
    sha256: str | None = None

    @property
    def source(self) -> str:
        """Where the file comes from, for messages: ``repo/file`` or the URL."""
        return f"{self.repo}/{self.filename}" if self.repo else str(self.url)

    def download_command(self, target_dir: str | os.PathLike | None = None) -> str:
        """The shell command that puts the file where ``resolve_checkpoint`` looks for it."""
        if self.repo:
            return f"hf download {self.repo} {self.filename}"
        return f"wget -P {target_dir or _url_cache_dir()} {self.url}"


def _sit(filename: str, model: str, image_size: int) -> OfficialWeights:
    return OfficialWeights(filename, model, image_size, SIT_LICENCE, "sit", repo=SIT_REPO)


def _dit(filename: str, image_size: int) -> OfficialWeights:
    url = DIT_URL.format(filename=filename)
    return OfficialWeights(filename, "SiT-XL/2", image_size, DIT_LICENCE, "ddpm", url=url)


#: name -> file. XL/2-256, S/2 and B/2 file names are seen in public download scripts; L/2 and
#: XL/2-512 follow the repo's naming pattern (unverified here: a wrong name fails with the hub's
#: 404).
OFFICIAL_WEIGHTS: dict[str, OfficialWeights] = {
    "SiT-XL-2-256.pt": _sit("SiT-XL-2-256.pt", "SiT-XL/2", 256),
    "SiT-XL-2-512.pt": _sit("SiT-XL-2-512.pt", "SiT-XL/2", 512),
    "SiT-L-2-256.pt": _sit("SiT-L-2-256.pt", "SiT-L/2", 256),
    "SiT-B-2-256.pt": _sit("SiT-B-2-256.pt", "SiT-B/2", 256),
    "SiT-S-2-256.pt": _sit("SiT-S-2-256.pt", "SiT-S/2", 256),
    "DiT-XL-2-256x256.pt": _dit("DiT-XL-2-256x256.pt", 256),
    "DiT-XL-2-512x512.pt": _dit("DiT-XL-2-512x512.pt", 512),
}
#: Other spellings users type (SiT's old download.py saved the XL file as SiT-XL-2-256x256.pt).
ALIASES = {"SiT-XL-2-256x256.pt": "SiT-XL-2-256.pt", "SiT-XL-2-512x512.pt": "SiT-XL-2-512.pt"}

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class WeightsUnavailableError(CheckpointError):
    """An official file that is neither cached nor downloadable now (offline, or the host
    failed)."""


def official_weights(name: str) -> OfficialWeights | None:
    """The table entry for ``name`` (or one of its aliases), None when it is not an official
    name."""
    return OFFICIAL_WEIGHTS.get(ALIASES.get(name, name))


def _url_cache_dir() -> Path:
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints"  # $TORCH_HOME/hub/checkpoints


def _verify(path: Path, entry: OfficialWeights, name: str) -> str:
    """Check ``path`` against the best digest available; returns how it was checked (for the log
    line)."""
    try:
        if entry.sha256:
            verify_sha256(path, entry.sha256)
            return "SHA-256 matches the pinned digest"
        blob = Path(os.path.realpath(path)).name
        if entry.repo and _SHA256.match(blob):
            verify_sha256(path, blob)
            return "SHA-256 matches the hub's LFS record"
        if verify_sidecar(path):
            return f"SHA-256 matches {sidecar(path).name}"
    except ChecksumError as err:
        raise CheckpointError(
            f"{name} ({path}) is corrupt or was altered: {err}; delete it and download again "
            f"with: {entry.download_command()}"
        ) from err
    return f"SHA-256 {sha256_file(path)} (no reference digest to compare with)"


def _from_hub(
    entry: OfficialWeights, name: str, cache_dir: str | os.PathLike | None, offline: bool
) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        with hub_access.quiet_hub_logs():
            return Path(
                hf_hub_download(
                    entry.repo, entry.filename, cache_dir=cache_dir, local_files_only=offline
                )
            )
    except LocalEntryNotFoundError as err:
        why = (
            hub_access.offline_reason()
            if offline
            else f"the hub cannot be reached ({type(err).__name__})"
        )
        raise WeightsUnavailableError(
            f"--ckpt {name}: {entry.source} is not in the Hugging Face cache and {why}; "
            f"download it with: {entry.download_command()}"
        ) from None
    except (EntryNotFoundError, HfHubHTTPError) as err:
        raise WeightsUnavailableError(
            f"--ckpt {name}: the hub has no {entry.source} ({type(err).__name__}); see "
            f"https://huggingface.co/{entry.repo}"
        ) from None


def _from_url(
    entry: OfficialWeights, name: str, cache_dir: str | os.PathLike | None, offline: bool
) -> Path:
    target_dir = Path(cache_dir) if cache_dir is not None else _url_cache_dir()
    path = target_dir / entry.filename
    if path.is_file():
        return path
    if offline:
        raise WeightsUnavailableError(
            f"--ckpt {name}: not in {target_dir} and {hub_access.offline_reason(entry.url)}; "
            f"download it with: {entry.download_command(target_dir)}"
        )
    import torch

    target_dir.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(
            str(entry.url), str(path), progress=True
        )  # temp file, then a rename
    except OSError as err:
        raise WeightsUnavailableError(
            f"--ckpt {name}: download of {entry.url} failed ({err}); download it with: "
            f"{entry.download_command(target_dir)}"
        ) from None
    if entry.sha256 is None:  # trust on first use: later loads are checked against this digest
        sidecar(path).write_text(sha256_file(path) + "\n")
    return path


def resolve_checkpoint(
    ckpt: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
    offline: bool | None = None, log: Callable[[str], None] | None = None,
) -> tuple[Path, OfficialWeights | None]:
    """``(local path, table entry or None)`` for a ``--ckpt`` value.

    An existing path wins (entry None). Otherwise ``ckpt`` must be a name of ``OFFICIAL_WEIGHTS``:
    the file comes from the Hugging Face cache (``cache_dir``, default ``HF_HUB_CACHE``),
    downloading it unless ``offline`` (default: ``HF_HUB_OFFLINE`` set, or its host cannot be
    reached: ``hub_access.is_offline``), is SHA-256-checked, and one
    line naming its source and licence goes to ``log`` (default stderr). Raises CheckpointError
    (WeightsUnavailableError when it cannot be fetched: the message names the repo, the file and the
    download command).
    """
    if os.path.exists(ckpt):
        return Path(ckpt), None
    name = os.fspath(ckpt)
    entry = official_weights(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint not found: {name} (not a file, nor an official name: "
            f"{', '.join([*OFFICIAL_WEIGHTS, *ALIASES])})"
        )
    if offline is None:  # the file's own host decides: the hub, or DiT's file server
        offline = hub_access.is_offline(None if entry.repo else entry.url)
    fetch = _from_hub if entry.repo else _from_url
    path = fetch(entry, name, cache_dir, offline)
    checked = _verify(path, entry, name)
    (log or (lambda line: print(line, file=sys.stderr)))(
        f"{name}: {entry.source} ({entry.model}, {entry.image_size}px, objective "
        f"{entry.objective}); licence: {entry.licence}; {checked}; {path}"
    )
    return path, entry


__all__ = [
    "ALIASES", "OFFICIAL_WEIGHTS", "OfficialWeights", "WeightsUnavailableError", "official_weights",
    "resolve_checkpoint",
]
