"""Bulk (FID) sampling into an ADM-compatible ``.npz``: sharded over processes, resumable.

Layout of ``out_dir``::

    settings.json                 what the samples depend on; a resumed run must match it
    parts/0000000-0000031.npz     one file per generated batch: indices, images (uint8 NHWC),
                                  labels, nfe (model evaluations per image; -1: unknown)
    images/000000.png             optional single images
    samples_{N}x{H}x{W}x3.npz     arr_0 uint8 [N, H, W, 3], arr_1 int64 labels [N] (index order),
                                  settings: settings.json's text (a 0-d string array),
                                  metadata_json: how the samples were made (a 0-d string array
                                  holding JSON, see :func:`sample_metadata`)

``arr_0`` and ``arr_1`` are what ADM's evaluator reads; the two string members load with
``np.load(path, allow_pickle=False)`` (``json.loads(str(f["metadata_json"]))``).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import warnings
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from tqdm.auto import tqdm

from ..images import save_png, to_rgb
from ..sample_spec import DEFAULT_SAMPLING_METHOD
from ..utils.atomic_files import atomic_write, atomic_write_text, output_dir
from ..utils.errors import SitVit5Error
from .labels import DEFAULT_LABEL_SAMPLING, check_label_sampling, class_histogram, equal_labels
from .sampling_pipeline import Generated, SamplingPipeline

#: settings keys holding content digests (``SamplingPipeline.input_digests``, the checkpoint file's)
DIGEST_KEYS = ("weights_sha256", "vae_sha256", "checkpoint_sha256")
#: settings keys that older versions did not record -> the value they implied (None: unknown, so
#: not checked when resuming such a directory)
ADDED_SETTINGS: dict[str, str | None] = {"label_sampling": DEFAULT_LABEL_SAMPLING,
                                         "precision": None}
METADATA_KEY = "metadata_json"  # the merged npz's member saying how the samples were made
METADATA_FORMAT = "sit_vit5.bulk-metadata/1"
CLAIM_PREFIX = ".claim-"  # parts/.claim-<part>: a process is making that batch
CLAIM_TIMEOUT_S = 6 * 3600.0  # a claim this old from another host is taken over


class ResumeError(SitVit5Error, ValueError):
    """An output directory holding samples made with other settings (or inputs)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def claim_batch(parts_dir: Path, indices: np.ndarray, timeout_s: float = CLAIM_TIMEOUT_S
                ) -> Path | None:
    """Claim the batch ``indices`` for this process (an exclusively created
    ``parts/.claim-<part>``); None when a live process holds it. A claim of a dead process on this
    host, or older than ``timeout_s`` from another host, is taken over (a crashed claimant)."""
    path = parts_dir / f"{CLAIM_PREFIX}{_part_name(indices)[:-4]}"
    record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                stale = (not _alive(int(holder["pid"])) if holder["host"] == record["host"]
                         else time.time() - path.stat().st_mtime > timeout_s)
            except (OSError, ValueError, KeyError, TypeError):  # half-written or vanished
                stale = not path.exists() or time.time() - path.stat().st_mtime > 60
            if not stale:
                return None
            path.unlink(missing_ok=True)
            continue
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
        except OSError as err:  # a full disk: name the file (the bare error names none)
            path.unlink(missing_ok=True)
            raise OSError(err.errno, err.strerror or str(err), os.fspath(path)) from err
        return path
    return None


@dataclass
class BulkResult:
    """What one ``sample_bulk`` call did: ``npz`` is the merged file (None if this process did not
    merge or samples are still missing); ``generated``/``skipped`` count this process's indices."""

    npz: Path | None
    generated: int
    skipped: int
    nfe: int | None
    seconds: float
    images_per_second: float
    claimed: int = 0  # samples of this process's share being made by another process


def _part_name(indices: np.ndarray) -> str:
    """``{first:07d}-{last:07d}.npz`` for a contiguous run of indices; ``...-step{k}.npz`` for every
    k-th index (one process of k); else ``...-{count}-{sha8}.npz`` (a resume's leftovers), so a
    name never claims indices the part does not hold and two different sets never share one."""
    first, last = int(indices[0]), int(indices[-1])
    gaps = np.unique(np.diff(indices)) if len(indices) > 1 else np.array([1])
    if len(gaps) == 1 and gaps[0] == 1:
        return f"{first:07d}-{last:07d}.npz"
    if len(gaps) == 1 and gaps[0] > 1:
        return f"{first:07d}-{last:07d}-step{int(gaps[0])}.npz"
    digest = hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()[:8]
    return f"{first:07d}-{last:07d}-{len(indices)}-{digest}.npz"


