"""Kill training at random moments, resume each time, and check that nothing was lost or changed.

    python tools/fault_injection.py --kills 20                  # SIGKILL only
    python tools/fault_injection.py --kills 20 --signals KILL,TERM,INT,USR1 --json faults.json

A reference run (``python train.py`` on a tiny model, a checkpoint every step, all kept) is made first.
Then the same command (in another out_dir, a checkpoint every ``--ckpt-every`` steps) is started, killed
with a random signal after a random delay (uniform over that command's uninterrupted training time, counted from
train.py's start line, so kills land in steps, checkpoint writes and the exit), and restarted with
``--resume latest`` until ``--kills`` kills are done; a last resume runs it to the end.
After every kill it checks:

* no lost checkpoint: ``latest.json`` names a file, every checkpoint in the directory verifies (sidecar and
  the digest inside), and the latest step never goes back;
* bit-identical resume: each checkpoint the interrupted run holds equals the reference checkpoint of the same
  step (model, EMA, optimizer, step, data position and RNG states; the digests of those entries);
* a graceful signal (TERM / INT / USR1) exits with train.py's pre-emption status after writing a checkpoint
  of the step it finished (usually not a multiple of ``--ckpt-every``: compared with the reference too).

Bounded: ``--time-budget`` seconds in all (default 600); it stops killing when the budget is spent. Prints
"N kills, N bit-identical resumes, 0 lost checkpoints" (the measured numbers) and exits 1 on any failure.

``--target cache`` does the same to the latent cache writer (``python -m sit_vit5.cache_latents``
on a tiny VAE and image folder, see ``cache_faults``): killed at random moments of its run (set-up
after the imports, manifest, shard writes, renames, markers, completion), rerun with the same
command, and compared with an uninterrupted run's cache byte for byte. Prints "N kills, N
byte-identical resumed caches, 0 lost or half-written shards".

``--target bulk`` does the same to ``sample.py bulk`` (a tiny random checkpoint, SDE sampling, a
part per batch of 2): killed at random moments, rerun, and every part left behind must hold the
reference run's images for its indices; the finished npz must equal the uninterrupted run's array
for array. Prints "N kills, N identical resumed npz, 0 lost or wrong parts".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sit_vit5.cli.train import EXIT_PREEMPTED  # noqa: E402
from sit_vit5.training import checkpoint as ck  # noqa: E402
from sit_vit5.utils.checksums import payload_sha256  # noqa: E402

TINY = ["model.name=ViT5-S/2", "model.depth=2", "model.hidden_size=32", "model.num_heads=2",
        "model.learn_sigma=false", "data.kind=digits", "data.image_size=8", "data.num_workers=0",
        "vae.name=none", "optim.lr=1e-3",
        "optim.ema_decay=0.9", "train.tensorboard=false", "train.sample_every=0", "train.log_every=5",
        "train.milestone_every=0", "data.global_batch_size=16"]
COMPARED = ("model", "ema", "opt", "step", "epoch", "batch_in_epoch", "rng")  # not args (out_dir differs)
GRACEFUL = {"TERM", "INT", "USR1"}


def command(out_dir: Path, steps: int, keep_last: int, resume: bool, ckpt_every: int) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, f"train.out_dir={out_dir}", f"train.steps={steps}",
           f"train.keep_last={keep_last}", f"train.ckpt_every={ckpt_every}"]
    return cmd + (["--resume", "latest"] if resume else [])


def run_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def fingerprint(path: Path) -> str:
    """Digest of the entries a resume must reproduce (verifies the file on the way)."""
    state = ck.read_checkpoint(path)
    return payload_sha256({k: state[k] for k in COMPARED})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="kills to inject (default 20)")
    p.add_argument("--steps", type=int, default=60, help="training steps of the run (default 60)")
    p.add_argument("--ckpt-every", type=int, default=5, help="train.ckpt_every of the killed run (default 5)")
    p.add_argument("--signals", default="KILL", help="comma-separated signals to draw from (default KILL)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments and signals")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds in all (default 600)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--target", choices=("train", "cache", "bulk"), default="train",
                   help="train.py (default), the latent cache writer or sample.py bulk")
    p.add_argument("--images", type=int, default=40,
                   help="cache: images in the folder; bulk: samples (default 40)")
    args = p.parse_args(argv)
    if args.target == "cache":
        return cache_faults(args)
    if args.target == "bulk":
        return bulk_faults(args)
    signals = [s.strip().upper().removeprefix("SIG") for s in args.signals.split(",") if s.strip()]
    rng = random.Random(args.seed)
    began = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        ref_dir, run_dir = Path(tmp) / "reference", Path(tmp) / "faulty"
        log = Path(tmp) / "log.txt"
        proc, ready = start(command(ref_dir, args.steps, args.steps + 1, False, 1), log)
        if proc.wait() != 0:
            raise SystemExit(f"the reference run failed:\n{log.read_text()[-2000:]}")
        reference = {step: fingerprint(path) for step, path, _ in ck.list_checkpoints(ref_dir / "checkpoints")}
        # the kill window: the training time (start-up excluded) of the command that gets killed
        proc, ready = start(command(Path(tmp) / "timing", args.steps, 2, False, args.ckpt_every), log)
        last_save = f"{args.steps:07d}.pt"  # until the final checkpoint is written (not the exit)
        while proc.poll() is None and last_save not in log.read_text(errors="replace"):
            time.sleep(0.02)
        duration = time.perf_counter() - ready
        proc.wait()
        print(f"reference: {args.steps} steps; the killed command trains for {duration:.1f} s", flush=True)

        kills = resumes = identical = lost = graceful_ok = 0
        failures: list[str] = []
        last_step = 0
        while kills < args.kills and time.perf_counter() - began + duration < args.time_budget:
            resume = ck.latest_checkpoint(run_dir / "checkpoints") is not None
            resumes += resume
            proc, _ = start(command(run_dir, args.steps, 2, resume, args.ckpt_every), log)
            delay, name = rng.uniform(0.0, duration), rng.choice(signals)
            try:
                proc.wait(timeout=delay)
                killed = False
            except subprocess.TimeoutExpired:
                killed = True
                proc.send_signal(getattr(signal, f"SIG{name}"))
                proc.wait()
            output = log.read_text(errors="replace").strip()
            kills += killed
            what = f"kill {kills} (SIG{name} after {delay:.2f} s)" if killed else "a run that finished"
            if not killed and proc.returncode != 0:
                failures.append(f"{what} exited {proc.returncode}: {output[-300:]}")
            # every checkpoint left must verify and equal the uninterrupted run's of the same step
            ok = True
            try:
                held = {step: fingerprint(path) for step, path, _ in ck.list_checkpoints(run_dir / "checkpoints")}
                latest = ck.latest_checkpoint(run_dir / "checkpoints")
                latest_step = ck.read_checkpoint(latest)["step"] if latest else 0
            except ck.CheckpointError as err:
                failures.append(f"{what}: unreadable checkpoint: {err}")
                lost, ok, held, latest_step = lost + 1, False, {}, last_step
            if latest_step < last_step:
                failures.append(f"{what}: the latest checkpoint went back from step {last_step} to {latest_step}")
                lost, ok = lost + 1, False
            for step, digest in held.items():
                if reference.get(step) != digest:
                    failures.append(f"{what}: step {step} differs from the uninterrupted run")
                    ok = False
            finished_anyway = proc.returncode == 0 and latest_step == args.steps  # signal in the last step
            if killed and name in GRACEFUL and not finished_anyway \
                    and proc.returncode != -getattr(signal, f"SIG{name}"):
                # the handler was installed (training had started): it must checkpoint and exit with the status
                if proc.returncode == EXIT_PREEMPTED and latest_step == last_step_of(output, latest_step):
                    graceful_ok += 1
                else:
                    failures.append(f"{what}: exited {proc.returncode}, expected {EXIT_PREEMPTED}: {output[-300:]}")
                    ok = False
            identical += resume and ok
            last_step = latest_step
            print(f"{what:<34} -> exit {proc.returncode:4d}, latest step {latest_step:3d}"
                  f"{', resumed' if resume else ''}: {'ok' if ok else 'MISMATCH'}", flush=True)
            if not killed or latest_step == args.steps:  # it reached the end: start over for more kills
                shutil.rmtree(run_dir, ignore_errors=True)
                last_step = 0
        if ck.latest_checkpoint(run_dir / "checkpoints") is not None:  # finish the run, compare its end
            resumes += 1
            done = subprocess.run(command(run_dir, args.steps, 2, True, args.ckpt_every), env=run_env(), check=False,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            latest = ck.latest_checkpoint(run_dir / "checkpoints")
            if done.returncode == 0 and latest is not None and fingerprint(latest) == reference[args.steps]:
                identical += 1
            else:
                failures.append(f"the last resume (exit {done.returncode}) did not end at the reference state")
    print(f"{kills} kills, {resumes} resumes, {identical} bit-identical resumes, {lost} lost checkpoints, "
          f"{graceful_ok} graceful pre-emption exits; {time.perf_counter() - began:.0f} s")
    for failure in failures:
        print("FAIL:", failure)
    if args.json:
        args.json.write_text(json.dumps({
            "kills": kills, "resumes": resumes, "bit_identical_resumes": identical, "lost_checkpoints": lost,
            "graceful_exits": graceful_ok, "failures": failures, "signals": signals, "steps": args.steps,
            "seed": args.seed}, indent=2) + "\n")
    return 1 if failures else 0


# ------------------------------------------------------------------------ the latent cache writer

#: a tiny SD-VAE-shaped AutoencoderKL (downsampling 2, 4 latent channels): encodes in milliseconds
CACHE_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 16),
    latent_channels=4,
    norm_num_groups=8,
    sample_size=16,
)
CACHE_MARKER = "latent cache on "  # printed once the imports are done, before anything is written
ENCODE_MARKER = (
    "process 0/1: shards"  # printed after the manifest and lists, before the first shard
)
COMPLETE_MARKER = "latent cache complete"  # printed after the manifest is marked complete
EXIT_INTERRUPTED = 130


def cache_command(data_dir: Path, out: Path, vae_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sit_vit5.cache_latents",
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
        "--vae",
        str(vae_dir),
        "--image-size",
        "16",
        "--batch-size",
        "2",
        "--shard-size",
        "4",
        "--num-workers",
        "0",
    ]


def cache_inputs(root: Path, images: int) -> tuple[Path, Path]:
    """A random-weights tiny VAE folder and an image folder of ``images`` PNGs in two classes."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKL
    from PIL import Image

    torch.manual_seed(0)
    AutoencoderKL(**CACHE_VAE).save_pretrained(root / "vae")
    rng = np.random.default_rng(0)
    for i in range(images):
        folder = root / "images" / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        h, w = rng.integers(16, 48, size=2)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            folder / f"{i:04d}.png"
        )
    return root / "vae", root / "images"


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in ``folder`` (by name)."""
    import hashlib

    if not folder.is_dir():
        return {}
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def cache_state_problems(
    out: Path, reference: dict[str, str], done_before: dict[str, str], interrupted_gracefully: bool
) -> tuple[list[str], int]:
    """What is wrong with a killed writer's cache: a shard done before the kill lost or changed, a
    shard file, marker or list in place that differs from the uninterrupted run's (half-written), an
    unreadable manifest, or (after a SIGINT the writer handled) a temporary left behind. Returns
    (problems, lost shards)."""
    import json

    from sit_vit5.utils.atomic_files import TMP_PREFIX

    held = digests(out)
    problems: list[str] = []
    lost = 0
    for name, digest in done_before.items():
        if held.get(name) != digest:
            problems.append(
                f"{name}, in place before the kill, is {'changed' if name in held else 'gone'}"
            )
            lost += 1
    for name, digest in held.items():
        temporary = name.startswith(TMP_PREFIX) or name.endswith(".tmp")
        if temporary:
            if interrupted_gracefully:
                problems.append(f"the interrupted writer left {name}")
        elif name == "manifest.json":
            try:
                json.loads((out / name).read_text())
            except ValueError:
                problems.append("manifest.json is not valid JSON")
        elif reference.get(name) != digest:
            problems.append(f"{name} differs from the uninterrupted run's (half-written?)")
    return problems, lost


def cache_faults(args: argparse.Namespace) -> int:
    """``--target cache``: kill the latent cache writer at random moments, rerun it, compare (see
    the module docstring). A chain of 1-3 kills is followed by an uninterrupted rerun whose cache
    must equal the reference byte for byte; each kill of that chain then counts as a byte-identical
    resume."""
    from sit_vit5.utils.atomic_files import TMP_PREFIX

    signals = [s.strip().upper().removeprefix("SIG") for s in args.signals.split(",") if s.strip()]
    rng = random.Random(args.seed)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cache-faults-") as tmp:
        root = Path(tmp)
        vae_dir, data_dir = cache_inputs(root, args.images)
        log = root / "log.txt"
        proc, ready = start(cache_command(data_dir, root / "reference", vae_dir), log, CACHE_MARKER)
        encoding = wait_for(proc, log, ENCODE_MARKER)
        complete = wait_for(proc, log, COMPLETE_MARKER) + 0.05  # and the manifest's last write
        if proc.wait() != 0:
            raise SystemExit(f"the reference run failed:\n{log.read_text()[-2000:]}")
        # two kill windows: set-up (VAE load, lists, manifest), encoding (shards, markers, the end)
        windows = {CACHE_MARKER: encoding - ready, ENCODE_MARKER: complete - encoding}
        duration = sum(windows.values())
        reference = digests(root / "reference")
        print(
            f"reference: {len(reference)} files; after start-up the writer sets up for "
            f"{windows[CACHE_MARKER]:.2f} s and encodes for {windows[ENCODE_MARKER]:.2f} s",
            flush=True,
        )

        out = root / "faulty"
        kills = identical = lost = graceful = runs = swept = 0
        chain: list[str] = []  # the kills since the cache was last completed
        failures: list[str] = []
        limit = rng.randint(1, 3)
        while kills < args.kills and time.perf_counter() - began + 2 * duration < args.time_budget:
            done_before = {
                n: d
                for n, d in digests(out).items()
                if n.startswith("shard_")
                and (n.endswith(".done") or (out / (n.split(".")[0] + ".done")).is_file())
            }
            kill = len(chain) < limit
            proc, _ = start(cache_command(data_dir, out, vae_dir), log, CACHE_MARKER)
            runs += 1
            window = CACHE_MARKER if rng.random() < 0.25 else ENCODE_MARKER  # mostly while writing
            delay, name = rng.uniform(0.0, windows[window]), rng.choice(signals)
            killed = False
            if kill:
                wait_for(proc, log, window)
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    killed = True
                    proc.send_signal(getattr(signal, f"SIG{name}"))
            proc.wait()
            output = log.read_text(errors="replace").strip()
            if killed:
                kills += 1
                phase = "set-up" if window == CACHE_MARKER else "encoding"
                what = f"kill {kills} (SIG{name}, {phase} + {delay:.2f} s)"
                died = proc.returncode == -getattr(signal, f"SIG{name}")
                gracefully = name in ("INT", "TERM") and not died  # the writer's clean-up ran
                finished = COMPLETE_MARKER in output  # a signal in the interpreter's exit: no loss
                if name == "INT" and proc.returncode not in (0, EXIT_INTERRUPTED) and not finished:
                    failures.append(f"{what}: exit {proc.returncode}, expected "
                                    f"{EXIT_INTERRUPTED}: {output[-300:]}")
                graceful += name == "INT" and proc.returncode == EXIT_INTERRUPTED
                problems, lost_now = cache_state_problems(out, reference, done_before, gracefully)
                swept += any(
                    n.startswith(TMP_PREFIX) for n in digests(out)
                )  # the next run removes it
                lost += lost_now
                failures += [f"{what}: {p}" for p in problems]
                chain.append(what)
                print(
                    f"{what:<38} -> exit {proc.returncode:4d}, {len(digests(out))} files: "
                    f"{'ok' if not problems else 'BROKEN'}",
                    flush=True,
                )
                if proc.returncode != 0:
                    continue
            elif proc.returncode != 0:
                failures.append(f"an uninterrupted rerun exited {proc.returncode}: {output[-300:]}")
            same = digests(out) == reference  # the run completed: the cache must be the reference's
            identical += len(chain) if same else 0
            if not same:
                failures.append(
                    f"the cache completed after {chain} differs from the uninterrupted run's"
                )
            verdict = "byte-identical" if same else "DIFFERENT"
            print(f"completed after {len(chain)} kill(s): {verdict}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            chain, limit = [], rng.randint(1, 3)
        if chain:  # finish the last chain
            done = subprocess.run(
                cache_command(data_dir, out, vae_dir),
                env=run_env(),
                check=False,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            runs += 1
            if done.returncode == 0 and digests(out) == reference:
                identical += len(chain)
            else:
                failures.append(
                    f"the last rerun (exit {done.returncode}) did not give the reference cache"
                )
    print(
        f"{kills} kills, {identical} byte-identical resumed caches, {lost} lost or half-written "
        f"shards, {graceful} graceful SIGINT exits (130), {swept} kills left a temporary (swept by "
        f"the rerun), {runs} runs; {time.perf_counter() - began:.0f} s"
    )
    for failure in failures:
        print("FAIL:", failure)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "target": "cache",
                    "kills": kills,
                    "byte_identical_resumes": identical,
                    "lost_shards": lost,
                    "graceful_exits": graceful,
                    "temporaries_swept": swept,
                    "runs": runs,
                    "failures": failures,
                    "signals": signals,
                    "images": args.images,
                    "seed": args.seed,
                },
                indent=2,
            )
            + "\n"
        )
    return 1 if failures else 0


BULK_MARKER = "bulk sampling on"  # printed once the model is loaded, before the first batch


def bulk_command(ckpt: Path, out: Path, samples: int) -> list[str]:
    return [sys.executable, str(ROOT / "sample.py"), "bulk", "--ckpt", str(ckpt), "--out", str(out),
            "--num-samples", str(samples), "--batch-size", "2", "--method", "sde", "--num-steps",
            "12", "--device", "cpu", "--no-progress"]


def tiny_checkpoint(root: Path) -> Path:
    """A random tiny pixel-space SiT checkpoint as the training loop writes it."""
    import torch

    from sit_vit5.config import load_config
    from sit_vit5.models import create_model
    from sit_vit5.training import save_checkpoint

    sizes = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, in_channels=1, num_classes=10)
    cfg = load_config(None, [f"model.{k}={v}" for k, v in {"name": "SiT-S/2", **sizes}.items()]
                      + ["vae.name=none", "model.learn_sigma=false"])
    torch.manual_seed(0)
    model = create_model("SiT-S/2", learn_sigma=False, **sizes)
    state = {"model": model.state_dict(), "ema": model.state_dict(), "opt": {}, "args": cfg,
             "step": 1}
    return save_checkpoint(state, root / "checkpoints", step=1)


def npz_arrays(path: Path) -> dict:
    """The arrays of an npz file, by name."""
    import numpy as np

    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def part_problems(parts: Path, reference: dict) -> list[str]:
    """Parts that cannot be read or whose images differ from the reference's for their indices."""
    import numpy as np

    problems = []
    for part in sorted(parts.glob("[0-9]*.npz")):
        try:
            held = npz_arrays(part)
        except Exception as err:  # noqa: BLE001  (any unreadable file is a half-written part)
            problems.append(f"{part.name} is unreadable ({type(err).__name__})")
            continue
        want = reference["arr_0"][held["indices"]]  # the npz is RGB; a 1-channel part is gray
        if not np.array_equal(held["images"], want[..., : held["images"].shape[-1]]):
            problems.append(f"{part.name} holds other images than the reference's")
    return problems


