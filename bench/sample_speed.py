"""Sampling throughput (images/s at a fixed number of function evaluations), SiT vs ViT-5, side by side;
or, with ``--settings``, sampler settings side by side on one model (issue 39's speed line).

    python -m bench.sample_speed --device cuda --sizes XL --precisions bf16 --samplers sde --num-steps 250 \
        --cfg-scale 4.0 --batch-size 64 --json results/bench/sample_h200.json
    python -m bench.sample_speed --device cpu --threads 1 --sizes S B --num-steps 8 --batch-size 8
    python -m bench.sample_speed --device cpu --threads 1 --models SiT --sizes S --input-size 8 \
        --batch-size 8 --cfg-scale 1 --settings sde-euler-mean:250 unipc:8 unipc:16

``sde``: Euler-Maruyama on the SiT SDE (``Sampler.sample_sde``, last step "Mean"): NFE = num_steps.
``ode``: Euler on the probability-flow ODE (``sample_ode(sampling_method="euler")``): NFE = num_steps - 1.
``--settings SOLVER:NFE ...``: solvers of the NFE study (``python -m sit_vit5.experiments nfe``, e.g.
``sde-euler-mean:250``, SiT's default 250-step SDE, and ``unipc:8``, the few-step setting of results/nfe;
``ddpm:250`` and ``ddpm-dpm++2m-sde:12`` sample the same network as a DiT-objective model), timed interleaved
per model; ``speedup`` = the first setting's time over this one's (median of the paired rounds), i.e. the
images/s ratio against the first setting.
With CFG (scale != 1) every evaluation runs the model on the doubled batch (conditional + null class), as in
SiT's sample.py. One timed call = one whole sampling run from noise to latents (no VAE decode).
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable

import torch
from torch import nn

from bench.common import (
    BACKBONE_NAMES,
    MODES,
    PRECISIONS,
    add_common_args,
    autocast,
    build_for,
    interleaved_timings,
    maybe_compile,
    memory_baseline,
    now,
    peak_memory_gb,
    print_table,
    ratios,
    setup,
    sync,
    write_json,
)
from sit_vit5.diffusion import DiffusionSampler
from sit_vit5.experiments.nfe import SOLVERS
from sit_vit5.guidance import ClassifierFreeGuidance
from sit_vit5.models import SIZES
from sit_vit5.objective import StepsSampler, create_objective
from sit_vit5.sample_spec import FEW_STEP, FEW_STEPS, SampleSpec
from sit_vit5.transport import Sampler
from sit_vit5.utils.errors import SettingError

SAMPLERS = ("sde", "ode")
COLUMNS = ("model", "size", "sampler", "nfe", "cfg", "precision", "mode", "batch", "run_s", "img_per_s",
           "ms_per_nfe", "vit5_over_sit", "vit5_over_sit_min", "peak_mem_gb", "first_run_s")
SETTING_COLUMNS = ("model", "size", "setting", "nfe", "cfg", "precision", "mode", "batch", "run_s", "img_per_s",
                   "ms_per_nfe", "speedup", "speedup_min", "peak_mem_gb")
#: issue 39's speed line: SiT's default 250-step SDE, then the few-step setting of results/nfe (UniPC, 8 NFE:
#: the recommended setting, not shown better than its neighbours) and UniPC at 16 NFE (the <= 20 budget); then
#: the DiT objective's protocol (DDPM, 250 steps) and its few-step setting (DPM-Solver++ 2M SDE, 12 NFE)
FEW_STEP_SETTINGS = ("sde-euler-mean:250", f"unipc:{SampleSpec(**FEW_STEP).nfe}", "unipc:16", "ddpm:250",
                     f"ddpm-{FEW_STEPS['ddpm']['sampling_method']}:{SampleSpec(**FEW_STEPS['ddpm']).nfe}")


def setting_spec(text: str) -> tuple[str, SampleSpec]:
    """(the objective, the spec) of ``SOLVER:NFE``, a solver of the NFE study at that NFE; ValueError (or
    SettingError) when there is no such solver or it cannot make that NFE (e.g. DDIM's stride for 64 of
    1000 steps)."""
    name, _, nfe = text.partition(":")
    solver = SOLVERS.get(name)
    if solver is None or not nfe.isdigit():
        raise ValueError(f"expected SOLVER:NFE with SOLVER one of {', '.join(SOLVERS)}, got {text!r}")
    spec = solver.spec(int(nfe))
    create_objective({"objective": solver.objective}).sampler(spec)  # a respacing it cannot make raises here
    return solver.objective, spec


def setting(text: str) -> str:
    """argparse type: a ``SOLVER:NFE`` that :func:`setting_spec` accepts (e.g. not ``ode-heun:3``)."""
    try:
        setting_spec(text)
    except SettingError as err:
        raise argparse.ArgumentTypeError(f"{text}: {err.as_flag()}") from None
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err) if str(err).startswith("expected") else f"{text}: {err}"
                                         ) from None
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sample_speed", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["SiT", "ViT5"], choices=BACKBONE_NAMES)
    p.add_argument("--sizes", nargs="+", default=["S", "B"], choices=SIZES)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, nargs="+", default=[8], help="images per run (CFG doubles it)")
    p.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=["sde"])
    p.add_argument("--num-steps", type=int, default=None, help="grid points (default: 250 on cuda, 8 on cpu)")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="1.0 = no guidance (single batch)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                   help="default: fp32 on cpu, bf16 on cuda (autocast around the model; integrator in fp32)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["eager"])
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--settings", nargs="+", type=setting, default=None, metavar="SOLVER:NFE",
                   help="time these sampler settings side by side on each model instead of --samplers "
                   f"(ratios against the first); e.g. {' '.join(FEW_STEP_SETTINGS)}")
    add_common_args(p, steps=1, warmup=1, rounds=3)
    args = p.parse_args(argv)
    args.num_steps = args.num_steps or (250 if args.device == "cuda" else 8)
    args.precisions = args.precisions or (["bf16"] if args.device == "cuda" else ["fp32"])
    return args


def sampler_spec(sampler_name: str, num_steps: int) -> SampleSpec:
    """``--samplers``' spec: Euler-Maruyama SDE or ODE Euler on ``num_steps`` grid points."""
    return SampleSpec(method=sampler_name, num_steps=num_steps,
                      sampling_method="euler" if sampler_name == "ode" else "Euler")


