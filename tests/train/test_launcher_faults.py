"""Faults of a ``--nproc-per-node 2`` run (issue #25): SIGTERM to the launcher, the launcher killed outright, a
second run in the same directory, a rank that stops (SIGSTOP) under the hang watchdog. Real processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore.train.cli import main
from mcore.train.run_lock import LOCK_FILE, process_alive
from tests.train.test_launcher import _workers
from tests.train.tiny import TINY, train_records


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mcore.train", "--nproc-per-node", "2", *TINY, f"log.run_dir={run_dir}", *extra]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    argv = _argv(run_dir, *extra)
    return subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int) -> None:
    deadline = time.monotonic() + 300
    while (run_dir / "metrics.jsonl").exists() is False or len(train_records(run_dir)) < steps:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.05)


def _cleanup(proc: subprocess.Popen) -> None:
    """Never leave processes behind when a test fails."""
    for pid in _workers(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])


def test_sigterm_to_the_launcher_saves_and_exits_0_and_a_second_run_is_refused_meanwhile(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.steps=100000", "checkpoint.save_interval=0")
    try:
        _wait_for_steps(proc, run_dir, 3)
        second = subprocess.run(_argv(run_dir, "train.steps=3"), env=_env(), capture_output=True, text=True)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"in use by a live run (pid {proc.pid} on host" in second.stderr
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        _cleanup(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err and "SignalException" not in out + err
    lines = [line for line in out.splitlines() if line.startswith("mcore-train: stopped by SIGTERM")]
    assert len(lines) == 1, out[-3000:]
    match = re.search(r"checkpoint (\S+iter_(\d+)) \(step (\d+)\) saved", lines[0])
    assert match and int(match.group(2)) == int(match.group(3)), lines[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == Path(match.group(1)).name
    assert not (run_dir / LOCK_FILE).exists()


def test_workers_end_with_a_killed_launcher_and_its_stale_lock_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.steps=100000", "checkpoint.save_interval=0")
    try:
        _wait_for_steps(proc, run_dir, 3)
        workers = _workers(proc.pid)
        assert len(workers) == 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while any(process_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(process_alive(w) for w in workers), "workers outlived their launcher"
    finally:
        for pid in workers:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        _cleanup(proc)
    steps = len(train_records(run_dir))
    time.sleep(1.0)  # a worker still training would add records now
    assert len(train_records(run_dir)) == steps
    code = main([*TINY, "train.steps=2", f"log.run_dir={run_dir}"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"took over the stale lock of pid {proc.pid} on host" in out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.multigpu)])
def test_hang_watchdog_names_the_stopped_rank_and_ends_it(tmp_path, device):
    run_dir = tmp_path / "run"
    extra = ["train.steps=100000", "checkpoint.save_interval=0", "train.hang_timeout=4", f"train.device={device}"]
    proc = _start(run_dir, *extra)
    try:
        _wait_for_steps(proc, run_dir, 3)
        workers = _workers(proc.pid)
        stopped = next(pid for pid in workers if _rank_of(pid) == 1)
        os.kill(stopped, signal.SIGSTOP)
        out, err = proc.communicate(timeout=240)
    finally:
        _cleanup(proc)
    assert proc.returncode == 3, err[-3000:]
    assert "rank(s) 1 stopped making progress" in err
    assert "rank 1: stopped making progress: its process has not reported" in err
    waits = r"rank 0: waiting for \d+ s in (torch\.distributed \w+\(\)|the \.wait\(\) of an asynchronous)"
    assert re.search(waits, err)
    assert f"ended rank 1 (pid {stopped}), which no longer responds" in err  # the launcher need not wait for it
    assert not (run_dir / LOCK_FILE).exists()
