"""Command line: FID / sFID / IS / precision-recall, as the ADM evaluator computes them.

    python -m fid SAMPLES REFERENCE [--metrics fid,sfid,is,pr] [--batch-size 64] [--device auto] ...
    python -m fid SAMPLES digits [--num-samples N]            # demo data: digits FID + class accuracy
    python -m fid make-reference IMAGES OUT.npz [--pr-images 10000]

SAMPLES: an .npz (`arr_0`, uint8 [N, H, W, 3], as DiT/SiT/ADM write it), an .npy, or a folder of images.
REFERENCE: an ADM reference batch (.npz with mu, sigma, mu_s, sigma_s, arr_0, e.g.
VIRTUAL_imagenet256_labeled.npz), any image set (statistics computed from it), or the word `digits`.
Prints a table and writes the results as JSON (default: next to SAMPLES, `<name>.metrics.json`), with how the
samples were made (label sampling, class histogram, sampler, NFE, CFG, precision, checkpoint SHA-256: from the
`metadata_json` that sample.py bulk writes into its npz, null / "unknown" without it), the reference file's SHA-256
and the number of samples.
SAMPLES must have the reference's image size (digits: 8×8, gray as 1 or 3 equal channels) unless
--resize-samples is given: a number across sizes is not comparable to the reference's. A reference whose labels
(`arr_1`) or recorded sample count do not fit the samples is refused (fid/provenance.py says the rule).

Exit status: 0 done; 2 bad input, one line `python -m fid: error: ...` naming the file and what is
wrong; 130 interrupted (nothing is written until the end). SIT_VIT5_DEBUG=1 shows the traceback.
(The contract of the sit_vit5 commands' `sit_vit5.utils.errors.run_cli`, in a few lines of its own: fid/
imports nothing of sit_vit5.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fid.image_sets import InputError, load_plain_array, npz_keys, open_images
from fid.metric_names import METRICS, check_metrics
from fid.provenance import (
    check_reference_match,
    check_samples_metadata,
    file_sha256,
    provenance,
    read_class_labels,
    read_metadata,
)

# The arguments, the samples file (header, size, count, labels) and the reference's existence are
# checked before torch and the networks are imported (seconds): a bad input is reported at once.
# The constants below are copies of the heavy modules' (tests/test_first_minute.py compares them).
INCEPTION_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"  # fid.inception
PR_IMAGES = 10_000  # fid.reference.PR_IMAGES
#: feature dimension of each Fréchet metric (fid.inception POOL_DIM, SPATIAL_DIM; fid.digits: the
#: 64-d hidden layer): a covariance of N samples has rank N - 1 at most, so N must exceed it
FEATURE_DIMS = {"fid": 2048, "sfid": 2023, "digits": 64}
DIGITS_REFERENCE_IMAGES = 1797  # the digits reference: every real 8x8 digit

PROG = "python -m fid"
DEBUG_ENV = "SIT_VIT5_DEBUG"  # the project's switch for tracebacks, read by name
EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130
PROTOCOL_SAMPLES = 50_000  # ADM / DiT / SiT report FID-50K
DIGITS_SIDE = 8  # the digits reference: scikit-learn's 8×8 digits
LABELS_KEYS = ("labels", "arr_1")  # where a digits sample npz may keep the requested class labels
DIGITS_CLASSES = 10
TABLE_NAMES = {
    "fid": "FID",
    "sfid": "sFID",
    "inception_score": "Inception Score",
    "inception_score_std": "  (std)",
    "precision": "Precision",
    "recall": "Recall",
    "digits_fid": "Digits FID",
    "digits_accuracy": "Digits accuracy",
    "num_samples": "Samples",
    "num_reference_images": "Reference images",
}


def load_inception(*args: Any, **kwargs: Any) -> Any:
    """``fid.inception.load_inception`` (imported on first use: torch, torch-fidelity)."""
    from fid.inception import load_inception as load

    return load(*args, **kwargs)


def evaluate(*args: Any, **kwargs: Any) -> dict[str, float | int]:
    """``fid.evaluate.evaluate`` (imported on first use)."""
    from fid.evaluate import evaluate as run

    return run(*args, **kwargs)


def _inception_error() -> tuple[type[BaseException], ...]:
    """The Inception weights' error class once fid.inception is imported (else nothing to catch)."""
    inception = sys.modules.get("fid.inception")
    return (inception.InceptionWeightsError,) if inception is not None else ()