def make_sample_run(model: nn.Module, device: torch.device, precision: str, mode: str, spec: SampleSpec,
                    cfg_scale: float, batch: int, input_size: int, num_classes: int, seed: int = 0,
                    objective: str = "sit") -> tuple[Callable[[], None], Sampler | DiffusionSampler | StepsSampler]:
    """A closure sampling ``batch`` latents ``(batch, 4, input_size, input_size)`` from fixed noise and labels
    with ``spec``'s sampler of ``objective`` (sit: SiT's transport; ddpm: DiT's diffusion, which reads the
    learned-variance half of the output); the sampler reports ``last_nfe``."""
    built = create_objective({"objective": objective}).sampler(spec)
    sampler, sample_fn = built.sampler, built.sample
    net = maybe_compile(model.eval(), mode)

    def model_fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(device, precision):
            return net(x, t, y).float()

    guided = ClassifierFreeGuidance(model_fn, cfg_scale, null_class=num_classes)  # scale 1: one plain call
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, 4, input_size, input_size, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)

    @torch.no_grad()
    def run() -> None:
        sample_fn(z, guided, generator=torch.Generator().manual_seed(seed + 1), y=y)

    return run, sampler


def measure_group(args: argparse.Namespace, device: torch.device, size: str, sampler_name: str,
                  precision: str, mode: str, batch: int) -> list[dict]:
    """One row per backbone at one setting, timed interleaved."""
    runs, rows = {}, {}
    for backbone in args.models:
        row = rows[backbone] = dict(model=backbone, size=f"{size}/{args.patch}", sampler=sampler_name,
                                    cfg=args.cfg_scale, precision=precision, mode=mode, batch=batch,
                                    clock=args.clock)
        baseline = memory_baseline(device)
        try:
            model = build_for(args, backbone, size).to(device)
            run, sampler = make_sample_run(model, device, precision, mode,
                                           sampler_spec(sampler_name, args.num_steps), args.cfg_scale, batch,
                                           args.input_size, args.num_classes, args.seed)
            sync(device)
            start = now("wall")
            run()  # always one untimed run: it compiles and gives the NFE and the peak memory
            sync(device)
            row.update(first_run_s=now("wall") - start, nfe=sampler.last_nfe,
                       peak_mem_gb=peak_memory_gb(device, baseline))
            for _ in range(args.warmup - 1):
                run()
            runs[backbone] = run
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        model = run = None
        gc.collect()
    times = interleaved_timings(runs, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
    runs.clear()
    for backbone, secs in times.items():
        row, sec = rows[backbone], statistics.median(secs)
        row.update(run_s=sec, run_s_min=min(secs), img_per_s=batch / sec, ms_per_nfe=sec * 1e3 / row["nfe"],
                   rounds_s=[round(v, 4) for v in secs])
    if "ViT5" in rows:
        rows["ViT5"].update(ratios(times, "ViT5", "SiT", "vit5_over_sit"))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def measure_settings(args: argparse.Namespace, device: torch.device, backbone: str, size: str, precision: str,
                     mode: str, batch: int) -> list[dict]:
    """One row per ``--settings`` entry on one model, timed interleaved; ``speedup``: against the first."""
    model = build_for(args, backbone, size).to(device)
    runs, rows = {}, {}
    for name in args.settings:
        baseline = memory_baseline(device)
        objective, spec = setting_spec(name)
        run, sampler = make_sample_run(model, device, precision, mode, spec, args.cfg_scale, batch,
                                       args.input_size, args.num_classes, args.seed, objective)
        for _ in range(max(args.warmup, 1)):  # the first run gives the NFE (as counted) and the peak memory
            run()
        sync(device)
        rows[name] = dict(model=backbone, size=f"{size}/{args.patch}", setting=name, nfe=sampler.last_nfe,
                          cfg=args.cfg_scale, precision=precision, mode=mode, batch=batch, clock=args.clock,
                          peak_mem_gb=peak_memory_gb(device, baseline))
        runs[name] = run
    times = interleaved_timings(runs, rounds=args.rounds, steps=args.steps, clock=args.clock, device=device)
    reference = args.settings[0]
    for name, secs in times.items():
        row, sec = rows[name], statistics.median(secs)
        speedup = ratios(times, reference, name, "speedup")  # the reference's time over this one's
        row.update(run_s=sec, run_s_min=min(secs), img_per_s=batch / sec, ms_per_nfe=sec * 1e3 / row["nfe"],
                   rounds_s=[round(v, 4) for v in secs], **speedup)
    runs.clear()
    gc.collect()
    return list(rows.values())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    rows = []
    if args.settings:
        for size in args.sizes:
            for backbone in args.models:
                for precision in args.precisions:
                    for mode in args.modes:
                        for batch in args.batch_size:
                            rows += measure_settings(args, device, backbone, size, precision, mode, batch)
        unit = "wall" if args.clock == "wall" else "process-CPU"
        print_table(rows, SETTING_COLUMNS, f"sampler settings ({args.device}, {unit} seconds; speedup = images/s "
                    f"over {args.settings[0]}'s, median of paired rounds)")
        write_json(args.json, "sample_settings", args, device, rows=rows)
        return dict(rows=rows)
    for size in args.sizes:
        for sampler_name in args.samplers:
            for precision in args.precisions:
                for mode in args.modes:
                    for batch in args.batch_size:
                        group = measure_group(args, device, size, sampler_name, precision, mode, batch)
                        print_table(group, COLUMNS)
                        rows += group
    unit = "wall" if args.clock == "wall" else "process-CPU"
    print_table(rows, COLUMNS, f"sampling ({args.device}, {unit} seconds, {args.num_steps} grid points)")
    write_json(args.json, "sample", args, device, rows=rows)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
