"""Generate images from a trained model: a PNG grid, or N samples in an ADM-compatible .npz for FID.

    python sample.py grid --ckpt runs/demo/checkpoints/0002000.pt --classes 0 1 2 3 --seed 1
    torchrun --nproc_per_node 8 sample.py bulk --ckpt SiT-XL-2-256.pt --num-samples 50000 ...

``--ckpt`` takes a checkpoint file, a run folder (its newest checkpoint), a folder written by
``python -m sit_vit5.export`` (its transformer and scheduler settings), a ``.safetensors`` with
its ``config.json`` beside it (``save_pretrained``: depth and width from the config), a diffusers
DiT folder, or an official name (SiT-XL-2-256.pt, ...: fetched through the
Hugging Face cache and SHA-256-checked). ``python sample.py`` in a checkout = ``sit-vit5-sample``
when installed; the library behind it is ``sit_vit5.sampling``; see
``sample.py {grid,bulk} --help``.

SiT/DiT habits work too: SiT's mode word (``sample.py ODE|SDE [grid|bulk] ...``) and DiT's bare
``sample.py --model DiT-XL/2 --image-size 256 [--ckpt F]`` (without grid/bulk it is bulk when
--num-fid-samples/--num-samples/--png is given, else grid; without --ckpt, the official file of
--model at --image-size), ``sample_ddp.py`` (= ``sample.py bulk``), and the flag names
--num-sampling-steps (= --num-steps), --per-proc-batch-size (= --batch-size), --num-fid-samples
(= --num-samples), --sample-dir (= --out), --global-seed (= --seed), --vae ema|mse (= the
stabilityai/sd-vae-ft-ema|mse decoders), --last-step None and --tf32/--no-tf32. Only the names are
shared: the defaults stay ours (TF32 stays at PyTorch's setting unless asked for, CFG stays 1).
Unknown flags are errors.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from sit_vit5.cli.preflight import check_checkpoint_file, check_torch_pair
from sit_vit5.cli.sample_flags import add_arguments as add_sampler_arguments
from sit_vit5.cli.sample_flags import finite_float, positive_int
from sit_vit5.names import (
    LABEL_SAMPLINGS,
    MAX_SEED,
    OBJECTIVES,
    OFFICIAL_NAMES,
    PATHS,
    PRECISIONS,
    PREDICTIONS,
    SD_VAE_IDS,
    name_objective,
)
from sit_vit5.sample_spec import SampleSpec
from sit_vit5.utils.atomic_files import unwritable_dir_reason
from sit_vit5.utils.errors import KNOWN_ERRORS, ConfigError, SettingError, one_line, run_cli
from sit_vit5.utils.launcher import check_launcher_env
from sit_vit5.utils.run_files import CKPT_DIR, checkpoints_of, latest_checkpoint

if TYPE_CHECKING:
    import torch

    from sit_vit5.models import LoadedModel
    from sit_vit5.sampling import SamplingPipeline

# The flags, --out and a local --ckpt are checked before torch is imported (_preflight).
SD_VAE_EMA = SD_VAE_IDS[0]

#: LoadedModel sources that record their transport and VAE (flags may not contradict them)
RECORDED = ("ours", "export")
#: SiT/DiT's --vae words -> decoders (their sample.py: stabilityai/sd-vae-ft-{ema,mse})
VAE_WORDS = {"ema": SD_VAE_IDS[0], "mse": SD_VAE_IDS[1]}
#: SiT's positional mode word (sample.py ODE|SDE) -> --method
MODE_WORDS = {"ODE": "ode", "SDE": "sde"}
BULK_ONLY_FLAGS = ("--num-samples", "--num-fid-samples", "--png", "--label-sampling")

PROTOCOL = """\
Published SiT-XL/2 protocol (FID 2.06 at 256x256): SDE, Euler-Maruyama, diffusion form sigma,
250 steps, last step Mean of size 0.04, CFG 1.5 on the legacy 3 latent channels, 50,000 samples
with uniform labels:

  torchrun --nproc_per_node 8 sample.py bulk --ckpt SiT-XL-2-256.pt --model SiT-XL/2 \\
      --image-size 256 --method sde --sampling-method Euler --diffusion-form sigma \\
      --num-steps 250 --cfg-scale 1.5 --cfg-channels 3 --num-samples 50000 --batch-size 64 \\
      --out samples/sit-xl-2-sde-cfg1.5

