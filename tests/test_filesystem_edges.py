"""Issue 54, the filesystem edges: symlink loops in an image folder, two runs in one out_dir,
duplicated YAML keys, and the inputs that ended in a raw traceback (one stderr line, status 2)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from sit_vit5.image_data import ImageFolderDataset, list_image_folder
from tests.helpers import make_image_folder

# ----------------------------------------------------------------------------- symlink loops


def _listing(root: Path) -> tuple[list[str], list[str]]:
    """(files, warning messages) of ``list_image_folder(root)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files, _, _ = list_image_folder(root)
    return files, [str(w.message) for w in caught]


def test_two_self_links_are_skipped_not_walked_forever(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 3, "b": 2})
    os.symlink(".", root / "a" / "x")  # was: os.walk follows x/y/x/y/... 2^40 paths (a hang)
    os.symlink(".", root / "a" / "y")
    files, messages = _listing(root)
    assert files == ["a/0.png", "a/1.png", "a/2.png", "b/0.png", "b/1.png"]
    assert len(messages) == 2 and "a/x" in messages[0] and "a/y" in messages[1]
    assert all("already listed" in m for m in messages)


def test_one_self_link_does_not_duplicate_the_images(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 3})
    os.symlink(".", root / "a" / "self")  # was: 3 images counted 41 times (123 items)
    with pytest.warns(UserWarning, match="a/self"):
        dataset = ImageFolderDataset(root, 8)
    assert len(dataset) == 3


def test_links_to_the_root_or_another_class_are_skipped(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 2, "b": 1})
    os.symlink("..", root / "a" / "up")  # a loop through the root: b's images would join a
    os.symlink("../b", root / "a" / "b-again")
    files, messages = _listing(root)
    assert files == ["a/0.png", "a/1.png", "b/0.png"] and len(messages) == 2


def test_a_linked_folder_is_still_followed_once(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 1})
    extra = make_image_folder(tmp_path / "elsewhere", {"more": 2}) / "more"
    os.symlink(extra, root / "a" / "more")  # an ordinary link (no loop): followed as before
    os.symlink(extra, root / "a" / "more2")  # a second way into the same folder: once
    files, messages = _listing(root)
    assert files == ["a/0.png", "a/more/0.png", "a/more/1.png"]
    assert len(messages) == 1 and "a/more2" in messages[0]


# ----------------------------------------------------------------------------- YAML duplicate keys


def test_a_duplicated_section_is_refused_with_both_lines(tmp_path):
    from sit_vit5.config import ConfigError, configs_dir, load_config

    text = (configs_dir() / "demo.yaml").read_text()
    first = 1 + text.splitlines().index("train:")
    path = tmp_path / "dup.yaml"
    path.write_text(text + "train:\n  steps: 30\n")  # was: the first train: section silently lost
    last = len(path.read_text().splitlines()) - 1
    with pytest.raises(ConfigError, match=f"duplicate key 'train' on lines {first} and {last}"):
        load_config(path)


def test_a_duplicated_key_inside_a_section_is_refused(tmp_path, capsys):
    from tests.helpers import run_train

    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 3\n  log_every: 1\n  steps: 4\n")  # was: steps=4, silently
    status, line = run_train(["--config", path], capsys)
    assert status == 2 and str(path) in line and "duplicate key 'steps' on lines 2 and 4" in line


def test_yaml_stays_safe_and_merges_still_override(tmp_path):
    from sit_vit5.config import ConfigError, _load_yaml

    assert _load_yaml("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n") == {
        "a": {"b": 1, "c": 2}, "d": {"b": 3, "c": 2}}
    with pytest.raises(Exception, match="could not determine a constructor"):
        _load_yaml("!!python/object/apply:os.system ['true']")
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- one run per out_dir

HOLD = ("import sys, time; from sit_vit5.run_files import hold_run_dir; "
        "held = hold_run_dir(sys.argv[1]); held.__enter__(); print('held', flush=True); time.sleep(120)")


def _holder(run_dir: Path):
    """A process holding ``run_dir`` as a living run's rank 0 does (until killed)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_living_runs_folder_is_refused(tmp_path, capsys):
    from tests.helpers import TRAIN_ARGV, run_train

    run_dir = tmp_path / "D"
    holder = _holder(run_dir)
    try:
        status, line = run_train([*TRAIN_ARGV, f"train.out_dir={run_dir}", "train.steps=2"], capsys)
        # was: both ran, config.yaml of one and checkpoints of the other
        assert status == 2 and f"train.out_dir={run_dir}" in line and f"pid {holder.pid}" in line
        assert sorted(p.name for p in run_dir.iterdir()) == [".train.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_resume_after_the_holder_died(tmp_path, capsys):
    from tests.helpers import TRAIN_ARGV, run_train

    run_dir = tmp_path / "D"
    argv = [*TRAIN_ARGV, f"train.out_dir={run_dir}", "train.ckpt_every=2"]
    assert run_train([*argv, "train.steps=2"], capsys) == (0, "")
    holder = _holder(run_dir)
    holder.kill()  # SIGKILL: no cleanup ran, the kernel dropped the lock
    holder.wait()
    assert run_train([*argv, "train.steps=4", "--resume", "latest"], capsys) == (0, "")
    assert (run_dir / "checkpoints" / "0000004.pt").is_file()


def test_only_rank_0_holds_the_folder(tmp_path, monkeypatch):
    from sit_vit5.launcher import launcher_rank
    from sit_vit5.run_files import hold_run_dir

    assert launcher_rank({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == 1
    assert launcher_rank({}) == 0
    holder = _holder(tmp_path / "D")
    try:
        with hold_run_dir(tmp_path / "D", main=False) as lock:  # another rank: no wait, no lock
            assert lock is None
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_fresh_run_leaves_no_folder(tmp_path, capsys):
    from tests.helpers import TRAIN_ARGV, run_train

    run_dir = tmp_path / "new" / "D"
    status, line = run_train([*TRAIN_ARGV, f"train.out_dir={run_dir}", "data.kind=imagefolder",
                              f"data.root={tmp_path / 'missing'}"], capsys)
    assert status == 2 and "missing" in line and not (tmp_path / "new").exists()
