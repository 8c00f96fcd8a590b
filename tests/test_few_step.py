"""Few-step sampling at the front doors (issue 39): diffusers' flow solvers as ``--sampling-method``,
``--nfe``, ``--method list``, the few-step scheduler of an export; bad input (an NFE a solver cannot
make, a shift <= 0, a scheduler that cannot run the objective) is one line, exit status 2 and nothing
written."""

from __future__ import annotations

import json
import re
import shlex
import warnings

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

import sample
from sit_vit5 import SiTPipeline
from sit_vit5.cli.sample_flags import describe_methods
from sit_vit5.experiments import nfe
from sit_vit5.experiments.__main__ import main as experiments_main
from sit_vit5.export import FEW_STEP_FOLDER
from sit_vit5.export import main as export_main
from sit_vit5.hub import SiTScheduler
from sit_vit5.names import FLOW_SOLVERS, LAST_STEPS, SDE_STEP_NFE
from sit_vit5.objective import create_objective
from sit_vit5.sample_spec import (
    FEW_STEP,
    FEW_STEPS,
    METHODS,
    SAMPLE_METHODS,
    SampleSpec,
    sampling_methods,
)
from sit_vit5.utils.errors import SettingError
from tests.gaussian_target import GaussianTarget
from tests.helpers import ROOT, assert_names, one_error_line, one_sample_error
from tests.test_nfe_study import tiny_checkpoint
from tests.test_pipeline import checkpoint, grid_images
from tests.test_pipeline_conventions import ddpm_checkpoint

FLOW = dict(use_flow_sigmas=True, prediction_type="flow_prediction")


@pytest.fixture(scope="module")
def pixel_ckpt(tmp_path_factory) -> str:
    """A tiny random 8x8 pixel-space SiT-objective checkpoint (ODE Euler by default)."""
    root = tmp_path_factory.mktemp("few")
    return checkpoint(root / "run", 1, "none", "sample.method=ode", "sample.sampling_method=euler")


# ----------------------------------------------------------------------------- --method list


def test_the_method_listing_names_every_method_and_solver_and_exits_0(capsys):
    for argv in (["--method"], ["grid", "--method", "list"], ["bulk", "--ckpt", "x.pt", "--method"]):
        with pytest.raises(SystemExit) as stop:  # no checkpoint needed, nothing read
            sample.main(argv)
        assert stop.value.code == 0
        out = capsys.readouterr().out
        assert out.strip() == describe_methods()
    assert_names(out, *METHODS, *SAMPLE_METHODS, *sampling_methods("ode"), *sampling_methods("sde"),
                 *(cls for cls, _ in FLOW_SOLVERS.values()),
                 *(k for k in LAST_STEPS if k not in (None, "none")))
    nfe = SampleSpec(**FEW_STEP).nfe
    assert f"--sampling-method {FEW_STEP['sampling_method']} --nfe {nfe}" in out
    with pytest.raises(SystemExit):
        sample.main(["grid", "--help"])
    assert "--method list" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")


def test_every_listed_transport_solver_samples_at_the_nfe_it_states():
    """What the listing offers runs, and costs what SampleSpec.nfe says (the sampler counts)."""
    objective = create_objective({"path_type": "Linear", "prediction": "velocity"})
    target = GaussianTarget(objective.transport.path_sampler, torch.tensor([0.8, -0.4]),
                            torch.tensor([0.6, 1.3]))
    z = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
    exact = target.flow(z.double(), 0.0, 1.0)
    for method in SAMPLE_METHODS["sit"]:
        for name in sampling_methods(method):
            spec = SampleSpec(method=method, sampling_method=name, num_steps=17)
            with warnings.catch_warnings():  # adaptive solvers warn that num_steps is the grid only
                warnings.simplefilter("ignore")
                built = objective.sampler(spec)
            x = built.sample(z, target.model("velocity"))[-1]
            assert torch.isfinite(x).all(), name
            if spec.nfe is not None:
                assert built.sampler.last_nfe == spec.nfe, (method, name)
            if method == "ode":  # every ODE solver lands near the exact flow at 16 steps
                assert float((x.double() - exact).abs().max()) < 0.25, name


# ----------------------------------------------------------------------------- --nfe


def test_nfe_sets_the_steps_of_each_solver():
    cases = {("ode", "euler"): 9, ("ode", "heun2"): 5, ("ode", "unipc"): 9, ("ode", "rk4"): 3,
             ("sde", "Euler"): 8, ("sde", "Heun"): None, ("ddim", None): 8, ("ddpm", None): 8}
    for (method, solver), steps in cases.items():
        spec = SampleSpec(method=method, sampling_method=solver)
        if steps is None:  # 2 a step plus the last step: an even NFE is out of reach
            with pytest.raises(SettingError) as err:
                spec.with_nfe(8)
            assert (err.value.key, err.value.value) == ("nfe", 8)
            continue
        assert spec.with_nfe(8).num_steps == steps and spec.with_nfe(8).nfe == 8, (method, solver)
    assert SampleSpec(method="sde", last_step="None").with_nfe(8).num_steps == 9  # no last step