def check_sample_count(name: str, n: int, metrics: list[str], convention: int, why: str) -> None:
    """Raise InputError (``--num-samples`` / the file ``name`` at fault) when ``n`` samples cannot
    give a full-rank covariance for a Fréchet metric of ``metrics`` (n <= its feature dimension: the
    number would be a large, meaningless value); one ``note:`` line on stderr when ``n`` is below
    ``convention`` (``why`` says whose)."""
    for metric in metrics:
        dim = FEATURE_DIMS.get(metric)
        if dim is not None and n <= dim:
            raise InputError(f"{name}: {n} samples; {metric} compares {dim}-d feature covariances, "
                             f"which need more than {dim} samples (use --num-samples > {dim}; "
                             f"{convention} is the convention)")
    if n < convention:
        print(f"note: {n} samples; {why} use {convention} (FID is biased upward at small N)",
              file=sys.stderr)


def _common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=64, help="images per Inception forward (default 64)")
    parser.add_argument("--device", default="auto", help="torch device, e.g. cuda, cuda:1, cpu (default: auto)")
    parser.add_argument(
        "--inception-weights",
        type=Path,
        default=None,
        help="torch-fidelity Inception weights (default: <torch hub dir>/checkpoints/, where "
        "torch-fidelity downloads them)",
    )
    parser.add_argument(
        "--weights-sha256",
        default=INCEPTION_SHA256,
        help="expected SHA-256 of the weights; change only for tests or a deliberately "
        "different network (its numbers are not comparable to published ones)",
    )


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fid",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("samples", type=Path, help="sample images: .npz (arr_0), .npy or image folder")
    p.add_argument("reference", help="ADM reference .npz, an image set, or 'digits'")
    p.add_argument(
        "--metrics",
        default=",".join(METRICS),
        help=f"comma-separated subset of {','.join(METRICS)} (default: all)",
    )
    p.add_argument("--num-samples", type=int, default=None, help="evaluate the first N samples (default: all)")
    p.add_argument("--samples-key", default="arr_0", help="array name inside a samples .npz (default arr_0)")
    p.add_argument("--out", type=Path, default=None, help="JSON output path (default: <SAMPLES>.metrics.json)")
    p.add_argument("--no-json", action="store_true", help="do not write the JSON file")
    p.add_argument(
        "--resize-samples",
        action="store_true",
        help="evaluate samples of another image size than the reference's (the network resizes "
        "them: Inception to 299x299, digits area-resized to 8x8); such numbers are not comparable",
    )
    _common_args(p)
    return p


