"""One-line errors for the command lines.

A bad input (a config key, a file, a checkpoint, a full disk) is reported as ``error: <message>`` on one
line of stderr with exit status 2, instead of a traceback. ``SIT_VIT5_DEBUG=1`` re-raises the exception so
that the full traceback is shown.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

DEBUG_ENV = "SIT_VIT5_DEBUG"
EXIT_BAD_INPUT = 2


def debug_enabled() -> bool:
    """True when ``$SIT_VIT5_DEBUG`` is set to anything but empty or 0."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then its ``__cause__`` / ``__context__`` ancestors (each once)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def find_errno(err: BaseException, code: int) -> OSError | None:
    """The first OSError with ``errno == code`` in ``err``'s chain (torch.save, for one, wraps the OSError
    of a failed write in a RuntimeError that names only a stream position)."""
    return next((e for e in exception_chain(err) if isinstance(e, OSError) and e.errno == code), None)


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line. A DataLoader worker re-raises its exception with the worker's
    traceback pasted into the message; only the original message (its last line) is kept."""
    text = str(err).strip() or type(err).__name__
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        name, sep, rest = last.partition(": ")
        text = rest if sep and name.replace(".", "").replace("_", "").isalnum() else last
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def report(err: BaseException, status: int = EXIT_BAD_INPUT, hint: str = "") -> int:
    """Print ``error: <one line>[ (<hint>)]`` to stderr and return ``status`` (re-raise under SIT_VIT5_DEBUG)."""
    if debug_enabled():
        raise err
    print(f"error: {one_line(err)}{f' ({hint})' if hint else ''}", file=sys.stderr)
    return status


def run_cli(main: Callable[[], int], errors: tuple[type[BaseException], ...],
            status: int = EXIT_BAD_INPUT) -> int:
    """``main()``, with any of ``errors`` reported as one line and exit ``status`` (see ``report``)."""
    try:
        return main()
    except errors as err:
        return report(err, status)
