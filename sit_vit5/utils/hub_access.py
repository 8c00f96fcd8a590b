"""Whether a download host (the Hugging Face hub, GitHub for torch.hub) can be reached, decided
once per process, so that an offline look-up fails in one line instead of after ~25 s of retries.

``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) means offline, nothing probed; otherwise one
TCP connection to the host (or its HTTPS proxy) is tried within ``PROBE_TIMEOUT_S``. On failure one
line says so and the process goes offline (huggingface_hub's flag too). Torch-free."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

PROBE_TIMEOUT_S = 2.0
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
GITHUB = "https://github.com"
#: the loggers whose retry warnings fill the screen while a request cannot connect
NOISY_LOGGERS = ("huggingface_hub", "urllib3", "httpx", "httpcore")
_TRUE = {"1", "true", "yes", "on"}

#: (host, port) -> None when it answered, else why not; one probe per host and process
_probe_results: dict[tuple[str, int], str | None] = {}


def env_offline() -> bool:
    """Whether offline mode was asked for: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, or
    huggingface_hub's own flag when it is imported."""
    constants = sys.modules.get("huggingface_hub.constants")
    return bool(getattr(constants, "HF_HUB_OFFLINE", False)) or any(
        (os.environ.get(var) or "").strip().lower() in _TRUE
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hf_endpoint() -> str:
    """The hub's URL (``HF_ENDPOINT``, default huggingface.co)."""
    return os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT


def _address(url: str) -> tuple[str, int]:
    """(host, port) a request to ``url`` connects to first: its HTTPS proxy when one applies."""
    parts = urlsplit(url)
    host = parts.hostname or url
    proxy = getproxies().get(parts.scheme or "https")
    if proxy and not proxy_bypass(host):
        proxied = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return proxied.hostname or proxy, proxied.port or 8080
    return host, parts.port or (80 if parts.scheme == "http" else 443)


def connect_once(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout`` seconds, else why not
    (in a thread: name resolution ignores socket timeouts)."""
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{type(err).__name__}: {err}")

    worker = threading.Thread(target=attempt, name="hub-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


@contextlib.contextmanager
def quiet_hub_logs() -> Iterator[None]:
    """Raise the hub and HTTP loggers to ERROR for the block (their retry warnings are noise)."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def go_offline() -> None:
    """Set offline mode for the rest of the process: the environment and huggingface_hub's flag."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # read once at its import: the environment alone comes too late
        constants.HF_HUB_OFFLINE = True


def unreachable_reason(url: str | None = None) -> str | None:
    """Why ``url``'s host (default: the hub) cannot be reached, None when it can; probed once."""
    address = _address(url or hf_endpoint())
    if address not in _probe_results:
        with quiet_hub_logs():
            _probe_results[address] = connect_once(*address, PROBE_TIMEOUT_S)
    return _probe_results[address]


def is_offline(url: str | None = None, log: Callable[[str], None] | None = None) -> bool:
    """Whether look-ups on ``url``'s host (default: the hub) must stay in the local cache:
    ``HF_HUB_OFFLINE`` is set, or the host's probe failed (the hub's first failure prints one line
    to ``log`` and switches the process offline)."""
    hub = url is None
    if env_offline():  # "no downloads" whatever the host, as this package has always read it
        return True
    reason = unreachable_reason(url)
    if reason is None:
        return False
    if hub:
        go_offline()
        (log or _stderr)(f"the Hugging Face hub ({hf_endpoint()}) cannot be reached ({reason}): "
                         "using the local cache only for the rest of this run (HF_HUB_OFFLINE=1 "
                         "skips this check)")
    return True


def offline_reason(url: str | None = None) -> str:
    """Why downloads from ``url``'s host are off, for an error line (probes nothing)."""
    reason = _probe_results.get(_address(url or hf_endpoint()))
    if reason is not None:
        return f"{urlsplit(url or hf_endpoint()).hostname} cannot be reached ({reason})"
    if env_offline():
        return "downloads are off (HF_HUB_OFFLINE=1)"
    return "downloads are off (offline)"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["PROBE_TIMEOUT_S", "connect_once", "env_offline", "go_offline", "is_offline",
           "offline_reason", "quiet_hub_logs", "unreachable_reason"]
