"""The real launcher: ``mcore-train --nproc-per-node 2`` (torch elastic), and ``--max-restarts`` after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.train.tiny import TINY, train, train_records


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces, so split after the closing parenthesis
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _workers(launcher_pid: int) -> list[int]:
    """The worker processes: python processes running mcore.train below the launcher."""
    found = []
    stack = _children(launcher_pid)
    while stack:
        pid = stack.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mcore.train" in cmdline:
            found.append(pid)
        stack += _children(pid)
    return found


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_nproc_per_node_runs_data_parallel_workers(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "mcore.train", "--nproc-per-node", "2", *TINY, "train.steps=4"]
    proc = subprocess.run([*argv, f"log.run_dir={run_dir}"], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 = tp 1 x pp 1 x dp 2" in proc.stdout
    assert sorted(train_records(run_dir)) == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000004"


def test_max_restarts_resumes_after_a_worker_dies(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "mcore.train", "--nproc-per-node", "2", "--max-restarts", "1", *TINY]
    argv += ["train.steps=40", "checkpoint.save_interval=2", f"log.run_dir={run_dir}"]
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        latest = run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while not latest.exists():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # do not leave workers behind when the test fails
            for pid in _workers(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert "resuming from" in output
    assert latest.read_text().strip() == "iter_0000040"
    assert set(train_records(run_dir)) == set(range(1, 41))


def test_empty_virtual_stages_with_the_distributed_optimizer_train_like_one_process(tmp_path):
    # pp=2 x vpp=2 over 2 layers, [1, 0, 1, 0]: each rank holds one virtual stage without layers (rank 1's first
    # has no parameter at all); dp=2 with the distributed optimizer and the overlapped parameter all-gather.
    steps = ["train.steps=3", "train.global_batch_size=8"]
    single = tmp_path / "single"
    train(single, *steps)
    run_dir = tmp_path / "pp2vpp2dp2"
    argv = [sys.executable, "-m", "mcore.train", "--nproc-per-node", "4", *TINY, *steps, f"log.run_dir={run_dir}"]
    argv += ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "parallel.schedule=interleaved"]
    argv += ["parallel.pipeline_layout=[1, 0, 1, 0]", "parallel.distributed_optimizer=true"]
    argv += ["parallel.overlap_param_gather=true"]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers per virtual stage [1, 0, 1, 0]" in proc.stdout
    ref, got = train_records(single), train_records(run_dir)
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * abs(ref[step]["loss"]), step
