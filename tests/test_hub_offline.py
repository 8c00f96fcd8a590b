"""Hub look-ups without a network fail at once, in one line naming the setting and the fix.

No network is used: ``socket.create_connection`` (what the probe and httpx's transport open) is
replaced by one that counts its calls and fails, so "fast" is asserted as "one connection attempt,
no retry", never timed.
"""

from __future__ import annotations

import logging
import socket
import threading

import huggingface_hub.constants
import pytest
import torch

from sit_vit5.models import WeightsUnavailableError, resolve_checkpoint
from sit_vit5.training import repa as R
from sit_vit5.utils import hub_access
from sit_vit5.utils.errors import ConfigError
from sit_vit5.vae import load_vae


@pytest.fixture
def no_network(monkeypatch):
    """Online mode asked for, every TCP connection refused and counted; the probe cache is fresh."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_access, "_probe_results", {})
    attempts: list[tuple] = []

    def refuse(address, *args, **kwargs):
        attempts.append(address)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.fixture
def hub_warnings():
    """The hub loggers' warnings (its retry lines), caught at any level the code sets."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("huggingface_hub")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_probe_runs_once_then_the_process_is_offline(no_network):
    lines: list[str] = []
    assert hub_access.is_offline(log=lines.append)
    assert hub_access.is_offline(log=lines.append)
    assert len(no_network) == 1 and len(lines) == 1  # one probe, one line
    assert "huggingface.co" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # timm and diffusers now stay in the cache


def test_hf_hub_offline_skips_the_probe(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_access, "connect_once", lambda *a: pytest.fail("probed while offline"))
    assert hub_access.is_offline() and hub_access.is_offline(hub_access.GITHUB)
    assert "HF_HUB_OFFLINE=1" in hub_access.offline_reason()


def test_a_host_that_answers_is_online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_access, "_probe_results", {})
    monkeypatch.setattr(hub_access, "connect_once", lambda *a: None)
    assert not hub_access.is_offline()


def test_probe_gives_up_after_its_timeout_without_retrying(monkeypatch):
    release, calls = threading.Event(), []

    def hang(address, timeout=None):  # a name lookup that never returns (ignores the timeout)
        calls.append(address)
        release.wait(5)
        raise OSError("late")

    monkeypatch.setattr(socket, "create_connection", hang)
    try:
        assert "0.05" in hub_access.connect_once("hub.invalid", 443, 0.05)
    finally:
        release.set()
    assert calls == [("hub.invalid", 443)]


def test_vae_hub_id_offline_names_vae_name_with_one_connection(no_network, hub_warnings, tmp_path):
    with pytest.raises(OSError) as err:
        load_vae("someone/missing-vae", cache_dir=tmp_path)
    message = str(err.value)
    assert "vae.name=someone/missing-vae" in message and "hf download someone/missing-vae" in message
    assert "\n" not in message
    assert len(no_network) == 1 and not hub_warnings  # the probe only: no download, no retry


def test_vae_key_is_the_callers(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="--vae=someone/missing-vae"):
        load_vae("someone/missing-vae", cache_dir=tmp_path, key="--vae")


def test_official_ckpt_offline_names_the_flag_with_one_connection(no_network, hub_warnings, tmp_path):
    with pytest.raises(WeightsUnavailableError) as err:
        resolve_checkpoint("SiT-XL-2-256.pt", cache_dir=tmp_path)
    message = str(err.value)
    assert "--ckpt SiT-XL-2-256.pt" in message and "hf download" in message
    assert len(no_network) == 1 and not hub_warnings


def test_timm_encoder_offline_names_repa_encoder_with_one_connection(no_network, hub_warnings):
    pytest.importorskip("timm")
    spec = "timm:vit_tiny_patch16_224.augreg_in21k"
    with pytest.raises(ConfigError) as err:
        R.load_encoder({"encoder": spec}, 8, (4, 4), 1)
    message = str(err.value)
    assert f"repa.encoder={spec}" in message and "hf download timm/" in message
    assert len(no_network) == 1 and not hub_warnings


def test_torch_hub_encoder_offline_without_a_cached_copy(no_network, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(ConfigError) as err:
        R._hub_encoder("hub:owner/repo:tiny", "owner/repo:tiny")
    assert "repa.encoder=hub:owner/repo:tiny" in str(err.value) and "github.com" in str(err.value)
    assert len(no_network) == 1


def test_torch_hub_encoder_offline_loads_the_cached_checkout(no_network, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    checkout = tmp_path / "owner_repo_master"
    checkout.mkdir()
    (checkout / "hubconf.py").write_text("import torch\n\ndef tiny():\n    return torch.nn.Linear(2, 3)\n")
    net = R._hub_encoder("hub:owner/repo:tiny", "owner/repo:tiny")
    assert isinstance(net, torch.nn.Linear) and net.out_features == 3
    assert len(no_network) == 1  # the probe; torch.hub never asked GitHub for the branch
