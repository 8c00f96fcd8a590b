"""Helpers for the refusal tests of the command lines.

A command a hostile user (or a busy cluster) runs must end in a clear refusal, never a silent wrong
result or a raw traceback. The tests call the command's ``main(argv)`` with the exact argument list
a user types (``python train.py optim.ema_decay=2 ...`` is ``main(["optim.ema_decay=2", ...])``) and
check: exit status 2, exactly one stderr line, and the culprit (key and value, or file) named in it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
#: A tiny ViT5 on the 8x8 digits in pixel space: a train.py run of a few steps takes seconds.
TRAIN_ARGV = ["model.name=ViT5-S/2", "model.depth=2", "model.hidden_size=32", "model.num_heads=2",
              "model.learn_sigma=false", "data.kind=digits", "data.image_size=8",
              "data.num_workers=0", "vae.name=none", "optim.lr=1e-3", "optim.ema_decay=0.9",
              "train.tensorboard=false", "train.sample_every=0", "train.log_every=2",
              "train.milestone_every=0", "data.global_batch_size=16"]


def _load_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_train_cli():
    """The top-level ``train.py`` script as a module (``main(argv)`` returns the exit status)."""
    return _load_script("train_cli", ROOT / "train.py")


def load_sample_cli():
    """The top-level ``sample.py`` script as a module (``main(argv)`` returns the exit status)."""
    return _load_script("sample_cli", ROOT / "sample.py")


def one_error_line(capsys) -> str:
    """The single ``[<prog>: ]error: ...`` stderr line of a refused command (asserting there is
    exactly one), from ``error: `` on."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line[line.index("error: "):] for line in lines
              if re.match(r"(?:[\w./ -]+: )?error: ", line)]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


def run_train(argv, capsys) -> tuple[int, str]:
    """``train.py argv``: (exit status, its one error line, or "" when it succeeded)."""
    status = load_train_cli().main([str(a) for a in argv])
    return status, one_error_line(capsys) if status else ""


def one_sample_error(capsys, command: str) -> str:
    """The single ``sample.py <command>: error: ...`` stderr line of a refused sample.py command."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"sample.py {command}: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


def refused_in_one_line(run) -> str:
    """The single stderr line of a finished ``subprocess.run(..., capture_output=True, text=True)``
    that must have exited 2 without a traceback."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    return lines[0]


def make_image_folder(root: Path, counts: dict[str, int], seed: int = 0) -> Path:
    """``root/<class>/<i>.png``: random RGB PNGs with sides in [16, 40), ``counts[class]`` per class,
    drawn class by class in the dict's order from one seeded generator."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            h, w = rng.integers(16, 40, size=2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def assert_states_equal(a, b, where: str = "") -> None:
    """Nested states (tensors, dicts, lists, plain values) equal bit for bit; ``where`` names the
    first difference (``.model.blocks.0.attn.qkv.weight``)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_states_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_states_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_names(message: str, *names: object) -> None:
    """Each of ``names`` (a key, flag, file or value; ``str()`` of it) appears in ``message``: the tests
    check that a refusal names its culprit, not how the sentence around it is worded."""
    missing = [str(name) for name in names if str(name) not in message]
    assert not missing, f"{missing} not named in: {message}"


def naming(*names: object) -> str:
    """A ``pytest.raises(..., match=naming(...))`` pattern: the message names each of ``names``
    (literally, in any order), worded as it may be."""
    return "(?s)^" + "".join(f"(?=.*{re.escape(str(name))})" for name in names)


def rel(a, b) -> float:
    """max |a - b| relative to max |b| (tensors, compared in float64, gradients detached)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


class OpNames(TorchDispatchMode):
    """Inside, records the name of every aten op dispatched (``mul``, ``addcmul``, ...) in ``names``."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