def test_sample_py_nfe_is_the_same_images_as_the_steps_it_stands_for(pixel_ckpt, tmp_path, capsys):
    labels = [3, 1, 4]
    few = grid_images(pixel_ckpt, tmp_path / "nfe", labels, 5, "--method", "ode",
                      "--sampling-method", "unipc", "--nfe", "8")
    assert "NFE per image: 8" in capsys.readouterr().out
    steps = grid_images(pixel_ckpt, tmp_path / "steps", labels, 5, "--method", "ode",
                        "--sampling-method", "unipc", "--num-steps", "9")
    euler = grid_images(pixel_ckpt, tmp_path / "euler", labels, 5, "--nfe", "8")
    assert all(np.array_equal(a, b) for a, b in zip(few, steps, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(few, euler, strict=True))  # another solver


def few_step_page_lines() -> list[list[str]]:
    """The ``python sample.py ...`` lines of the manual's few-step page (its first bash block)."""
    page = (ROOT / "docs" / "few-step.md").read_text()
    block = re.search(r"```bash\n(.*?)```", page, re.S)
    assert block, "docs/few-step.md has no bash block"
    lines = [shlex.split(line) for line in block.group(1).splitlines()
             if line.startswith("python sample.py")]
    assert len(lines) >= 2
    return lines


def test_the_few_step_page_lines_run_at_the_nfe_they_state(pixel_ckpt, tmp_path, capsys):
    lines = few_step_page_lines()
    dit = [words for words in lines if "demo-dit" in words[words.index("--ckpt") + 1]]
    assert dit and len(dit) < len(lines)  # both objectives' settings are shown
    dit_ckpt = ddpm_checkpoint(tmp_path / "dit")
    for i, words in enumerate(lines):
        argv = words[2:]
        at = argv.index("--ckpt") + 1  # a tiny checkpoint of the objective of the page's run
        argv[at] = dit_ckpt if words in dit else pixel_ckpt
        out = tmp_path / str(i)
        assert sample.main([*argv, "--num-images", "2", "--out", str(out), "--no-progress"]) == 0
        nfe = argv[argv.index("--nfe") + 1]
        assert f"NFE per image: {nfe}" in capsys.readouterr().out
        assert (out / "grid.png").is_file()


@pytest.mark.parametrize("flags, names", [
    (["--method", "ode", "--sampling-method", "heun2", "--nfe", "1"], ("--nfe 1", "heun2", "2")),
    (["--method", "ode", "--sampling-method", "heun", "--nfe", "7"], ("--nfe 7", "heun", "2")),
    (["--method", "sde", "--nfe", "1"], ("--nfe 1", "sde", "last step")),
    (["--method", "ode", "--sampling-method", "dopri5", "--nfe", "8"], ("--nfe 8", "dopri5")),
    (["--method", "sde", "--sampling-method", "Heun", "--nfe", "8"], ("--nfe 8", "Heun", "last")),
    (["--nfe", "8", "--num-steps", "9"], ("--nfe 8", "--num-steps 9")),
    (["--method", "ode", "--sampling-method", "unipc", "--num-steps", "1000"],
     ("--num-steps 1000", "UniPCMultistepScheduler")),  # its integer timesteps repeat
    (["--method", "ode", "--sampling-method", "unipc", "--time-shift", "3", "--num-steps", "500"],
     ("--num-steps 500", "UniPCMultistepScheduler", "flow_shift 3")),
])
def test_sample_py_refuses_steps_a_solver_cannot_make(pixel_ckpt, tmp_path, capsys, flags, names):
    out = tmp_path / "out"
    for command in ("grid", "bulk"):
        argv = [command, "--ckpt", pixel_ckpt, "--out", str(out), "--no-progress", *flags]
        assert sample.main(argv) == 2
        assert_names(one_sample_error(capsys, command), *names)
        assert not out.exists()


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_sample_py_refuses_a_shift_that_is_not_positive_for_flow_solvers_too(tmp_path, capsys, bad):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:  # at parse time, before the checkpoint is read
        sample.main(["grid", "--ckpt", "nope.pt", "--method", "ode", "--sampling-method", "unipc",
                     f"--time-shift={bad}", "--out", str(out)])
    assert stop.value.code == 2 and not out.exists()
    assert_names(one_sample_error(capsys, "grid"), "--time-shift", bad)
    with pytest.raises(SettingError) as err:  # an exported scheduler config cannot carry one
        SiTScheduler(transport={}, sampler={"method": "ode", "sampling_method": "unipc",
                                            "time_shift": float(bad)})
    assert err.value.key == "sampler.time_shift"


def test_a_flow_solver_on_a_ddpm_model_is_one_line_naming_solver_and_objective(tmp_path, capsys):
    ckpt = ddpm_checkpoint(tmp_path / "dit")
    out = tmp_path / "out"
    argv = ["grid", "--ckpt", ckpt, "--method", "ode", "--sampling-method", "unipc", "--out", str(out)]
    assert sample.main(argv) == 2
    assert_names(one_sample_error(capsys, "grid"), "--method ode --sampling-method unipc", "ddpm")
    assert not out.exists()
    objective = create_objective({"objective": "ddpm"})
    with pytest.raises(SettingError) as err:  # from Python: a scheduler swapped into a pipeline
        objective.steps(SampleSpec(method="ddim", num_steps=8),
                        scheduler=UniPCMultistepScheduler(**FLOW))
    assert_names(str(err.value), "UniPCMultistepScheduler", "ddpm")
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the NFE study


@pytest.fixture(scope="module")
def study_ckpt(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("study"))


@pytest.mark.parametrize("args, names", [
    (["--solvers", "ode-heun", "--nfe", "1"], ("--nfe 1", "ode-heun", "heun2")),
    (["--nfe", "4", "3"], ("--nfe 3", "ode-heun")),  # the default solvers include Heun
    (["--solvers", "sde-euler-mean", "--nfe", "1"], ("--nfe 1", "sde-euler-mean", "last step")),
    (["--solvers", "unipc", "--nfe", "999"], ("--nfe 999", "unipc", "UniPCMultistepScheduler")),
    (["--solvers", "ode-euler", "ddim", "--nfe", "4"], ("--solvers ddim", "sit objective")),
    (["--nfe", "0"], ("--nfe", "'0'")),
    (["--num-samples", "-5"], ("--num-samples", "'-5'")),
    (["--cfg-scales", "nan"], ("--cfg-scales", "'nan'")),
    (["--time-shifts", "0"], ("--time-shifts", "'0'")),
    (["--solvers", "ode-dopri5", "--time-shifts", "2"], ("--time-shifts 2", "ode-dopri5", "own steps")),
])
def test_the_nfe_study_refuses_bad_arguments_before_writing(study_ckpt, tmp_path, capsys, args,
                                                             names):
    out = tmp_path / "nfe"
    argv = ["nfe", study_ckpt, "--out", str(out), "--num-samples", "4", *args]
    try:
        status = experiments_main(argv)
    except SystemExit as stop:  # argparse's own refusal
        status = stop.code
    assert status == 2
    assert_names(one_error_line(capsys), *names)
    assert not out.exists()


def test_the_default_solvers_are_the_checkpoints_own(study_ckpt, tmp_path, monkeypatch, capsys):
    """DDIM cannot make 64 steps of 1000 (DiT's ddimN stride): that refuses a DiT-objective
    checkpoint's default grid, naming DDIM, and does not touch a SiT one's."""
    monkeypatch.setattr(nfe, "run_row", lambda loaded, solver, spec, *a: {
        "nfe": spec.nfe or 1, "fid": 1.0, "accuracy": 1.0})
    out = tmp_path / "sit"
    assert experiments_main(["nfe", study_ckpt, "--out", str(out), "--nfe", "64"]) == 0
    rows = json.loads(next(out.glob("*.json")).read_text())
    assert {r["solver"] for r in rows.values()} == {n for n in [*nfe.SOLVERS, nfe.ADAPTIVE.name]
                                                    if nfe.solver_objective(n) == "sit"}
    dit, out = ddpm_checkpoint(tmp_path / "dit"), tmp_path / "dit-rows"
    for args, names in ((["--nfe", "64"], ("--nfe 64", "ddim", "64 of 1000")),
                        (["--solvers", "ddim", "--time-shifts", "3"], ("--time-shifts 3", "ddim",
                                                                       "ode / sde"))):
        assert experiments_main(["nfe", dit, "--out", str(out), *args]) == 2
        assert_names(one_error_line(capsys), *names)
        assert not out.exists()


def test_the_nfe_study_refuses_a_missing_checkpoint_before_the_first_row(study_ckpt, tmp_path,
                                                                          capsys):
    out = tmp_path / "nfe"
    argv = ["nfe", study_ckpt, str(tmp_path / "gone.pt"), "--out", str(out), "--nfe", "2"]
    assert experiments_main(argv) == 2
    assert_names(one_error_line(capsys), "gone.pt")
    assert not out.exists()


# ----------------------------------------------------------------------------- the export


def test_export_writes_the_few_step_scheduler_beside_the_default(pixel_ckpt, tmp_path, capsys):
    out = tmp_path / "export"
    assert export_main([pixel_ckpt, str(out)]) == 0
    default = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert default["_class_name"] == "SiTScheduler" and default["sampler"]["sampling_method"] == "euler"
    few = UniPCMultistepScheduler.from_pretrained(out, subfolder=FEW_STEP_FOLDER)
    assert few.config.use_flow_sigmas and few.config.prediction_type == "flow_prediction"
    assert few.config.flow_shift == 1.0 and few.config.sampler["num_steps"] == FEW_STEP["num_steps"]
    labels = [3, 1, 4]
    pipe = SiTPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    default_images = pipe(labels, generator=5, output_type="uint8").images
    pipe.scheduler = few
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda *args: calls.append(1))
    swapped = pipe(labels, generator=5, output_type="uint8").images  # its own steps: no argument
    hook.remove()
    assert len(calls) == SampleSpec(**FEW_STEP).nfe  # one batch: 8 evaluations
    by_hand = SiTPipeline.from_pretrained(out)
    by_hand.set_progress_bar_config(disable=True)
    by_hand.scheduler = UniPCMultistepScheduler(**FLOW)
    expected = by_hand(labels, generator=5, num_inference_steps=FEW_STEP["num_steps"],
                       output_type="uint8").images
    assert np.array_equal(swapped, expected)
    assert not np.array_equal(swapped, default_images)  # the default scheduler is unchanged
    # the few-step page's sample.py line gives the same pixels
    nfe = str(SampleSpec(**FEW_STEP).nfe)
    grid = grid_images(pixel_ckpt, tmp_path / "grid", labels, 5, "--method", FEW_STEP["method"],
                       "--sampling-method", FEW_STEP["sampling_method"], "--nfe", nfe)
    assert np.array_equal(swapped[..., 0], np.stack(grid))


