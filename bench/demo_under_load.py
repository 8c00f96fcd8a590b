"""The demo (`python train.py`) on a busy machine: wall time with N concurrent CPU-bound processes vs without.

    python -m bench.demo_under_load                       # the full demo (2000 steps), 2 load processes
    python -m bench.demo_under_load --steps 500 --json out.json
    python -m bench.demo_under_load --threads 2           # force torch's old default (one thread per core)

Each run is the real command line, ``python train.py train.out_dir=<tmp> train.steps=<steps>``, in a fresh
process with OMP_NUM_THREADS / MKL_NUM_THREADS removed from its environment, so the thread count is the one
train.py chooses itself (``--threads`` passes ``train.cpu_threads``). The load is ``--load-procs`` Python spin
loops (one core each) started before the loaded run and killed after it. Reported: both wall times, their
ratio (target <= 2.5 on a 2-core machine with 2 load processes), the 1-minute load average before each run
(on a shared machine the "idle" run is not idle: the ratio understates the load effect, never overstates it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sit_vit5.utils.cpu_threads import THREAD_ENV_VARS, load_average, usable_cores

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True:\n    pass\n"


def run_demo(steps: int, threads: int | None, out_dir: Path) -> float:
    """Wall seconds of one demo run (start-up included, as a user sees it)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
    cmd = [sys.executable, str(ROOT / "train.py"), f"train.out_dir={out_dir}", f"train.steps={steps}",
           "train.tensorboard=false"]
    if threads is not None:
        cmd.append(f"train.cpu_threads={threads}")
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="demo steps per run (default: the full demo)")
    p.add_argument("--load-procs", type=int, default=2, help="concurrent CPU-bound processes (default 2)")
    p.add_argument("--threads", type=int, default=None, help="train.cpu_threads (default: train.py's choice)")
    p.add_argument("--json", type=Path, default=None, help="write the result here as JSON")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="demo-load-") as tmp:
        load_idle = load_average()
        idle = run_demo(args.steps, args.threads, Path(tmp) / "idle")
        print(f"idle:   {idle:7.1f} s  (load average before: {load_idle:.2f})", flush=True)
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load_procs)]
        try:
            time.sleep(2)  # let the spinners reach full speed
            load_busy = load_average()
            busy = run_demo(args.steps, args.threads, Path(tmp) / "busy")
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()
    ratio = busy / idle
    print(f"loaded: {busy:7.1f} s  (+{args.load_procs} spinning processes; load average before: {load_busy:.2f})")
    print(f"ratio:  {ratio:.2f}x  (target <= 2.5x)  [{usable_cores()} usable cores, {args.steps} steps, "
          f"threads: {args.threads or 'auto'}]")
    if args.json:
        args.json.write_text(json.dumps({
            "steps": args.steps, "load_procs": args.load_procs, "threads": args.threads, "cores": usable_cores(),
            "idle_s": round(idle, 2), "loaded_s": round(busy, 2), "ratio": round(ratio, 3),
            "load_avg_before": {"idle": load_idle, "loaded": load_busy}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
