"""Export a checkpoint as a diffusers pipeline folder.

    python -m sit_vit5.export RUN_OR_CKPT OUT_DIR [--push-to-hub user/name] [--format dit]

RUN_OR_CKPT: a run directory (its newest checkpoint), a checkpoint file, or an official name such
as ``SiT-XL-2-256.pt``. OUT_DIR receives what ``SiTPipeline.from_pretrained`` needs to reproduce
``sample.py grid``'s images for the same seed and settings:

    model_index.json
    transformer/   config.json + diffusion_pytorch_model.safetensors (the EMA weights by default)
    scheduler/     scheduler_config.json: transport, default sampler settings, the VAE's id and
                   latent normalisation (scaling_factor, shift_factor: numbers or per channel)
    scheduler_fewstep/  results/nfe's few-step setting, a diffusers scheduler to swap in: SiT
                   objective UniPCMultistepScheduler, flow sigmas, 8 NFE (a path that ends at
                   t = 1); DiT's DPMSolverMultistepScheduler, 2M SDE, 12 NFE
    vae/           the decoder (an AutoencoderKL; absent for pixel-space models)

``--format dit`` (a DiT-objective model) writes diffusers' own DiTPipeline layout instead, with
the same ``scheduler_fewstep/`` (DiTPipeline takes the steps from its caller:
``num_inference_steps=12``).
RUN_OR_CKPT may also be a diffusers DiT folder. The folder is written beside OUT_DIR and renamed
into place: a crash leaves no half-written export."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .hub import SiTPipeline, read_id2label, scheduler_from
from .latent_norm import LatentNorm
from .models import CheckpointError, LoadedModel, load_model, resolve_checkpoint
from .models.diffusers_dit import dit_folder, dit_pipeline
from .models.official import OfficialWeights
from .objective import create_objective, ddpm_settings
from .sample_spec import FEW_STEPS, SampleSpec
from .training.checkpoint import latest_checkpoint
from .utils.atomic_files import unwritable_dir_reason
from .utils.errors import (
    KNOWN_ERRORS,
    SettingError,
    SitVit5Error,
    exception_chain,
    find_errno,
    one_line,
    run_cli,
)
from .utils.precision import PRECISIONS, check_precision
from .vae import load_vae, vae_enabled

PROG = "python -m sit_vit5.export"


class ExportError(SitVit5Error, ValueError):
    """A source or destination the exporter refuses (exit status 2)."""


def checkpoint_path(run_or_ckpt: str | os.PathLike) -> tuple[Path, OfficialWeights | None]:
    """The checkpoint file a run directory, file or official name stands for, with its
    official-table entry (None for other files)."""
    path = Path(run_or_ckpt)
    if path.is_dir() and dit_folder(path) is not None:  # diffusers' DiT layout: load_model reads it
        return path, None
    if path.is_dir():
        latest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if latest is None:
            raise ExportError(
                f"{path}: no checkpoints in {path / 'checkpoints'} (is it a run directory?)"
            )
        return latest, None
    return resolve_checkpoint(run_or_ckpt)


def load_source(run_or_ckpt: str | os.PathLike, which: str = "ema", model_name: str | None = None
                ) -> LoadedModel:
    """The model a run directory, checkpoint file, official name or DiT folder stands for."""
    ckpt, official = checkpoint_path(run_or_ckpt)
    objective = official.objective if official is not None else None
    return load_model(ckpt, model_name or (official and official.model), which, objective=objective)


def bundled_vae(loaded: LoadedModel, vae_name: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The decoder to bundle (None for pixel space; ``vae_name`` overrides) and its settings."""
    vae_cfg = {**loaded.vae, **({"name": vae_name} if vae_name else {})}
    vae = None
    if vae_enabled(vae_cfg.get("name")):
        vae = load_vae(vae_cfg["name"])
        # diffusers pipelines read the normalisation from the VAE's config: record the run's (the
        # scheduler's vae section keeps it exactly)
        vae.register_to_config(**LatentNorm.from_section(vae_cfg).vae_config())
    return vae, vae_cfg


