"""One-line errors (sit_vit5.utils.errors): DataLoader worker messages unwrapped, SIT_VIT5_DEBUG
re-raises."""

from __future__ import annotations

import pytest

from sit_vit5.config import ConfigError
from sit_vit5.utils.errors import DEBUG_ENV, one_line
from tests.helpers import load_train_cli


def test_one_line_unwraps_dataloader_worker_messages():
    wrapped = RuntimeError("Caught UnreadableImageError in DataLoader worker process 0.\n"
                           "Original Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                           "sit_vit5.image_data.UnreadableImageError: "
                           "cannot read image /d/a.jpg: OSError: broken")
    assert one_line(wrapped) == "cannot read image /d/a.jpg: OSError: broken"
    assert one_line(ValueError("a\n  b")) == "a b"


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError, match="optim.lr=-1"):
        load_train_cli().main([f"train.out_dir={tmp_path}", "optim.lr=-1"])


def test_run_cli_turns_sigterm_into_one_line_and_status_3(capsys):
    """SIGTERM (a scheduler's pre-emption) runs the cleanups (an exception, not a kill), prints one
    line saying whether a rerun continues, exits 3; the previous handler is restored."""
    import signal
    import time

    from sit_vit5.utils.errors import run_cli

    cleaned = []

    def job() -> int:
        try:
            signal.raise_signal(signal.SIGTERM)  # delivered to this thread, synchronously
            time.sleep(30)  # not reached: the handler raises first (a sleep it would interrupt)
            return 0
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    assert run_cli("job", job, resumable=True) == 3
    assert capsys.readouterr().err.strip() == "job: terminated (SIGTERM); rerun the same command to continue"
    assert cleaned == [True] and signal.getsignal(signal.SIGTERM) == before