def _save_part(parts_dir: Path, batch: Generated) -> Path:
    """Write one batch as ``parts/<_part_name>`` atomically (resume trusts complete files only)."""

    path = parts_dir / _part_name(batch.indices)
    nfe = np.int64(-1 if batch.nfe is None else batch.nfe)
    atomic_write(path, lambda f: np.savez(f, indices=batch.indices, images=batch.images,
                                          labels=batch.labels, nfe=nfe))
    return path


def scan_parts(parts_dir: str | os.PathLike, remove_unreadable: bool = False
               ) -> dict[int, tuple[Path, int]]:
    """Map each finished sample index to ``(part file, row)``; temporary files (``.tmp-*``) are
    ignored. An unreadable part (truncated or damaged after it was written: parts are written
    atomically) is skipped with a warning, and with ``remove_unreadable`` deleted, so that its
    samples are made again and it is not warned about forever."""
    found: dict[int, tuple[Path, int]] = {}
    parts_dir = Path(parts_dir)
    if not parts_dir.is_dir():
        return found
    for part in sorted(parts_dir.glob("[0-9]*.npz")):
        try:
            with np.load(part, allow_pickle=False) as f:
                indices = f["indices"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            if remove_unreadable:
                part.unlink(missing_ok=True)
            warnings.warn(f"{'removed' if remove_unreadable else 'ignoring'} unreadable part "
                          f"{part} ({err}); its samples will be regenerated", stacklevel=2)
            continue
        for row, i in enumerate(indices.tolist()):
            found.setdefault(i, (part, row))
    return found


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record ``settings`` in ``out/settings.json`` on first use; on resume, raise if any key
    differs."""
    path = out / "settings.json"
    # tuples -> lists, paths -> str: compare what would be stored
    settings = json.loads(json.dumps(settings, default=str))
    if path.is_file():
        saved = json.loads(path.read_text())
        for key, implied in ADDED_SETTINGS.items():  # written before the key was recorded
            if key in settings and key not in saved:
                saved[key] = settings[key] if implied is None else implied
        unrecorded = [k for k in DIGEST_KEYS if k in settings and k not in saved]
        if unrecorded:  # written before digests were recorded: the paths must do
            warnings.warn(f"{path} records no {', '.join(unrecorded)} (an older version wrote "
                          "it): resuming without checking the weights' content", stacklevel=3)
        keys = sorted((set(saved) | set(settings)) - set(unrecorded))
        diffs = [f"{k}: {saved.get(k)!r} (in {path}) != {settings.get(k)!r} (now)"
                 for k in keys if saved.get(k) != settings.get(k)]
        if diffs:
            raise ResumeError(f"{out} holds samples made with other settings:\n  "
                              + "\n  ".join(diffs)
                              + "\nUse another output directory (or delete it) to start over.")
        return
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, text)  # same text from every rank


def _write_npz_streamed(
    path: Path, num: int, done: dict[int, tuple[Path, int]], progress: bool = True,
    cache_size: int = 64, settings: str | None = None,
    metadata: Callable[[np.ndarray, tuple[int, int, int]], str] | None = None,
) -> None:
    """Write ``arr_0`` uint8 [num, H, W, 3] and ``arr_1`` labels in index order, streaming rows from
    the parts (an uncompressed zip of .npy members, as ``np.savez`` writes) so the whole array is
    never in memory; ``settings`` (settings.json's text) becomes the 0-d string member ``settings``,
    ``metadata(labels [num], image shape (H, W, 3))`` the 0-d string member ``metadata_json``.
    """
    cache: OrderedDict[Path, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def row(i: int) -> tuple[np.ndarray, int]:
        part, r = done[i]
        if part not in cache:
            with np.load(part, allow_pickle=False) as f:
                cache[part] = (f["images"], f["labels"])
            if len(cache) > cache_size:
                cache.popitem(last=False)
        cache.move_to_end(part)
        images, labels = cache[part]
        return images[r], int(labels[r])

    first, _ = row(0)
    height, width, _ = first.shape
    labels = np.empty(num, dtype=np.int64)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": (num, height, width, 3)}

    def write(file: BinaryIO) -> None:
        with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, header)
                for lo in tqdm(range(0, num, 1024), desc="merge", unit="chunk", leave=False,
                               disable=not progress):
                    chunk = []
                    for i in range(lo, min(lo + 1024, num)):
                        image, labels[i] = row(i)
                        if image.shape[:2] != (height, width):
                            raise ValueError(f"{done[i][0]}: image {i} is {image.shape}, "
                                             f"others {first.shape}")
                        chunk.append(image)
                    f.write(to_rgb(np.stack(chunk)).tobytes())
            with zf.open("arr_1.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, labels, allow_pickle=False)
            if settings is not None:  # what the samples were made with travels with them
                with zf.open("settings.npy", "w") as f:
                    np.lib.format.write_array(f, np.array(settings), allow_pickle=False)
            if metadata is not None:
                text = metadata(labels, (height, width, 3))
                with zf.open(f"{METADATA_KEY}.npy", "w") as f:
                    np.lib.format.write_array(f, np.array(text), allow_pickle=False)

    atomic_write(path, write)


def _nfe_of_parts(parts: dict[Path, int]) -> list[int] | None:
    """Model evaluations per image of each sample, from each part's ``nfe`` member (``parts``: part
    file -> how many of the merged samples it holds); None when a part does not record it."""
    values: list[int] = []
    for part, count in parts.items():
        with np.load(part, allow_pickle=False) as f:
            nfe = int(f["nfe"]) if "nfe" in f.files else -1
        if nfe < 0:  # written by an older version, or an unknown count
            return None
        values += [nfe] * count
    return values


def sample_metadata(settings: dict[str, Any], labels: np.ndarray,
                    image_shape: tuple[int, int, int], nfe: list[int] | None) -> dict[str, Any]:
    """What a FID line needs to say how the samples were made, from ``settings`` (settings.json),
    the merged ``labels`` (int64 ``[N]``), the image shape ``(H, W, 3)`` and the model evaluations
    per image of every sample (None: unknown).

    Keys: ``format``, ``num_samples``, ``image_shape``, ``num_classes``, ``label_sampling``
    (random | equal), ``class_histogram`` (samples per class id, ``[num_classes]``),
    ``global_seed``, ``sampler`` (``method``, ``solver``, ``num_steps``), ``nfe_per_image`` (an int
    when every batch took the same number, else the mean; model evaluations per image, a CFG
    doubled batch counting once), ``cfg_scale``, ``cfg_interval``, ``cfg_channels``,
    ``precision``, ``checkpoint`` (path), ``checkpoint_sha256`` (``checksums.checkpoint_sha256``),
    ``weights_sha256`` (of the model's parameters), ``spec`` (every sampler setting). A value the
    settings do not hold is None."""
    spec = settings.get("spec") or {}
    method = spec.get("method")
    num_classes = settings.get("num_classes")
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if len(labels) else 0
    mean_nfe: float | int | None = None
    if nfe:
        mean_nfe = nfe[0] if min(nfe) == max(nfe) else round(float(np.mean(nfe)), 3)
    return {
        "format": METADATA_FORMAT,
        "num_samples": len(labels),
        "image_shape": list(image_shape),
        "num_classes": num_classes,
        "label_sampling": settings.get("label_sampling", DEFAULT_LABEL_SAMPLING),
        "class_histogram": class_histogram(labels, num_classes),
        "global_seed": settings.get("global_seed"),
        "sampler": {"method": method,
                    "solver": spec.get("sampling_method") or DEFAULT_SAMPLING_METHOD.get(method),
                    "num_steps": spec.get("num_steps")},
        "nfe_per_image": mean_nfe,
        "cfg_scale": spec.get("cfg_scale"),
        "cfg_interval": spec.get("cfg_interval"),
        "cfg_channels": spec.get("cfg_channels"),
        "precision": settings.get("precision"),
        "checkpoint": settings.get("ckpt"),
        "checkpoint_sha256": settings.get("checkpoint_sha256"),
        "weights_sha256": settings.get("weights_sha256"),
        "spec": spec or None,
    }


def merge_parts(out_dir: str | os.PathLike, num_samples: int, progress: bool = True) -> Path:
    """Merge ``out_dir/parts`` into ``out_dir/samples_{N}x{H}x{W}x3.npz`` (arr_0 uint8 NHWC RGB,
    arr_1 int64 labels, samples 0..N-1 in index order, settings.json's text and
    :func:`sample_metadata` as JSON under ``metadata_json``); raises if any of them is missing."""
    out = Path(out_dir)
    done = scan_parts(out / "parts")
    missing = [i for i in range(num_samples) if i not in done]
    if missing:
        raise ValueError(f"{out}: {len(missing)} of {num_samples} samples are missing "
                         f"(first: {missing[:5]}); "
                         "run the sampler again to finish them")
    with np.load(done[0][0], allow_pickle=False) as f:
        _, height, width, _ = f["images"].shape
    path = out / f"samples_{num_samples}x{height}x{width}x3.npz"
    settings_file = out / "settings.json"
    text = settings_file.read_text() if settings_file.is_file() else None
    settings = json.loads(text) if text is not None else {}
    nfe = _nfe_of_parts(Counter(done[i][0] for i in range(num_samples)))

    def metadata(labels: np.ndarray, shape: tuple[int, int, int]) -> str:
        return json.dumps(sample_metadata(settings, labels, shape, nfe), sort_keys=True)

    _write_npz_streamed(path, num_samples, done, progress, settings=text, metadata=metadata)
    return path


def _default_barrier() -> Callable[[], None] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.barrier
    return None


def sample_bulk(
    pipe: SamplingPipeline, num_samples: int, out_dir: str | os.PathLike, *, global_seed: int = 0,
    batch_size: int = 32, rank: int = 0, world_size: int = 1, png: bool = False,
    settings: dict[str, Any] | None = None, barrier: Callable[[], None] | None = None,
    progress: bool = True, label_sampling: str = DEFAULT_LABEL_SAMPLING,
) -> BulkResult:
    """Generate samples ``0 .. num_samples-1``; this process does ``i % world_size == rank``, in
    batches of ``batch_size``, skipping indices already in ``out_dir/parts`` (resume).

    ``label_sampling`` (:mod:`~sit_vit5.sampling.labels`): ``random`` = uniform random labels,
    ``equal`` = exactly ``num_samples / num_classes`` per class in a seeded order (a count that is
    not a multiple of the classes is refused before anything is written). ``settings`` (JSON-able:
    checkpoint, image size, ...) is recorded with the sampler settings, the seed and the label
    sampling in ``settings.json``; resuming with different ones raises ResumeError
    (``num_samples`` may grow under ``random``: samples are per-index; under ``equal`` every label
    depends on it, so it is recorded too). After a barrier (``barrier``, default
    torch.distributed's when initialised) rank 0 merges all parts into the npz (with
    ``metadata_json``, :func:`sample_metadata`); without a barrier, whichever process finds all
    samples done merges.
    """
    if num_samples < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError("need num_samples, batch_size, world_size >= 1 and 0 <= rank < "
                         "world_size; got "
                         f"{num_samples}, {batch_size}, {world_size}, rank {rank}")
    check_label_sampling(label_sampling, num_samples, pipe.num_classes)  # before any file
    if pipe.spec.batch_coupled:
        warnings.warn(f"sampling_method={pipe.spec.sampling_method!r} is adaptive: each batch "
                      "shares its step sizes, so images depend on batch composition (within the "
                      "solver tolerance); use a fixed-step method (euler, heun2, rk4) or the SDE "
                      "for index-exact reproducibility", stacklevel=2)
    barrier = barrier or _default_barrier()
    out = output_dir(out_dir)
    parts = out / "parts"
    parts.mkdir(exist_ok=True)
    labels_of = {"label_sampling": label_sampling}
    if label_sampling == "equal":  # every label depends on the count
        labels_of["num_samples"] = num_samples
    _check_settings(out, {"global_seed": global_seed, "spec": asdict(pipe.spec),
                          "latent_shape": list(pipe.latent_shape), "num_classes": pipe.num_classes,
                          "precision": pipe.precision, **labels_of, **(settings or {})})
    done = scan_parts(parts, remove_unreadable=True)
    mine = range(rank, num_samples, world_size)
    todo = [i for i in mine if i not in done]
    nfe, start, generated, claimed = None, time.perf_counter(), 0, 0
    with tqdm(total=len(mine), initial=len(mine) - len(todo), disable=not progress or rank != 0,
              desc=f"sampling (rank 0 of {world_size})", unit="img", dynamic_ncols=True) as bar:
        for lo in range(0, len(todo), batch_size):
            indices = np.asarray(todo[lo : lo + batch_size], dtype=np.int64)
            claim = claim_batch(parts, indices)
            if claim is None or (parts / _part_name(indices)).exists():  # another process's
                claimed += len(indices) if claim is None else 0
                if claim is not None:
                    claim.unlink(missing_ok=True)
                continue
            try:
                labels = (None if label_sampling == "random"  # the pipeline's own draw
                          else equal_labels(indices, global_seed, num_samples, pipe.num_classes))
                batch = pipe.generate(indices.tolist(), global_seed, labels)
                if png:
                    for i, image in zip(batch.indices, batch.images):
                        save_png(image, out / "images" / f"{int(i):06d}.png")
                _save_part(parts, batch)  # last: a part on disk means its PNGs are there too
            finally:
                claim.unlink(missing_ok=True)
            nfe, generated = batch.nfe, generated + len(indices)
            bar.update(len(batch.indices))
    seconds = time.perf_counter() - start
    if barrier is not None:
        barrier()
    npz = None
    if rank == 0 or barrier is None:
        done = scan_parts(parts)
        if all(i in done for i in range(num_samples)):
            npz = merge_parts(out, num_samples, progress)
    return BulkResult(npz, generated, len(mine) - len(todo), nfe, seconds,
                      generated / max(seconds, 1e-9), claimed)
