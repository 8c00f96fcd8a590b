"""``notebooks/quickstart.ipynb`` runs offline, as stored, and draws what it says it draws.

The notebook's code cells are executed in order in one namespace (what "Run all" does in Jupyter),
in a fresh Python process with ``HF_HUB_OFFLINE=1`` (read by huggingface_hub at import, hence the
subprocess) and a 20-step training run in a temporary folder (``QUICKSTART_STEPS``): no Jupyter, no
nbformat, nothing downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from tests.helpers import load_sample_cli

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
#: exec every code cell of the notebook given as argv[1], in order, in one namespace
RUNNER = """import json, sys
cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["cell_type"] == "code"]
assert cells, "no code cells"
namespace = {"__name__": "__main__"}
for i, cell in enumerate(cells):
    exec(compile("".join(cell["source"]), f"<quickstart cell {i}>", "exec"), namespace)
"""


def test_notebook_is_stored_clean():
    """nbformat 4, code cells without outputs or execution counts (no stale images in git)."""
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 3
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)


def test_notebook_runs_offline(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUICKSTART_STEPS": "20",
           "QUICKSTART_RUN": str(run), "QUICKSTART_OUT": str(out), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("QUICKSTART_OFFICIAL", None)  # the default official name, skipped because offline
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(NOTEBOOK)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # it trained the missing run for QUICKSTART_STEPS steps, and only that
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt")) == ["0000020.pt"]
    assert "offline (HF_HUB_OFFLINE=1): skipping SiT-XL-2-256.pt" in proc.stdout
    assert not (out / "official.png").exists()
    grid = np.asarray(Image.open(out / "demo.png"))
    assert grid.ndim == 3 and grid.shape[0] < grid.shape[1]  # 2 rows of 10
    # the notebook's claim: generator=1 gives the pixels of `sample.py grid --seed 1`
    status = load_sample_cli().main(
        ["grid", "--ckpt", str(run / "checkpoints" / "0000020.pt"), "--classes",
         *map(str, range(10)), "--num-images", "20", "--nrow", "10", "--seed", "1",
         "--no-progress", "--out", str(tmp_path / "cli")])
    capsys.readouterr()
    assert status == 0
    np.testing.assert_array_equal(grid, np.asarray(Image.open(tmp_path / "cli" / "grid.png")))