def reference_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fid make-reference",
        description="Compute an ADM-format reference batch (mu, sigma, mu_s, sigma_s, arr_0) from a set of images.",
    )
    p.add_argument("images", type=Path, help="reference images: .npz (arr_0), .npy or image folder")
    p.add_argument("out", type=Path, help="output .npz")
    p.add_argument(
        "--pr-images",
        type=int,
        default=PR_IMAGES,
        help=f"images kept as arr_0 for precision/recall (default {PR_IMAGES})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arr_0 subset (default 0)")
    p.add_argument(
        "--num-samples",
        type=int,
        default=None,
        help="the sample count this reference is meant for (e.g. 50000), recorded in its metadata_json: "
        "python -m fid then refuses another count (default: none recorded, any count)",
    )
    _common_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line; bad input is one stderr line ``<prog>: error: ...`` and exit 2, Ctrl-C
    exit 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    reference = bool(argv) and argv[0] == "make-reference"
    prog = f"{PROG} make-reference" if reference else PROG
    try:
        if reference:
            return _make_reference(reference_parser().parse_args(argv[1:]))
        return _evaluate(eval_parser().parse_args(argv))
    except KeyboardInterrupt:
        if _debug():
            raise
        print(f"{prog}: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (InputError, OSError, *_inception_error()) as e:
        if _debug():
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise InputError(f"{name} must be a positive integer, got {value}")


def _evaluate(args: argparse.Namespace) -> int:
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--num-samples", args.num_samples)
    out = args.out or args.samples.with_name(args.samples.name.removesuffix(args.samples.suffix) + ".metrics.json")
    if not args.no_json and (args.out is not None or args.samples.exists()):  # a missing input is named first
        check_output(out)
    start = time.time()
    if args.reference == "digits":
        results, prov = _evaluate_digits(args)
        weights = None
    else:
        metrics = check_metrics([m.strip() for m in args.metrics.split(",") if m.strip()])
        samples = open_images(args.samples, args.samples_key)
        if not Path(args.reference).exists():
            raise InputError(f"{args.reference}: no such reference file (expected an ADM reference .npz or an "
                             "image set)")
        from fid.evaluate import check_sample_size
        from fid.reference import read_reference

        reference = read_reference(args.reference)
        check_sample_size(samples, reference, args.resize_samples)
        n = len(samples) if args.num_samples is None else args.num_samples
        prov = None
        if n <= len(samples):  # more than it holds: evaluate names the file
            check_sample_count(samples.name, n, metrics, PROTOCOL_SAMPLES, "published numbers")
            metadata, labels = _samples_record(args.samples, len(samples))
            check_reference_match(samples.name, reference.path, None if labels is None else labels[:n], metadata,
                                  reference.labels, reference.metadata, n)
            _note_subset(args.samples, metadata, n, len(samples))
            ref_file = Path(args.reference)
            digest = file_sha256(ref_file) if ref_file.is_file() and not args.no_json else None
            prov = provenance(metadata, labels, n, len(samples), digest)
        device = _device(args.device)
        extractor = load_inception(args.inception_weights, args.weights_sha256, device)
        results = evaluate(samples, reference, extractor, metrics, args.batch_size, device, args.num_samples)
        from fid.inception import default_weights_path

        weights = {
            "path": str(args.inception_weights or default_weights_path()),
            "sha256": args.weights_sha256.lower(),
            "official": args.weights_sha256.lower() == INCEPTION_SHA256,
        }
    print(format_table(results))
    if not args.no_json:
        record = {
            "samples": str(args.samples),
            "reference": args.reference,
            **(prov or {}),
            "metrics": results,
            "inception_weights": weights,
            "seconds": round(time.time() - start, 1),
            "versions": _versions(),
        }
        tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
        try:  # renamed into place: a crash or a full disk never leaves half a JSON file
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise InputError(f"--out {out}: cannot write the results ({e.strerror or e})") from None
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _samples_record(path: Path, num_images: int) -> tuple[dict[str, Any] | None, np.ndarray | None]:
    """The samples npz's metadata_json and class labels (all of them, int64 [N]; LABELS_KEYS), checked against the
    file's ``num_images`` (InputError naming the file and key)."""
    metadata = read_metadata(path)
    labels = read_class_labels(path, LABELS_KEYS)
    if labels is not None and len(labels) != num_images:
        raise InputError(f"{path}: {len(labels)} class labels for {num_images} images; one label per image expected")
    check_samples_metadata(str(path), metadata, num_images, labels)
    return metadata, labels


def _note_subset(path: Path, metadata: dict[str, Any] | None, n: int, num_images: int) -> None:
    """One stderr note when only the first ``n`` of ``num_images`` equal-label samples are evaluated."""
    if n < num_images and (metadata or {}).get("label_sampling") == "equal":
        print(f"note: {path} has equal class counts over all {num_images} samples; its first {n} do not "
              "(the JSON's class_histogram counts the evaluated ones)", file=sys.stderr)


def _evaluate_digits(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, Any]]:
    samples = open_images(args.samples, args.samples_key, channels=(1, 3))
    n = len(samples) if args.num_samples is None else args.num_samples
    if n > len(samples):
        raise InputError(f"{samples.name}: --num-samples {n} requested but it holds only {len(samples)} images")
    _, height, width, _ = samples.shape
    if (height, width) != (DIGITS_SIDE, DIGITS_SIDE) and not args.resize_samples:
        side = f"{DIGITS_SIDE}x{DIGITS_SIDE}"
        raise InputError(f"{samples.name}: images are {width}x{height}, the digits reference is "
                         f"{side}; sample at {side}, or pass --resize-samples to area-resize them "
                         "(the number is then not comparable)")
    array = np.concatenate(list(samples.batches(4096, n)))
    check_gray(samples.name, array)
    labels = read_labels(args.samples, n) if args.samples.suffix == ".npz" else None
    if labels is None:
        print(
            f"note: no labels ({' or '.join(LABELS_KEYS)}) in {args.samples}; accuracy not computed",
            file=sys.stderr,
        )
    check_sample_count(samples.name, n, ["digits"], DIGITS_REFERENCE_IMAGES,
                       "the digits reference and its numbers")
    metadata, all_labels = (None, None)
    if args.samples.suffix == ".npz":
        metadata, all_labels = _samples_record(args.samples, len(samples))
    check_reference_match(samples.name, "digits", labels, metadata, None, None, n, DIGITS_CLASSES)
    _note_subset(args.samples, metadata, n, len(samples))
    prov = provenance(metadata, all_labels, n, len(samples), None)
    import torch

    from fid.digits import digits_metrics, uint8_to_digits_input

    images = uint8_to_digits_input(array)
    results = digits_metrics(images, None if labels is None else torch.from_numpy(labels.astype(np.int64)))
    return results, prov