def test_a_ddpm_export_has_its_own_few_step_scheduler_and_a_push_uploads_it(pixel_ckpt, tmp_path,
                                                                          monkeypatch):
    ckpt, ddpm = ddpm_checkpoint(tmp_path / "dit"), tmp_path / "ddpm"
    assert export_main([ckpt, str(ddpm)]) == 0
    setting = FEW_STEPS["ddpm"]
    few = DPMSolverMultistepScheduler.from_pretrained(ddpm, subfolder=FEW_STEP_FOLDER)
    assert few.config.algorithm_type == "sde-dpmsolver++" and few.config.prediction_type == "epsilon"
    assert few.config.thresholding and few.config.sample_max_value == 1.0  # pixel space: x0 clipped
    assert few.config.sampler["num_steps"] == setting["num_steps"]
    pipe = SiTPipeline.from_pretrained(ddpm)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = few
    labels = [3, 1]
    swapped = pipe(labels, generator=5, output_type="uint8").images  # its own steps, per-image noise
    nfe = str(SampleSpec(**setting).nfe)
    grid = grid_images(ckpt, tmp_path / "grid", labels, 5, "--method", setting["method"],
                       "--sampling-method", setting["sampling_method"], "--nfe", nfe)
    assert np.array_equal(swapped[..., 0], np.stack(grid))  # the few-step page's sample.py line
    import huggingface_hub

    pushed, uploaded = [], []
    monkeypatch.setattr(SiTPipeline, "push_to_hub", lambda self, repo_id, **kw: pushed.append(repo_id))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: uploaded.append(kw))
    out = tmp_path / "sit"
    assert export_main([pixel_ckpt, str(out), "--push-to-hub", "me/sit"]) == 0
    assert pushed == ["me/sit"]
    assert uploaded == [dict(repo_id="me/sit", folder_path=out / FEW_STEP_FOLDER,
                             path_in_repo=FEW_STEP_FOLDER)]


def test_sde_nfe_counts_the_last_step():
    for name, per_step in SDE_STEP_NFE.items():
        spec = SampleSpec(method="sde", sampling_method=name, num_steps=6)
        assert spec.nfe == 5 * per_step + 1 and spec.with_nfe(spec.nfe).num_steps == 6


def test_no_few_step_scheduler_where_its_steps_cannot_run():
    """A 10-step DiT schedule has no 12 distinct solver timesteps: nothing to write (export skips it)."""
    from sit_vit5.export import few_step_scheduler

    short = {"objective": "ddpm", "diffusion_steps": 10, "noise_schedule": "cosine"}
    assert few_step_scheduler(short, {}, pixel_space=False) is None
    scheduler, spec = few_step_scheduler({"objective": "ddpm"}, {}, pixel_space=False)
    assert type(scheduler).__name__ == "DPMSolverMultistepScheduler" and spec.num_steps == 12
