"""Packaging: every package is listed, configs/ ships inside the package and is found from any
directory, and a non-editable install runs the ``sit-vit5-train`` console script on the demo
config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from fid import digits as fid_digits
from sit_vit5 import config as config_module
from sit_vit5.config import ConfigError, configs_dir, find_config, load_config

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_is_listed_and_configs_map_to_the_top_level_folder():
    tool = PYPROJECT["tool"]["setuptools"]
    found = setuptools.find_packages(str(ROOT), include=["sit_vit5*", "fid*"])
    assert set(found) <= set(tool["packages"]), "a new package is missing from pyproject's packages list"
    assert tool["package-dir"] == {"sit_vit5.configs": "configs"}
    configs = ROOT / tool["package-dir"]["sit_vit5.configs"]
    for package in tool["packages"]:  # each listed package is on disk (a moved one is not expected)
        in_configs = package.startswith("sit_vit5.configs")
        folder = configs.joinpath(*package.split(".")[2:]) if in_configs else ROOT / package.replace(".", "/")
        assert folder.is_dir() and (in_configs or (folder / "__init__.py").is_file()), package
    # every configs/ folder holding YAML ships: listed as a package, its YAML as package data
    yaml_folders = sorted({path.parent for path in configs.rglob("*.yaml")})
    assert len(yaml_folders) >= 4, yaml_folders
    for folder in yaml_folders:
        package = ".".join(["sit_vit5", "configs", *folder.relative_to(configs).parts])
        assert package in tool["packages"] and tool["package-data"][package] == ["*.yaml"], package
    # the digits study lives beside its results, outside the wheel: no listed package holds it
    study = ROOT / "results" / "digits" / "study"
    assert (study / "__main__.py").is_file() and not (ROOT / "sit_vit5" / "experiments" / "digits.py").exists()
    assert not any(p.split(".")[0] not in {"sit_vit5", "fid"} for p in tool["packages"])
    scripts = PYPROJECT["project"]["scripts"]
    assert {"sit-vit5-train", "sit-vit5-sample", "sit-vit5-fid"} <= set(scripts)
    for target in scripts.values():  # each entry point names a real function
        module, _, func = target.partition(":")
        assert callable(getattr(__import__(module, fromlist=[func]), func))
    assert (ROOT / "sit_vit5" / "py.typed").is_file() and (ROOT / "LICENSE").is_file()


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    demo = configs_dir() / "demo.yaml"
    assert demo.is_file()
    for spelling in ("configs/demo.yaml", "demo.yaml", "demo"):
        assert find_config(spelling) == demo
    assert find_config("imagenet/sit-xl-2") == configs_dir() / "imagenet" / "sit-xl-2.yaml"
    assert load_config("configs/imagenet/vit5-b-2.yaml")["model"]["name"] == "ViT5-B/2"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("train:\n  steps: 7\n")
    assert find_config("configs/demo.yaml") == Path("configs/demo.yaml")  # a local file wins
    with pytest.raises(ConfigError, match=r"imagenet/sit-xl-2\.yaml"):  # the error lists the shipped ones
        find_config("nope.yaml")


@pytest.mark.parametrize("installed", [True, False])
def test_configs_dir_prefers_the_installed_copy(tmp_path, monkeypatch, installed):
    package = tmp_path / "site" / "sit_vit5"
    package.mkdir(parents=True)
    target = package / "configs" if installed else tmp_path / "site" / "configs"  # wheel vs checkout layout
    target.mkdir()
    monkeypatch.setattr(config_module, "__file__", str(package / "config.py"))
    assert configs_dir() == target


@pytest.mark.slow
def test_non_editable_install_runs_the_train_console_script_on_the_demo_config(tmp_path):
    source = tmp_path / "src"  # a clean copy: the build writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for name in ("sit_vit5", "fid", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", str(source), "--target", str(target), "--no-deps",
                    "--no-build-isolation", "-q"], check=True, capture_output=True, timeout=300)
    assert (target / "sit_vit5" / "configs" / "imagenet" / "sit-xl-2.yaml").is_file()
    assert (target / "sit_vit5" / "py.typed").is_file()
    for name, _ in fid_digits.SHIPPED_WEIGHTS.values():  # the reference digits feature networks
        assert (target / "fid" / "weights" / name).is_file(), name
    work = tmp_path / "elsewhere"  # no configs/ here: the shipped copy must be used
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(target / "bin" / "sit-vit5-train"), "train.steps=2",
                          "train.log_every=1", "train.ckpt_every=2", "train.sample_every=0", "train.out_dir=run"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ViT5-S/2" in run.stdout and (work / "run" / "checkpoints" / "0000002.pt").is_file()
    where = subprocess.run([sys.executable, "-c", "import sit_vit5; print(sit_vit5.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target))  # the installed copy ran, not this checkout
