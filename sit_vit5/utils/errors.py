"""One-line errors for the command lines, and the base class of the errors they report.

A bad input is reported as ``<prog>: error: <message>`` on one stderr line with exit status 2;
Ctrl-C exits 130 and SIGTERM 3. ``SIT_VIT5_DEBUG=1`` shows the traceback. See :func:`run_cli`."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping

DEBUG_ENV = "SIT_VIT5_DEBUG"
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
EXIT_TERMINATED = 3  # SIGTERM (a scheduler's pre-emption): train.py's pre-empted status too


class Terminated(BaseException):
    """SIGTERM arrived (raised by :func:`run_cli`'s handler, like KeyboardInterrupt for SIGINT)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


class SitVit5Error(Exception):
    """Base of every failure the user can fix (a flag, value, key, file or setting at fault).
    Subclasses also derive from the builtin kind they refine (ValueError, ...)."""


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
    """The first OSError with ``errno == code`` in ``err``'s chain (torch.save wraps it)."""
    return next((e for e in exception_chain(err) if isinstance(e, OSError) and e.errno == code),
                None)


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (a DataLoader worker's re-raise: its last line)."""
    text = str(err).strip() or type(err).__name__
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        name, sep, rest = last.partition(": ")
        text = rest if sep and name.replace(".", "").replace("_", "").isalnum() else last
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


class ConfigError(SitVit5Error, ValueError):
    """An input that cannot work, named in the message with its fix: a config file or key, a
    command-line flag, a combination of them, or an installed torch / torchvision pair."""


class CheckpointError(SitVit5Error, RuntimeError):
    """A checkpoint that cannot be read (cut short, altered, not one) or does not fit the model."""


class SettingError(ConfigError):
    """A setting with a bad value: ``key``, ``value`` and ``reason`` (starting with its own
    separator: ": must be >= 2"). ``str()``: ``key=value<reason>``; front doors re-render it."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key, self.value, self.reason = key, value, reason
        super().__init__(f"{key}={value!r}{reason}")

    def as_flag(self) -> str:
        """The message in command-line words: ``--num-steps 1: ...``."""
        value = " ".join(map(str, self.value)) if isinstance(self.value, tuple) else self.value
        return f"--{self.key.replace('_', '-')} {value}{self.reason}"


#: what every entry point reports as one line: our errors, and files the OS refused (missing,
#: unreadable, disk full)
KNOWN_ERRORS: tuple[type[BaseException], ...] = (SitVit5Error, OSError)


def run_cli(prog: str, main: Callable[[], int], *,
            errors: tuple[type[BaseException], ...] = KNOWN_ERRORS,
            statuses: Mapping[type[BaseException], int] | None = None, resumable: bool = False,
            render: Callable[[BaseException], str] = one_line) -> int:
    """``main()``; any of ``errors`` prints ``<prog>: error: <one line>`` and returns
    ``statuses[type]`` (first matching base, else 2); Ctrl-C returns 130 and SIGTERM 3, with a line
    saying whether rerunning continues (``resumable``). ``SIT_VIT5_DEBUG=1`` re-raises."""
    tail = "; rerun the same command to continue" if resumable else ""
    # SIGTERM as an exception, so that cleanups run (temporary files); not in other threads
    own = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if own else None
    try:
        return main()
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        print(f"{prog}: interrupted{tail}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        if debug_enabled():
            raise
        print(f"{prog}: terminated (SIGTERM){tail}", file=sys.stderr)
        return EXIT_TERMINATED
    except errors as err:
        if debug_enabled():
            raise
        status = next((s for kind, s in (statuses or {}).items() if isinstance(err, kind)),
                      EXIT_BAD_INPUT)
        print(f"{prog}: error: {render(err)}", file=sys.stderr)
        return status
    finally:
        if own:
            signal.signal(signal.SIGTERM, previous)
