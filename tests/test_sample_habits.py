"""sample.py as SiT/DiT users type it (mode word, flag aliases) and with official names for
--ckpt."""

from __future__ import annotations

import io

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image

import sample
from sit_vit5.cli import sample as cli_sample
from sit_vit5.cli.sample import VAE_WORDS
from sit_vit5.models.official import SIT_REPO
from tests.hub_cache import add_to_hub_cache
from tests.test_pipeline import checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("run"), 1, "none", "sample.method=ode",
                      "sample.sampling_method=euler")


def pngs(folder, n: int) -> np.ndarray:
    return np.stack([np.asarray(Image.open(folder / f"{i:06d}.png")) for i in range(n)])


def test_sit_user_command_line_equals_ours(ckpt, tmp_path, capsys):
    sit = ["ODE", "--ckpt", ckpt, "--num-sampling-steps", "50", "--per-proc-batch-size", "8",
           "--global-seed", "3", "--sample-dir", str(tmp_path / "sit"), "--classes", "1", "2", "3",
           "--no-progress"]
    assert sample.main(sit) == 0
    printed = capsys.readouterr().out
    assert "method=ode" in printed and "num_steps=50" in printed and "NFE per image: 49" in printed
    ours = ["grid", "--ckpt", ckpt, "--method", "ode", "--num-steps", "50", "--batch-size", "2",
            "--seed", "3", "--out", str(tmp_path / "ours"), "--classes", "1", "2", "3", "--no-progress"]
    assert sample.main(ours) == 0
    assert np.array_equal(pngs(tmp_path / "sit", 3), pngs(tmp_path / "ours", 3))


def test_sde_word_with_fid_flags_is_bulk(ckpt, tmp_path, capsys):
    sit = ["SDE", "--ckpt", ckpt, "--num-fid-samples", "4", "--sample-dir", str(tmp_path / "sit"),
           "--num-sampling-steps", "4", "--global-seed", "1", "--no-progress"]
    assert sample.main(sit) == 0
    assert "method=sde" in capsys.readouterr().out
    ours = ["bulk", "--ckpt", ckpt, "--method", "sde", "--num-samples", "4", "--num-steps", "4",
            "--seed", "1", "--out", str(tmp_path / "ours"), "--no-progress"]
    assert sample.main(ours) == 0
    with np.load(tmp_path / "sit" / "samples_4x8x8x3.npz") as a, \
            np.load(tmp_path / "ours" / "samples_4x8x8x3.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])


def test_aliases_map_onto_our_flags():
    parser = sample.build_parser()
    argv = sample.translate_mode_word(["bulk", "SDE", "--ckpt", "x.pt", "--num-sampling-steps", "7",
                                       "--per-proc-batch-size", "5", "--num-fid-samples", "9",
                                       "--sample-dir", "out", "--global-seed", "11", "--no-tf32"])
    args = parser.parse_args(argv)
    assert (args.command, args.method, args.num_steps, args.batch_size, args.num_samples, args.out,
            args.seed, args.tf32) == ("bulk", "sde", 7, 5, 9, "out", 11, False)
    assert parser.parse_args(["grid", "--ckpt", "x.pt", "--tf32"]).tf32 is True
    assert parser.parse_args(["grid", "--ckpt", "x.pt"]).tf32 is None  # default: PyTorch's own setting
    assert VAE_WORDS == {"ema": "stabilityai/sd-vae-ft-ema", "mse": "stabilityai/sd-vae-ft-mse"}
    assert sample.translate_mode_word(["grid", "--ckpt", "ODE"]) == ["grid", "--ckpt", "ODE"]  # a value


def test_tf32_flags_set_the_backends():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        from sit_vit5.cli.sample import set_tf32

        set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("argv", [["ODE", "--ckpt", "x.pt", "--likelihood"],  # SiT flags we lack
                                  ["ODE", "--ckpt", "x.pt", "--num-classes", "10"],
                                  ["ODE", "--ckpt", "x.pt", "--method", "sde"],  # two modes
                                  ["grid", "--ckpt", "x.pt", "--num-fid-samples", "4"]])  # bulk-only
def test_unknown_or_contradictory_flags_stay_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        sample.main(argv)
    assert exit_.value.code == 2 and "error" in capsys.readouterr().err


def test_official_name_is_fetched_from_the_hub_cache_with_its_licence(ckpt, tmp_path, monkeypatch, capsys):
    with open(ckpt, "rb") as f:  # stands in for SiT-XL-2-256.pt (tiny, same loading path)
        add_to_hub_cache(tmp_path / "hub", SIT_REPO, "SiT-XL-2-256.pt", f.read())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    flags = ["--classes", "4", "5", "--num-steps", "3", "--no-progress"]
    assert sample.main(["grid", "--ckpt", "SiT-XL-2-256.pt", "--model", "ViT5-S/2", *flags,
                        "--out", str(tmp_path / "named")]) == 0
    err = capsys.readouterr().err
    assert f"{SIT_REPO}/SiT-XL-2-256.pt" in err and "licence" in err
    assert sample.main(["grid", "--ckpt", ckpt, *flags, "--out", str(tmp_path / "local")]) == 0
    assert np.array_equal(pngs(tmp_path / "named", 2), pngs(tmp_path / "local", 2))
    capsys.readouterr()
    assert sample.main(["grid", "--ckpt", "SiT-B-2-256.pt", "--no-progress"]) == 2  # not cached, offline
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"hf download {SIT_REPO} SiT-B-2-256.pt" in err


def test_dit_files_are_read_with_dits_objective_not_misread(tmp_path, monkeypatch, capsys):
    # issue 11: DiT's files are sampled with DiT's ddpm objective (this test first asserted a
    # refusal, before that objective existed); the file here is junk, so loading it must fail
    # *after* the official table has told the loader the objective
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    told = {}
    real_load = cli_sample.load_model

    def spy(path, model_name=None, which="ema", **kwargs):
        told.update(model=model_name, **kwargs)
        return real_load(path, model_name, which, **kwargs)

    monkeypatch.setattr(cli_sample, "load_model", spy)
    old = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path))
    try:
        (tmp_path / "checkpoints").mkdir()
        buffer = io.BytesIO()
        torch.save({"x": torch.zeros(1)}, buffer)
        (tmp_path / "checkpoints" / "DiT-XL-2-256x256.pt").write_bytes(buffer.getvalue())
        assert sample.main(["grid", "--ckpt", "DiT-XL-2-256x256.pt", "--no-progress"]) == 2
        assert told == {"model": "SiT-XL/2", "objective": "ddpm"}
        assert "not a SiT/DiT state dict" in capsys.readouterr().err  # the junk file, not misread
        assert sample.main(["grid", "--ckpt", "DiT-XL-2-256x256.pt", "--objective", "sit",
                            "--no-progress"]) == 2
        assert "is a ddpm-objective model" in capsys.readouterr().err
    finally:
        torch.hub.set_dir(old)


