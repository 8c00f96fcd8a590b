"""Checks made before the heavy imports: the torch / torchvision pair and the checkpoint a
command reads. Each raises a one-line error (exit status 2) naming the culprit and the fix."""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from sit_vit5.utils.checksums import ChecksumError, verify_sidecar
from sit_vit5.utils.errors import CheckpointError, ConfigError
from sit_vit5.utils.run_files import previous_checkpoint, resume_file, truncation

#: sidecars of files up to this size are verified here too (the loader verifies every file again
#: after the imports; above this the second read would cost seconds)
SIDECAR_CHECK_BYTES = 256 * 2**20
_RELEASE = re.compile(r"^(\d+)\.(\d+)")


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision minor release built for ``torch_version`` (2.m -> 0.(m + 15), 1.m ->
    0.(m + 1)), None when unparsable."""
    match = _RELEASE.match(torch_version)
    if match is None:
        return None
    major, minor = int(match[1]), int(match[2])
    return f"0.{minor + (15 if major == 2 else 1)}" if major in (1, 2) else None


def torch_pair_problem(torch_version: str, torchvision_version: str) -> str | None:
    """Why these two builds cannot run together (another pairing, or local builds of different
    kinds), None when they can."""
    expected = torchvision_for(torch_version)
    got = _RELEASE.match(torchvision_version)
    if expected is not None and got is not None and f"{got[1]}.{got[2]}" != expected:
        return f"torch {torch_version} needs torchvision {expected}.x"
    local = [v.partition("+")[2] for v in (torch_version, torchvision_version)]
    if all(local) and local[0] != local[1]:
        return f"a +{local[0]} torch with a +{local[1]} torchvision"
    return None


def check_torch_pair() -> None:
    """Raise ConfigError when the installed torch and torchvision do not belong together
    (later: "operator torchvision::nms does not exist"). Reads versions only."""
    try:
        versions = metadata.version("torch"), metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return  # a missing package is reported by its import, with its own message
    problem = torch_pair_problem(*versions)
    if problem:
        raise ConfigError(
            f"torch {versions[0]} and torchvision {versions[1]} do not match ({problem}); install "
            "both from one index, e.g. pip install --force-reinstall torch torchvision --index-url "
            "https://download.pytorch.org/whl/cpu")


def check_checkpoint_file(path: str | os.PathLike, what: str, flag: str = "--resume") -> None:
    """Raise CheckpointError when ``path`` is cut short or, up to ``SIDECAR_CHECK_BYTES``, differs
    from its ``.sha256`` sidecar; ``what`` names the input, the error the complete one before it."""
    path = Path(path)
    cut = truncation(path)
    problem = f"truncated or not a checkpoint ({cut})" if cut else None
    if problem is None and path.stat().st_size <= SIDECAR_CHECK_BYTES:
        try:
            verify_sidecar(path)
        except ChecksumError as err:
            problem = f"corrupt or altered ({err})"
    if problem is None:
        return
    previous = previous_checkpoint(path)
    hint = f"; {flag} {previous} continues from the one before it" if previous else ""
    raise CheckpointError(f"{what}: {path} is {problem}{hint}")


def check_resume(spec: str, out_dir: str | os.PathLike) -> None:
    """``train.py --resume spec``: the checkpoint it names is whole (a spec naming none is left to
    the trainer)."""
    path = resume_file(spec, out_dir)
    if path is not None:
        check_checkpoint_file(path, f"--resume {spec}")