def build_pipeline(run_or_ckpt: str | os.PathLike, which: str = "ema",
                   model_name: str | None = None, vae_name: str | None = None,
                   id2label: dict[int, str] | None = None) -> SiTPipeline:
    """The pipeline a checkpoint describes (weights ``which``, transport, sampler defaults, decoder;
    ``vae_name`` overrides); ``id2label`` names the classes (None: ImageNet's for 1000 classes)."""
    loaded = load_source(run_or_ckpt, which, model_name)
    if id2label is not None:  # a partial table would name some classes and leave the rest blank
        missing = sorted(set(range(loaded.num_classes)) - {int(k) for k in id2label})
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise ExportError(f"id2label names {len(id2label)} classes but the model has "
                              f"{loaded.num_classes}: class id(s) {shown} ({len(missing)} in all) "
                              "have no name; give one name per class")
    vae, vae_cfg = bundled_vae(loaded, vae_name)
    # as sample.py: the checkpoint's sample section, else the objective's first method (ddpm: DiT's)
    default_method = create_objective(loaded.objective).methods[0]
    sample = SampleSpec.resolve(loaded.sample, {"method": default_method})
    scheduler = scheduler_from(loaded.objective, sample, vae_cfg)
    return SiTPipeline(transformer=loaded.model, scheduler=scheduler, vae=vae, id2label=id2label)


#: the subfolder of the few-step scheduler (:func:`save_few_step_scheduler`)
FEW_STEP_FOLDER = "scheduler_fewstep"


def few_step_scheduler(objective_settings: dict[str, Any], sampler: dict[str, Any],
                       pixel_space: bool) -> tuple[Any, SampleSpec] | None:
    """The objective's few-step setting (``FEW_STEPS``; sit: diffusers' UniPC with flow sigmas, 9
    grid points = 8 NFE; ddpm: DPM-Solver++ 2M SDE at 12 NFE, clipping x0 in pixel space) as the
    diffusers scheduler sample.py steps with, and its spec (``sampler``: the other settings). None
    when the model cannot run it (a SiT path that stops short of t = 1, a DiT schedule with fewer
    distinct integer timesteps than the setting's steps)."""
    objective = create_objective(objective_settings or {})
    if objective.name not in FEW_STEPS:  # meanflow: its own 1-step default is the few-step one
        return None
    try:
        spec = SampleSpec(**{**sampler, **FEW_STEPS[objective.name]})
        return objective.steps(spec, pixel_space=pixel_space).scheduler, spec  # refuses the rest
    except SettingError:
        return None