def test_dits_bare_command_line_is_a_grid(ckpt, tmp_path, capsys):
    """DiT's sample.py has no subcommand: ``sample.py --ckpt F ...`` is our grid, the same pixels."""
    dit = ["--ckpt", ckpt, "--num-sampling-steps", "4", "--seed", "2", "--cfg-scale", "1",
           "--sample-dir", str(tmp_path / "dit"), "--classes", "4", "5", "--no-progress"]
    assert sample.main(dit) == 0
    ours = ["grid", "--ckpt", ckpt, "--num-steps", "4", "--seed", "2", "--out", str(tmp_path / "ours"),
            "--classes", "4", "5", "--no-progress"]
    assert sample.main(ours) == 0
    assert np.array_equal(pngs(tmp_path / "dit", 2), pngs(tmp_path / "ours", 2))
    assert sample.translate_mode_word(["--ckpt", "x", "--num-fid-samples", "8"])[0] == "bulk"
    assert sample.translate_mode_word(["--help"]) == ["--help"]


@pytest.mark.parametrize("model, expected", [("DiT-XL/2", "DiT-XL-2-256x256.pt"),
                                             ("SiT-XL/2", "SiT-XL-2-256.pt")])
def test_no_ckpt_means_the_official_file_of_the_model(tmp_path, capsys, monkeypatch, model, expected):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # no DiT file found in a real cache
    assert sample.main(["--model", model, "--image-size", "256", "--out", str(tmp_path / "g"),
                        "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert sample.main(["--model", "ViT5-S/2", "--out", str(tmp_path / "g")]) == 2
    assert "--ckpt is required" in capsys.readouterr().err


def test_sits_last_step_none_and_sample_ddp(ckpt, tmp_path):
    import sample_ddp

    flags = ["--ckpt", ckpt, "--num-sampling-steps", "4", "--no-progress", "--global-seed", "1"]
    assert sample.main(["SDE", *flags, "--last-step", "None", "--sample-dir", str(tmp_path / "a")]) == 0
    assert sample.main(["SDE", *flags, "--last-step", "none", "--sample-dir", str(tmp_path / "b")]) == 0
    assert np.array_equal(pngs(tmp_path / "a", 16), pngs(tmp_path / "b", 16))
    assert sample_ddp.main(["SDE", *flags, "--num-fid-samples", "4", "--sample-dir", str(tmp_path / "d")]) == 0
    assert sample.main(["bulk", "--method", "sde", *flags, "--num-samples", "4", "--out", str(tmp_path / "e")]) == 0
    with np.load(tmp_path / "d" / "samples_4x8x8x3.npz") as a, np.load(tmp_path / "e" / "samples_4x8x8x3.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"])
