"""kill -9 in the middle of writing a checkpoint leaves the previous one loadable and ``latest`` on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from mcore.train.checkpoint import CheckpointReader
from tests.train.tiny import TINY, train, train_records

# The child trains with a checkpoint every 2 steps; while writing the second one (step 4) it leaves a
# half-written shard, tells the parent, and waits to be killed.
CHILD = textwrap.dedent(
    """
    import sys, time, pathlib
    import mcore.train.checkpoint.state as state
    from mcore.train.cli import main

    marker = pathlib.Path(sys.argv[1])
    original = state._save_shard

    def half_written(tensors, path):
        original(tensors, path)
        if "iter_0000004" in str(path):
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            marker.write_text("writing")
            time.sleep(600)

    state._save_shard = half_written
    sys.exit(main(sys.argv[2:]))
    """
)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    marker = tmp_path / "marker"
    argv = [*TINY, "train.steps=8", "checkpoint.save_interval=2", f"log.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), *argv], env=env)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached the second checkpoint save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000002"
    assert not (ckpts / "iter_0000004").exists()
    assert [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]  # the half-written save stays invisible
    with CheckpointReader(ckpts) as reader:
        assert reader.iteration == 2
        for name in reader.tensor_names():
            assert reader.read_full(name).isfinite().all()

    # Starting again resumes from step 2, removes the partial save and finishes.
    result, log = train(run_dir, "train.steps=8", "checkpoint.save_interval=2")
    assert "resuming from" in log and "iter_0000002" in log
    assert result.iteration == 8 and (ckpts / "latest").read_text().strip() == "iter_0000008"
    assert not [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert sorted(train_records(run_dir)) == list(range(1, 9))
