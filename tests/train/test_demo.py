"""The embedded default (``mcore-train`` with no config) runs end to end and its loss falls."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys


def test_embedded_default_trains_and_ends_with_a_sample(tmp_path):
    exe = shutil.which("mcore-train")
    argv = [exe] if exe else [sys.executable, "-m", "mcore.train"]
    # The demo as shipped, shortened: 40 steps instead of 300, no evaluation or plot.
    argv += ["train.steps=40", "log.interval=10", "train.eval_interval=0", "log.plot=false", "train.sample_tokens=24"]
    proc = subprocess.run(
        argv,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "resolved config" in out and "hidden_size: 128" in out  # the config is printed at start
    losses = [float(x) for x in re.findall(r"^step +\d+/40 \| loss ([0-9.]+)", out, flags=re.M)]
    assert len(losses) == 4, out[-2000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert re.search(r"^sample: '.+'$", out, flags=re.M)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "checkpoints" / "latest").read_text().strip() == "iter_0000040"
    assert (runs[0] / "config.yaml").is_file() and (runs[0] / "metrics.jsonl").is_file()