def check_gray(name: str, images: np.ndarray) -> None:
    """Raise InputError unless uint8 images [N, H, W, C] are gray (C = 1, or C = 3 equal channels,
    as sample.py writes a 1-channel model's output): the digits network would average colours."""
    if images.shape[-1] != 3:
        return
    colour = (images[..., 0] != images[..., 1]) | (images[..., 0] != images[..., 2])  # [N, H, W]
    if colour.any():
        first = int(np.flatnonzero(colour.reshape(len(images), -1).any(axis=1))[0])
        raise InputError(f"{name}: colour images (image {first} has unequal R, G, B), but the "
                         "digits reference is gray; pass gray samples (1 channel, or 3 equal ones)")


def read_labels(path: Path, n: int, num_classes: int = DIGITS_CLASSES) -> np.ndarray | None:
    """The first ``n`` class labels (int64) stored in a samples npz under one of LABELS_KEYS, or None.
    Raises InputError naming the file and key for non-integer labels, the wrong count or ids outside
    [0, num_classes): accuracy against such labels would be a silent 0."""
    keys = npz_keys(path)
    key = next((k for k in LABELS_KEYS if k in keys), None)
    if key is None:
        return None
    name = f"{path}[{key}]"
    labels = load_plain_array(path, key)
    if labels.ndim != 1:
        raise InputError(f"{name}: labels must be 1-D [N], got shape {labels.shape}")
    labels = labels[:n]
    if labels.dtype.kind not in "iu":
        integral = labels.dtype.kind == "f" and np.isfinite(labels).all() and (labels == np.round(labels)).all()
        if not integral:
            raise InputError(f"{name}: labels must be integer class ids, got dtype {labels.dtype}"
                             f"{f' (first: {labels[0].item()!r})' if len(labels) else ''}")
    if len(labels) != n:
        raise InputError(f"{name}: {len(labels)} labels for {n} images")
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise InputError(f"{name}: {int(bad.sum())} label(s) outside [0, {num_classes}) (e.g. index {first}: "
                         f"{labels[first].item()!r}); the digits classifier knows classes 0..{num_classes - 1}")
    return labels.astype(np.int64)


def check_output(path: Path) -> None:
    """Raise InputError unless ``path`` can be written: its folder exists and is writable, and it is not a
    folder itself (checked before the evaluation, not after it)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"--out {path}: is a folder; give a file name such as {path / 'metrics.json'}")
    if not parent.is_dir():
        raise InputError(f"--out {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--out {path}: folder {parent} is not writable")


def _make_reference(args: argparse.Namespace) -> int:
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--pr-images", args.pr_images)
    _check_positive("--num-samples", args.num_samples)
    images = open_images(args.images)
    if len(images) < 2:
        raise InputError(f"{images.name}: statistics need at least 2 images, got {len(images)}")
    from fid.reference import make_reference

    device = _device(args.device)
    extractor = load_inception(args.inception_weights, args.weights_sha256, device)
    stats, kept = make_reference(
        images, extractor, args.out, args.pr_images, args.batch_size, device, args.seed, args.num_samples
    )
    print(f"wrote {args.out}: statistics of {len(images)} images, {len(kept)} images as arr_0", file=sys.stderr)
    return 0


def format_table(results: dict[str, float | int]) -> str:
    """Two-column text table of the results."""
    rows = [(TABLE_NAMES.get(k, k), f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in results.items()]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>12}" for name, value in rows)


def _versions() -> dict[str, str]:
    import scipy
    import torch
    import torch_fidelity

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "torch_fidelity": torch_fidelity.__version__,
    }


if __name__ == "__main__":
    sys.exit(main())
