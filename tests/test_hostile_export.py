"""Hostile inputs to ``python -m sit_vit5.export``: an output under a file, a --push-to-hub that
fails with the hub client's own (non-OSError) exception. One stderr line ``python -m
sit_vit5.export: error: ...`` naming the path, exit 2, no traceback; nothing half-written."""

from __future__ import annotations

import pytest

from sit_vit5.export import ExportError, main
from sit_vit5.pipeline import SiTPipeline
from sit_vit5.utils.errors import SitVit5Error
from tests.test_pipeline import checkpoint

PROG = "python -m sit_vit5.export"


def refused(capsys, argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), (
        err
    )
    return lines[0]


def test_output_under_a_file_is_named_before_the_work(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "run", 1)
    blocker = tmp_path / "file"
    blocker.write_text("keep")
    line = refused(
        capsys, [ckpt, blocker / "export"]
    )  # was a bare "[Errno 17] File exists: '...file'"
    assert (
        str(blocker / "export") in line and f"({blocker} " in line
    )
    assert blocker.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == [
        "file",
        "run",
    ]


def test_failed_push_names_the_written_folder_and_the_upload_command(tmp_path, capsys, monkeypatch):
    class ConnectError(
        Exception
    ):  # what huggingface_hub's httpx transport raises offline: no OSError
        pass

    def offline(self, repo_id, **kwargs):
        raise ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(SiTPipeline, "push_to_hub", offline)
    ckpt = checkpoint(tmp_path / "run", 1)
    out = tmp_path / "export"
    line = refused(capsys, [ckpt, out, "--push-to-hub", "me/sit"])
    assert (
        str(out) in line and "me/sit" in line and "ConnectError: [Errno 111] Connection refused" in line
    )
    assert f"`hf upload me/sit {out}`" in line
    assert (out / "model_index.json").is_file() and (out / "transformer" / "config.json").is_file()
    assert not list(tmp_path.glob(".export.tmp-*"))


def test_export_error_is_a_sit_vit5_error():
    assert issubclass(ExportError, SitVit5Error) and issubclass(ExportError, ValueError)
    with pytest.raises(ValueError):
        raise ExportError("still caught as a ValueError")