def save_few_step_scheduler(pipe: SiTPipeline, folder: str | os.PathLike) -> Path | None:
    """Write :func:`few_step_scheduler` into ``folder/scheduler_fewstep/scheduler_config.json``,
    beside the default scheduler: ``<its class>.from_pretrained(folder,
    subfolder="scheduler_fewstep")`` loads it, and swapped in (``pipe.scheduler = ...``) it samples
    at that NFE by default (it carries the pipeline's sampling settings with the setting's steps).
    Returns the subfolder, or None (nothing written)."""
    settings = pipe.sampling_settings()
    sampler = {k: v for k, v in (settings["sampler"] or {}).items()
               if k not in ("eta", "time_shift")}  # the default method's, not the setting's
    few = few_step_scheduler(settings["transport"], sampler, pixel_space=pipe.vae is None)
    if few is None:
        return None
    scheduler, spec = few
    scheduler.register_to_config(**{**settings, "sampler": dataclasses.asdict(spec)})
    out = Path(folder) / FEW_STEP_FOLDER
    scheduler.save_pretrained(out)
    return out


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` (an OSError, or safetensors' Rust error that only quotes the OS) is a full
    disk or an exceeded quota."""
    if find_errno(err, errno.ENOSPC) or find_errno(err, errno.EDQUOT):
        return True
    return any(text in str(e) for e in exception_chain(err)
               for text in ("No space left on device", "Disk quota exceeded"))


def export(run_or_ckpt: str | os.PathLike, out_dir: str | os.PathLike, which: str = "ema",
           model_name: str | None = None, vae_name: str | None = None,
           push_to_hub: str | None = None, dtype: str = "fp32", fmt: str = "sit",
           id2label: dict[int, str] | None = None) -> Path:
    """Write the pipeline folder; returns ``out_dir``. ``dtype`` bf16 / fp16 stores transformer and
    VAE weights in half precision (run under autocast); ``fmt="dit"``: diffusers' DiTPipeline."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is a file, not a folder; choose a new output folder")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new output folder")
    reason = unwritable_dir_reason(out.parent)  # before the work, not a bare [Errno 17] after it
    if reason is not None:
        raise ExportError(f"{out}: cannot create the folder ({reason}); choose another output "
                          "folder")
    weights_dtype = PRECISIONS[check_precision(dtype, "dtype")]
    if fmt == "dit":  # diffusers' own DiTPipeline layout (models/diffusers_dit.py)
        loaded = load_source(run_or_ckpt, which, model_name)
        vae = bundled_vae(loaded, vae_name)[0]
        pipe = dit_pipeline(loaded, vae, ddpm_settings(loaded.objective))
    else:
        pipe = build_pipeline(run_or_ckpt, which, model_name, vae_name, id2label)
    if weights_dtype is not None:
        pipe.to(dtype=weights_dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        pipe.save_pretrained(staging)
        if fmt == "dit":  # a plain diffusers scheduler: DiTPipeline knows no sampling settings
            few = few_step_scheduler(loaded.objective, {}, pixel_space=False)
            if few is not None:
                few[0].save_pretrained(staging / FEW_STEP_FOLDER)
        else:
            save_few_step_scheduler(pipe, staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except Exception as err:
        if not _disk_full(err):
            raise
        raise ExportError(f"{out}: no space left on device in {out.parent} while writing the "
                          "export; nothing was written (free some space or choose another "
                          "output folder)") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if push_to_hub:
        try:
            pipe.push_to_hub(push_to_hub)
            if (out / FEW_STEP_FOLDER).is_dir():  # not a pipeline component: uploaded beside them
                from huggingface_hub import upload_folder

                upload_folder(repo_id=push_to_hub, folder_path=out / FEW_STEP_FOLDER,
                              path_in_repo=FEW_STEP_FOLDER)
        except Exception as err:  # noqa: BLE001 - the hub client raises its HTTP library's errors
            raise ExportError(f"wrote {out}, but pushing it to {push_to_hub} failed "
                              f"({type(err).__name__}: {one_line(err)}); once online and logged in "
                              f"(`hf auth login`): `hf upload {push_to_hub} {out}`") from err
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sit_vit5.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="RUN_OR_CKPT",
                        help="run directory, checkpoint file or official name")
    parser.add_argument("out", metavar="OUT_DIR", help="new folder for the pipeline")
    parser.add_argument("--which", choices=("ema", "model"), default="ema",
                        help="weights (default ema)")
    parser.add_argument("--model",
                        help="architecture of a bare / official state dict, e.g. SiT-XL/2")
    parser.add_argument("--vae",
                        help="decoder to bundle (hub id or folder; default: the checkpoint's)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID",
                        help="also upload the folder (needs a login)")
    parser.add_argument(
        "--dtype", choices=list(PRECISIONS), default="fp32",
        help="weights' dtype in the folder (default fp32, as trained; bf16 / fp16 halve it: load "
        "with torch_dtype=torch.bfloat16 / float16 to run in it, else diffusers upcasts to "
        "float32)")
    parser.add_argument(
        "--format", choices=("sit", "dit"), default="sit",
        help="sit: SiTPipeline (default); dit: diffusers' DiTPipeline (DiT-objective models)")
    parser.add_argument(
        "--id2label", metavar="FILE", help="class names: JSON {id: name} or list, or one name a "
        "line (default: ImageNet's for 1000 classes, else none)")
    args = parser.parse_args(argv)

    def run() -> int:
        names = read_id2label(args.id2label) if args.id2label else None
        out = export(args.source, args.out, args.which, args.model, args.vae, args.push_to_hub,
                     args.dtype, args.format, names)
        loader = "DiTPipeline" if args.format == "dit" else "SiTPipeline"
        print(f"wrote {out} (load with {loader}.from_pretrained({str(out)!r}))")
        return 0

    # a crash leaves no half export (staging folder), so Ctrl-C only says it was interrupted
    return run_cli(PROG, run, errors=(*KNOWN_ERRORS, CheckpointError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