(ODE Heun, 250 NFE: --method ode --sampling-method heun2 --num-steps 126 gives the published
2.15 setting.)
Published DiT-XL/2 protocol (FID 2.27): DiT's file (the SiT network under DiT's ddpm objective),
250 DDPM steps, CFG 1.5 on 3 channels:

  torchrun --nproc_per_node 8 sample.py bulk --ckpt DiT-XL-2-256x256.pt --image-size 256 \
      --method ddpm --num-sampling-steps 250 --cfg-scale 1.5 --cfg-channels 3 \
      --num-samples 50000 --batch-size 64 --out samples/dit-xl-2-ddpm-cfg1.5

(a local DiT file under another name: add --model DiT-XL/2, or --model SiT-XL/2 --objective ddpm.)
New work should guide all channels (the default, --cfg-channels all).
Exit status: 0 ok, 2 bad flag / value / file."""


def _common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model")
    g.add_argument("--ckpt",
                   help="our training checkpoint (.pt), a run folder (its newest checkpoint), an "
                   "export folder, a .safetensors with its config.json beside it, an official "
                   "SiT/DiT state dict, or an official name (SiT-XL-2-256.pt, ...: see "
                   "sit_vit5/models/official.py); "
                   "default: the official file of --model at --image-size, as DiT's sample.py")
    g.add_argument("--model", help="architecture of an official / bare checkpoint: SiT-XL/2 for a "
                   "SiT file, DiT-XL/2 for a DiT file (the same network under the ddpm objective); "
                   "ours: from the checkpoint, a different name is an error")
    g.add_argument("--objective", choices=OBJECTIVES, help="what the model was trained for: sit "
                   "(transport) or ddpm (DiT). Bare files: implied by --model (DiT-* = ddpm, other "
                   "names sit) or the official name; ours: recorded in the checkpoint")
    g.add_argument("--which", choices=("ema", "model"), default="ema",
                   help="weights of a training checkpoint (default ema)")
    g.add_argument("--image-size", type=positive_int, help="output side in pixels (default: the "
                   "training size; latent side = image size / VAE factor)")
    g.add_argument("--vae", help="decoder: hub id, diffusers directory, none, or SiT/DiT's "
                   "ema | mse (default: the checkpoint's; official 4-channel models: "
                   f"{SD_VAE_EMA})")
    g.add_argument("--path-type", choices=list(PATHS), help="transport path (official checkpoints; "
                   "default Linear). Ours: must match the checkpoint")
    g.add_argument("--prediction", choices=list(PREDICTIONS), help="what the model predicts "
                   "(official checkpoints; default velocity). Ours: must match the checkpoint")
    g.add_argument("--sample-eps", type=finite_float,
                   help="sampling time-interval eps (default: the transport's)")

    # every sampler flag defaults to None: the checkpoint's sample section, else SampleSpec's
    g = p.add_argument_group("sampler (defaults: the checkpoint's sample section, else SiT's "
                             "sample.py)")
    add_sampler_arguments(g)
    g.add_argument("--nfe", type=positive_int, help="model evaluations per image (CFG's doubled "
                   "batch counts once) instead of --num-steps: the steps that make exactly N with "
                   "the chosen solver (ode heun2: N even; sde: N - 1 steps and the last step); a "
                   "count the solver cannot make, or an adaptive solver, is refused. See --method "
                   "list")
    g.add_argument("--allow-negative-cfg", action="store_true",
                   help="accept --cfg-scale < 0 (steers samples away from their class)")

    g = p.add_argument_group("run")
    g.add_argument("--seed", "--global-seed", type=int, default=0,
                   help="global seed: sample i depends on (seed, i) only")
    g.add_argument("--batch-size", "--per-proc-batch-size", type=positive_int, default=32,
                   help="images per forward batch, per process")
    g.add_argument("--device",
                   help="cuda, cuda:1, cpu (default: the launcher's device / cuda if available)")
    g.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="model precision (bf16 / fp16 = autocast; the integrator stays fp32)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model's forward (inductor): faster batches after a "
                   "one-off compile of each batch shape (seconds on small models, minutes at XL)")
    g.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="allow TF32 matmuls/convolutions on Ampere+ GPUs (faster, ~1e-3 relative "
                   "error; default: PyTorch's own setting)")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _common_parser()
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="sample.py", description=__doc__, epilog=PROTOCOL,
                                     formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)
    grid = sub.add_parser("grid", parents=[common], epilog=PROTOCOL, formatter_class=fmt,
                          help="a PNG grid and the single images, prints NFE and images/s")
    grid.add_argument("--classes", type=int, nargs="+", help="class of each image (cycled to "
                      "--num-images); default: uniform random labels")
    grid.add_argument("--num-images", type=positive_int,
                      help="images (default: len(--classes), else 16)")
    grid.add_argument("--nrow", type=positive_int,
                      help="images per grid row (default ceil(sqrt(n)))")
    grid.add_argument("--out", "--sample-dir",
                      help="output folder: grid.png + 000000.png ... (default samples/grid; "
                      "samples/grid-<size>px-trained<size>px at another --image-size than the "
                      "model's)")
    bulk = sub.add_parser("bulk", parents=[common], epilog=PROTOCOL, formatter_class=fmt,
                          help="N samples with random or equal labels -> samples_NxHxWx3.npz "
                          "(sharded, resumable)")
    bulk.add_argument("--num-samples", "--num-fid-samples", type=positive_int, default=50_000,
                      help="samples (default 50000)")
    bulk.add_argument("--out", "--sample-dir",
                      help="output folder (parts/, settings.json, the .npz); default "
                      "samples/<ckpt>-<method>-<steps>-cfg<scale>-seed<seed>, as DiT names it "
                      "(+ -<size>px-trained<size>px at another --image-size than the model's)")
    bulk.add_argument("--png", action="store_true", help="also write out/images/{index:06d}.png")
    bulk.add_argument("--label-sampling", choices=LABEL_SAMPLINGS, default=LABEL_SAMPLINGS[0],
                      help="class labels: random = uniform at random per sample (DiT/SiT's "
                      "sample_ddp, default); equal = exactly N / num_classes per class in a seeded "
                      "order (ADM / REPA-E; N must be a multiple of the classes)")
    return parser


def translate_mode_word(argv: list[str]) -> list[str]:
    """SiT's ``sample.py ODE|SDE [grid|bulk] ...`` and DiT's ``sample.py --ckpt ...`` as ours: the
    mode word becomes ``--method``; no command means bulk with a bulk-only flag, else grid."""
    args, method = list(argv), None
    if args[:1] and args[0] in MODE_WORDS:
        method = MODE_WORDS[args.pop(0)]
    elif len(args) > 1 and args[0] in ("grid", "bulk") and args[1] in MODE_WORDS:
        method = MODE_WORDS[args.pop(1)]
    if not args[:1] or args[0] not in ("grid", "bulk"):
        if method is None and (not args or args[0] in ("-h", "--help")):
            return args  # the top-level help, or argparse's "a command is required"
        bulk = any(a.split("=", 1)[0] in BULK_ONLY_FLAGS for a in args)
        args.insert(0, "bulk" if bulk else "grid")
    if method is None:
        return args
    if any(a.split("=", 1)[0] == "--method" for a in args):
        raise ConfigError(f"both the mode word {method.upper()} and --method were given; keep one")
    return [args[0], "--method", method, *args[1:]]


def load_model(*args: object, **kwargs: object) -> LoadedModel:
    """``sit_vit5.models.load_model`` (imported on first use: torch, the models)."""
    from sit_vit5.models import load_model as load

    return load(*args, **kwargs)


def default_checkpoint(model: str | None, image_size: int | None) -> str:
    """DiT/SiT's sample.py without ``--ckpt``: the official file of ``--model`` at ``--image-size``
    (default 256), e.g. DiT-XL/2 -> DiT-XL-2-256x256.pt, SiT-XL/2 -> SiT-XL-2-256.pt."""
    from sit_vit5.models import architecture_name
    from sit_vit5.models.official import OFFICIAL_WEIGHTS

    side = image_size or 256
    wanted = (architecture_name(model), side, name_objective(model) or "sit") if model else None
    for name, entry in OFFICIAL_WEIGHTS.items():
        if (entry.model, entry.image_size, entry.objective) == wanted:
            return name
    known = ", ".join(sorted(OFFICIAL_WEIGHTS))
    raise ConfigError(f"--ckpt is required (a checkpoint file or an official name: {known})"
                      + (f"; --model {model} at {side} px has no official file" if model else ""))


# ----------------------------------------------------------------------------- resolution


def resolve_spec(args: argparse.Namespace, saved: dict,
                 default_method: str = SampleSpec.method) -> SampleSpec:
    """Flags, else the checkpoint's ``sample`` section ``saved`` (ours), else the objective's
    default method (ddpm: DiT's sampler) and the SampleSpec defaults; ``--nfe`` then sets the
    steps (SettingError naming it when the solver cannot make that many)."""
    flags = {key: getattr(args, key) for key in SampleSpec.keys()}
    nfe = getattr(args, "nfe", None)
    if nfe is not None and flags["num_steps"] is not None:
        raise ConfigError(f"--nfe {nfe} and --num-steps {flags['num_steps']} both set the steps; "
                          "give one")
    spec = SampleSpec.resolve(flags, saved, {"method": default_method}, explicit=True)
    return spec if nfe is None else spec.with_nfe(nfe)


def resolve_transport(args: argparse.Namespace, info: LoadedModel) -> dict:
    """The checkpoint's objective section; --path-type/--prediction only for official files."""
    from sit_vit5.objective import objective_keys

    section = dict(info.objective)
    for flag, key in (("--path-type", "path_type"), ("--prediction", "prediction"),
                      ("--sample-eps", "sample_eps")):
        value = getattr(args, key)
        if value is None:
            continue
        if key not in objective_keys(info.objective_name):
            raise ConfigError(f"{flag} {value}: {args.ckpt} is a {info.objective_name}-objective "
                              f"model, which has no {key}")
        trained = section.get(key, {"path_type": "Linear", "prediction": "velocity"}.get(key))
        if info.source in RECORDED and key != "sample_eps" and value != trained:
            raise ConfigError(f"{flag} {value}: {args.ckpt} was trained with {key}={trained}; the "
                              f"model's output means {trained}, so drop {flag}")
        section[key] = value
    return section


def resolve_vae(args: argparse.Namespace, info: LoadedModel) -> dict:
    """The decoder config; a pixel model cannot take a VAE and a latent model needs one."""
    from sit_vit5.vae import vae_enabled

    vae = dict(info.vae)
    if args.vae is not None:
        trained_on_latents = vae_enabled(vae.get("name"))
        if info.source in RECORDED and trained_on_latents != vae_enabled(args.vae):
            raise ConfigError(f"--vae {args.vae}: {args.ckpt} was trained "
                              + (f"on {vae['name']} latents; it needs a decoder"
                                 if trained_on_latents
                                 else "in pixel space (vae.name=none); it takes no decoder"))
        if info.source in RECORDED and args.vae != vae["name"]:
            warnings.warn(f"--vae {args.vae}: decoding latents of a model trained with "
                          f"{vae['name']}", stacklevel=2)
        vae["name"] = args.vae
    vae.setdefault("name", "none")
    return vae


def build_pipeline(args: argparse.Namespace, device: torch.device
                   ) -> tuple[SamplingPipeline, LoadedModel, int]:
    """Load the model, objective and decoder ``args`` name: (pipeline, loaded, image side)."""
    from sit_vit5.objective import create_objective
    from sit_vit5.sampling import SamplingPipeline

    # a local file, or an official name -> the hub cache (SHA-256 checked, licence printed);
    # after the launcher check of bulk runs, so a bad launch is reported before any download
    args.ckpt = args.ckpt or default_checkpoint(args.model, args.image_size)
    args.ckpt_path, official = Path(args.ckpt), None
    if not args.ckpt_path.exists():  # the official weights (platform): only for a name
        from sit_vit5.models.official import resolve_checkpoint

        args.ckpt_path, official = resolve_checkpoint(args.ckpt)
    objective = args.objective
    if official is not None:  # the table says what the file is (DiT's: the ddpm objective)
        if objective is not None and objective != official.objective:
            raise ConfigError(f"--objective {objective}: {args.ckpt} is a {official.objective}-"
                              "objective model")
        objective = official.objective
    loaded = load_model(args.ckpt_path, args.model or (official and official.model), args.which,
                        objective=objective)
    objective = create_objective(resolve_transport(args, loaded))
    spec = resolve_spec(args, loaded.sample, objective.methods[0])
    which = f" ({loaded.which})" if loaded.which else ""
    try:
        pipe = SamplingPipeline.for_model(
            loaded, spec, objective=objective, vae=resolve_vae(args, loaded)["name"],
            image_size=args.image_size, device=device, precision=args.precision,
            compile=args.compile, allow_negative_cfg=args.allow_negative_cfg,
            source=f"checkpoint {args.ckpt}{which}")
    except SettingError as err:  # the objective's check, worded with the checkpoint it is about
        if err.key != "method":
            raise
        # a typed solver (diffusers' unipc, ...) is named too
        value = (f"{err.value} --sampling-method {args.sampling_method}"
                 if args.sampling_method else err.value)
        raise SettingError(err.key, value,
                           f"{err.reason} ({args.ckpt} is a {objective.name}-objective model)"
                           ) from None
    return pipe, loaded, pipe.image_size


def check_device(device: str | None) -> None:
    """ConfigError naming ``--device`` when torch cannot parse it or this machine does not have it
    (without it: a CUDA initialisation traceback at the first tensor)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ConfigError(f"--device {device}: not a device ({one_line(err)}); e.g. cpu, cuda, "
                          "cuda:1") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: no CUDA GPU is available on this machine; use "
                              "--device cpu")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"--device {device}: only {count} GPU(s) are visible (cuda:0 .. "
                              f"cuda:{count - 1})")
    elif dev.type not in ("cpu", "meta"):
        try:  # mps, xpu, ...: whether this build and machine have it
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as err:
            raise ConfigError(f"--device {device}: not available here ({one_line(err)})") from None


def _describe(info: LoadedModel, pipe: SamplingPipeline, image_size: int, ckpt: str) -> str:
    step = f", step {info.step}" if info.step is not None else ""
    which = f" ({info.which})" if info.which else ""
    spec = ", ".join(f"{k}={v}" for k, v in vars(pipe.spec).items())
    return (f"{ckpt}: {info.name} [{info.source}{which}{step}], {image_size}x{image_size}, "
            f"objective {info.objective_name}: {pipe.objective!r}\nsampler: {spec}")


# ----------------------------------------------------------------------------- commands


def _size_suffix(info: LoadedModel, pipe: SamplingPipeline) -> str:
    """``-16px-trained8px`` (for the default output folder) when the images are not at the model's
    training size, else ``""``."""
    trained = info.input_size * pipe.vae_factor
    return "" if pipe.image_size == trained else f"-{pipe.image_size}px-trained{trained}px"


def _grid(args: argparse.Namespace) -> int:
    import torch

    from sit_vit5.sampling import sample_grid

    check_device(args.device)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pipe, info, image_size = build_pipeline(args, device)
    args.out = args.out or f"samples/grid{_size_suffix(info, pipe)}"
    num_images = args.num_images or (len(args.classes) if args.classes else 16)
    labels = None
    if args.classes:
        bad = [c for c in args.classes if not 0 <= c < info.num_classes]
        if bad:
            raise ConfigError(f"--classes {bad}: class ids must lie in [0, {info.num_classes})")
        labels = [args.classes[i % len(args.classes)] for i in range(num_images)]
    print(_describe(info, pipe, image_size, args.ckpt))
    result = sample_grid(pipe, args.out, num_images, labels, args.seed, args.batch_size, args.nrow,
                         progress=not args.no_progress)
    print(f"labels: {result.labels.tolist()}")
    print(f"NFE per image: {result.nfe}; {result.images_per_second:.2f} images/s ({num_images} in "
          f"{result.seconds:.1f} s on {device})")
    print(f"wrote {result.grid} and {len(result.images)} images in {Path(args.out)}")
    return 0


def _bulk(args: argparse.Namespace) -> int:
    import torch

    from sit_vit5.sampling import sample_bulk
    from sit_vit5.sampling.labels import check_label_sampling
    from sit_vit5.utils.checksums import checkpoint_sha256
    from sit_vit5.utils.distributed import describe_group, join_launcher_group

    check_device(args.device)
    # the launcher's group (gloo without a GPU): else every process would draw every sample
    on_cpu = args.device is not None and torch.device(args.device).type == "cpu"
    state = join_launcher_group(cpu=on_cpu)
    device = torch.device(args.device) if args.device else state.device
    pipe, info, image_size = build_pipeline(args, device)
    check_label_sampling(args.label_sampling, args.num_samples, pipe.num_classes)  # before hashing
    spec = pipe.spec
    args.out = args.out or (f"samples/{Path(args.ckpt).stem}-{spec.method}-{spec.num_steps}-"
                            f"cfg{spec.cfg_scale:g}-seed{args.seed}{_size_suffix(info, pipe)}")
    if state.is_main_process:
        print(_describe(info, pipe, image_size, args.ckpt))
        print(f"bulk sampling on {describe_group(state.num_processes, device)} into {args.out}")
    settings = {"ckpt": str(args.ckpt_path.resolve()), "which": info.which, "model": info.name,
                "image_size": image_size,
                "trained_image_size": info.input_size * pipe.vae_factor,
                "vae": args.vae or info.vae.get("name"),
                "precision": args.precision, "transport": repr(pipe.objective),
                "objective": info.objective_name,
                "checkpoint_sha256": checkpoint_sha256(args.ckpt_path), **pipe.input_digests()}
    barrier = state.wait_for_everyone if state.num_processes > 1 else None
    result = sample_bulk(pipe, args.num_samples, args.out, global_seed=args.seed,
                         batch_size=args.batch_size, rank=state.process_index,
                         world_size=state.num_processes, png=args.png, settings=settings,
                         barrier=barrier, progress=not args.no_progress,
                         label_sampling=args.label_sampling)
    rank = f"[rank {state.process_index}/{state.num_processes}]"
    rate = (f"NFE per image: {result.nfe}; {result.images_per_second:.2f} images/s"
            if result.generated
            else f"nothing to do: this process's samples were all in {args.out}")
    print(f"{rank} generated {result.generated}, skipped {result.skipped} (done before); {rate}")
    if result.claimed:
        print(f"{rank} {result.claimed} samples are being made by another process in {args.out}; "
              "the last one to finish writes the npz")
    if result.npz is not None:
        print(f"wrote {result.npz}")
    return 0


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    print(f"warning: {message}", file=sys.stderr)  # one line, without the source echo


def set_tf32(enabled: bool | None) -> None:
    """--tf32 / --no-tf32: TF32 for CUDA matmuls and cuDNN convolutions (None: leave PyTorch's)."""
    if enabled is not None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def _message(err: BaseException) -> str:
    """A bad setting in the words of this command line (``--num-steps 1: ...``)."""
    return err.as_flag() if isinstance(err, SettingError) else one_line(err)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = translate_mode_word(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        parser.error(str(err))
    args = parser.parse_args(argv)
    args.vae = VAE_WORDS.get(args.vae, args.vae)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _show_warning  # restored by catch_warnings
        command = _grid if args.command == "grid" else _bulk

        def run() -> int:
            _preflight(args)
            set_tf32(args.tf32)  # after the checks: it imports torch
            return command(args)

        return run_cli(f"sample.py {args.command}", run, errors=(*KNOWN_ERRORS, ValueError),
                       render=_message, resumable=args.command == "bulk")


def run_folder_checkpoint(ckpt: str) -> str:
    """``--ckpt`` as a file when it names a run folder (or its ``checkpoints/``): the newest
    complete checkpoint there, as ``python -m sit_vit5.export`` takes it; anything else unchanged
    (a model folder, one with ``model_index.json`` or ``config.json``, goes to ``load_model``).
    ConfigError for a folder that is none of these."""
    path = Path(ckpt)
    if not path.is_dir() or any((path / name).is_file()
                                for name in ("model_index.json", "config.json")):
        return ckpt
    latest = latest_checkpoint(checkpoints_of(path))
    if latest is None:
        raise ConfigError(f"--ckpt {ckpt}: a folder without checkpoints (a run folder holds "
                          f"{CKPT_DIR}/, an export model_index.json, a saved model config.json)")
    return str(latest)


def _preflight(args: argparse.Namespace) -> None:
    """The checks that need neither torch nor the model (ConfigError naming the flag): a local
    ``--ckpt`` file is whole (and matches its sidecar), any other value is an official name;
    ``--out`` can be written; torch and torchvision belong together. Bulk sampling first checks
    the launcher's environment, the first thing wrong in a bad launch."""
    if args.command == "bulk":
        check_launcher_env()
    if not 0 <= args.seed <= MAX_SEED:  # torch.manual_seed takes 64 bits
        raise ConfigError(f"--seed {args.seed}: must be an integer in [0, {MAX_SEED}]")
    if args.ckpt is not None:
        args.ckpt = run_folder_checkpoint(args.ckpt)
        if Path(args.ckpt).is_file():
            check_checkpoint_file(args.ckpt, "--ckpt", flag="--ckpt")
        elif not Path(args.ckpt).exists() and args.ckpt not in OFFICIAL_NAMES:
            raise ConfigError(f"--ckpt {args.ckpt}: checkpoint not found (not a file, nor an "
                              f"official name: {', '.join(OFFICIAL_NAMES)})")
    problem = unwritable_dir_reason(args.out) if args.out else None
    if problem:
        raise ConfigError(f"--out {args.out}: cannot write there ({problem})")
    check_torch_pair()


if __name__ == "__main__":
    sys.exit(main())
