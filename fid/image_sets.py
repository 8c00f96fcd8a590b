"""Image sets for evaluation: an npz/npy array (ADM / DiT format: `arr_0`, uint8 [N, H, W, 3]) or a folder of
image files. Both are read in batches, so 50,000 samples at 256² (~10 GB) never sit in memory at once.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


class InputError(ValueError):
    """Bad evaluation input (wrong file, key, dtype, layout or count); the message names the culprit."""


@dataclass
class ImageSource:
    """A set of uint8 images [N, H, W, C] that can be read in order, batch by batch.

    name: where it came from (for messages). read(start, stop) returns images [start, stop).
    """

    name: str
    shape: tuple[int, int, int, int]
    read: Callable[[int, int], np.ndarray]

    def __len__(self) -> int:
        return self.shape[0]

    def batches(self, batch_size: int, limit: int | None = None) -> Iterator[np.ndarray]:
        """Consecutive batches [B, H, W, C] covering the first `limit` images (all by default)."""
        n = len(self) if limit is None else min(limit, len(self))
        for start in range(0, n, batch_size):
            yield self.read(start, min(start + batch_size, n))


def check_images_shape(name: str, shape: tuple[int, ...], dtype: np.dtype, channels: tuple[int, ...] = (3,)) -> None:
    """Raise InputError unless dtype is uint8 and shape is [N, H, W, C] with C in `channels`."""
    if np.dtype(dtype) != np.uint8:
        raise InputError(
            f"{name}: images must be uint8 in [0, 255], got dtype {np.dtype(dtype)}. "
            "Convert samples x in [-1, 1] "
            "with clamp(127.5 * x + 128, 0, 255).to(uint8) (the DiT/SiT convention)."
        )
    if len(shape) != 4:
        raise InputError(f"{name}: images must be 4-D [N, H, W, C], got shape {tuple(shape)}")
    if shape[3] not in channels:
        hint = " It looks like NCHW; transpose to NHWC." if shape[1] in channels else ""
        raise InputError(f"{name}: images must be NHWC with C in {channels}, got shape {tuple(shape)}.{hint}")
    if shape[0] == 0 or 0 in shape[1:3]:
        raise InputError(f"{name}: holds no images (shape {tuple(shape)})")


def load_plain_array(path: str | Path, key: str | None = None) -> np.ndarray:
    """An array of an .npy (``key`` None) or of an .npz, read without unpickling anything; an object array
    (which would need pickle) or an unreadable file raises InputError naming the file and key."""
    name = f"{path}[{key}]" if key is not None else str(path)
    try:
        if key is None:
            return np.load(path, allow_pickle=False)
        with np.load(path, allow_pickle=False) as f:
            return f[key]
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e):
            raise InputError(f"{name}: holds Python objects (dtype object); only numeric arrays are read, "
                             "pickled data is never loaded") from None
        raise InputError(f"{name}: cannot be read as an array ({e})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"{name}: cannot be read as an array ({e})") from None


def images_from_array(array: np.ndarray, name: str = "array", channels: tuple[int, ...] = (3,)) -> ImageSource:
    """Wrap an in-memory uint8 array [N, H, W, C]."""
    check_images_shape(name, array.shape, array.dtype, channels)
    return ImageSource(name, tuple(array.shape), lambda a, b: array[a:b])


def open_images(path: str | Path, key: str = "arr_0", channels: tuple[int, ...] = (3,)) -> ImageSource:
    """Open an image set without reading it all.

    path: an .npz (array `key`, default arr_0), an .npy, or a folder of image files (searched recursively,
    sorted by relative path, converted to RGB when channels == (3,)). All images must share one size.
    """
    path = Path(path)
    if path.is_dir():
        return _open_folder(path, channels)
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder (expected an .npz, .npy or a folder of images)")
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:  # object arrays cannot be memory-mapped: let the plain reader name the problem
            array = load_plain_array(path)
        check_images_shape(str(path), array.shape, array.dtype, channels)
        return ImageSource(str(path), tuple(array.shape), lambda a, b: np.asarray(array[a:b]))
    if path.suffix == ".npz":
        return _open_npz(path, key, channels)
    raise InputError(f"{path}: unsupported file type {path.suffix!r}; use .npz, .npy or a folder of images")


def npz_keys(path: str | Path) -> list[str]:
    """Names of the arrays in an npz file."""
    with zipfile.ZipFile(path) as zf:
        return [n[: -len(".npy")] for n in zf.namelist() if n.endswith(".npy")]


def _open_npz(path: Path, key: str, channels: tuple[int, ...]) -> ImageSource:
    try:
        keys = npz_keys(path)
    except zipfile.BadZipFile as e:
        raise InputError(f"{path}: not a valid npz file ({e})") from None
    if key not in keys:
        raise InputError(f"{path}: no array {key!r}; arrays present: {keys}")
    with zipfile.ZipFile(path) as zf, zf.open(f"{key}.npy") as f:
        version = np.lib.format.read_magic(f)
        header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, fortran, dtype = header[version](f) if version in header else (None, True, None)
    if fortran or dtype is None or dtype.hasobject:  # rare layouts: fall back to reading it whole
        array = load_plain_array(path, key)
        return images_from_array(array, f"{path}[{key}]", channels)
    check_images_shape(f"{path}[{key}]", shape, dtype, channels)
    return ImageSource(f"{path}[{key}]", tuple(shape), _NpzStreamReader(path, key, shape, dtype))


class _NpzStreamReader:
    """Reads rows [a, b) of an npz member sequentially (ADM's evaluator streams the same way).

    The member stays open between calls; a read that is not the continuation of the last one reopens it.
    """

    def __init__(self, path: Path, key: str, shape: tuple[int, ...], dtype: np.dtype):
        self.path, self.key, self.shape, self.dtype = path, key, shape, dtype
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self.next_row, self.file, self.zip = None, None, None

    def _reopen(self) -> None:
        self.close()
        self.zip = zipfile.ZipFile(self.path)
        self.file = self.zip.open(f"{self.key}.npy")
        version = np.lib.format.read_magic(self.file)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(self.file)
        self.next_row = 0

    def __call__(self, a: int, b: int) -> np.ndarray:
        if self.file is None or self.next_row != a:
            self._reopen()
            self._read_bytes(a * self.row_bytes)  # skip to row a
        data = self._read_bytes((b - a) * self.row_bytes)
        self.next_row = b
        return np.frombuffer(data, dtype=self.dtype).reshape(b - a, *self.shape[1:])

    def _read_bytes(self, size: int) -> bytes:
        chunks, got = [], 0
        while got < size:
            chunk = self.file.read(size - got)
            if not chunk:
                raise InputError(f"{self.path}[{self.key}]: file ends early (truncated npz?)")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.zip.close()
        self.file = self.zip = None

    def __del__(self) -> None:
        self.close()


def _open_folder(folder: Path, channels: tuple[int, ...]) -> ImageSource:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not files:
        raise InputError(f"{folder}: no image files ({', '.join(IMAGE_EXTENSIONS)}) found")
    mode = "RGB" if channels == (3,) else "L"

    def load(p: Path) -> np.ndarray:
        try:
            with Image.open(p) as im:
                arr = np.asarray(im.convert(mode), dtype=np.uint8)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise InputError(f"{p}: cannot read image ({type(e).__name__}: {e})") from None
        return arr[..., None] if arr.ndim == 2 else arr

    first = load(files[0])

    def read(a: int, b: int) -> np.ndarray:
        images = [load(p) for p in files[a:b]]
        for p, im in zip(files[a:b], images):
            if im.shape != first.shape:
                raise InputError(
                    f"{p}: size {im.shape[1]}x{im.shape[0]} differs from {files[0]} "
                    f"({first.shape[1]}x{first.shape[0]}); all images must share one size"
                )
        return np.stack(images)

    return ImageSource(str(folder), (len(files), *first.shape), read)