def bulk_faults(args: argparse.Namespace) -> int:
    """``--target bulk``: kill sample.py bulk at random moments, rerun, compare (module docstring)."""
    import numpy as np

    signals = [s.strip().upper().removeprefix("SIG") for s in args.signals.split(",") if s.strip()]
    rng, began, samples = random.Random(args.seed), time.perf_counter(), args.images
    with tempfile.TemporaryDirectory(prefix="bulk-faults-") as tmp:
        root = Path(tmp)
        ckpt, log = tiny_checkpoint(root), root / "log.txt"
        proc, ready = start(bulk_command(ckpt, root / "reference", samples), log, BULK_MARKER)
        if proc.wait() != 0:
            raise SystemExit(f"the reference run failed:\n{log.read_text()[-2000:]}")
        duration = time.perf_counter() - ready
        reference = npz_arrays(next((root / "reference").glob("samples_*.npz")))
        print(f"reference: {samples} samples in {duration:.2f} s after start-up", flush=True)
        out, kills, identical, lost, runs, failures, chain = root / "faulty", 0, 0, 0, 0, [], []
        limit = rng.randint(1, 3)
        while kills < args.kills and time.perf_counter() - began + 2 * duration < args.time_budget:
            proc, _ = start(bulk_command(ckpt, out, samples), log, BULK_MARKER)
            runs += 1
            if len(chain) < limit:
                delay, name = rng.uniform(0.0, duration), rng.choice(signals)
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    proc.send_signal(getattr(signal, f"SIG{name}"))
                if proc.wait() != 0:  # killed (a run that finished first completes below)
                    kills += 1
                    problems = part_problems(out / "parts", reference)
                    lost += len(problems)
                    failures += [f"kill {kills} (SIG{name} + {delay:.2f} s): {p}" for p in problems]
                    chain.append(name)
                    print(f"kill {kills} (SIG{name} + {delay:.2f} s) -> exit {proc.returncode}, "
                          f"{len(list((out / 'parts').glob('[0-9]*.npz')))} parts: "
                          f"{'ok' if not problems else 'BROKEN'}", flush=True)
                    continue
            if proc.wait() != 0:
                failures.append(f"a rerun exited {proc.returncode}: {log.read_text()[-300:]}")
            got = npz_arrays(next(out.glob("samples_*.npz")))
            same = all(np.array_equal(got[k], reference[k]) for k in reference)
            identical += len(chain) if same else 0
            if not same:
                failures.append(f"the npz completed after {chain} differs from the reference")
            print(f"completed after {len(chain)} kill(s): {'identical' if same else 'DIFFERENT'}",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
            chain, limit = [], rng.randint(1, 3)
        if chain:  # finish the last chain
            runs += 1
            done = subprocess.run(bulk_command(ckpt, out, samples), env=run_env(), check=False,
                                  capture_output=True)
            got = next(out.glob("samples_*.npz"), None)
            if done.returncode == 0 and got is not None and all(
                    np.array_equal(npz_arrays(got)[k], reference[k]) for k in reference):
                identical += len(chain)
            else:
                failures.append(f"the last rerun (exit {done.returncode}) did not give the npz")
    print(f"{kills} kills, {identical} identical resumed npz, {lost} lost or wrong parts, {runs} "
          f"runs; {time.perf_counter() - began:.0f} s")
    for failure in failures:
        print("FAIL:", failure)
    if args.json:
        args.json.write_text(json.dumps({"target": "bulk", "kills": kills, "identical": identical,
                                         "lost_or_wrong_parts": lost, "runs": runs,
                                         "failures": failures, "signals": signals,
                                         "samples": samples, "seed": args.seed}, indent=2) + "\n")
    return 1 if failures else 0


def wait_for(proc: subprocess.Popen, log: Path, marker: str) -> float:
    """Wait until ``proc`` printed ``marker`` to ``log`` (or exited); return that moment
    (perf_counter)."""
    while proc.poll() is None and marker not in log.read_text(errors="replace"):
        time.sleep(0.005)
    return time.perf_counter()


def start(cmd: list[str], log: Path, marker: str = "run dir ") -> tuple[subprocess.Popen, float]:
    """Start ``cmd`` with its output in ``log``; return once it printed ``marker`` (train.py's start line,
    printed just before the first step) or exited, with that moment (perf_counter)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=run_env(), stdout=out, stderr=subprocess.STDOUT)
    while proc.poll() is None and marker not in log.read_text(errors="replace"):
        time.sleep(0.02)
    return proc, time.perf_counter()


def last_step_of(output: str, default: int) -> int:
    """The step of the last "saved checkpoint .../NNNNNNN.pt" line train.py printed (``default`` if none)."""
    import re

    found = re.findall(r"saved checkpoint \S*?(\d{7})(?:-milestone)?\.pt", output)
    return int(found[-1]) if found else default


if __name__ == "__main__":
    sys.exit(main())
