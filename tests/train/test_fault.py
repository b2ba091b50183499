"""Fault-tolerance pieces: signal flag, non-finite guard, hang watchdog (in one process and across ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore.train.fault import HangWatchdog, NonFiniteGuard, StopSignal, TrainingDiverged
from tests.helpers.distributed import run_workers


def test_stop_signal_records_sigterm_and_restores_handler():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes of the main thread
            if stop.requested:
                break
            time.sleep(0.01)
        assert stop.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_sigint_interrupts():
    with StopSignal() as stop, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        while not stop.requested:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


def test_non_finite_guard_counts_consecutive_steps_only():
    guard = NonFiniteGuard(3)
    for step, ok in enumerate([False, False, True, False, False]):
        guard.update(step, ok, last_checkpoint="ckpt/iter_0000004")
    assert guard.consecutive == 2 and guard.total_skipped == 4
    with pytest.raises(TrainingDiverged) as info:
        guard.update(5, False, last_checkpoint="ckpt/iter_0000004")
    message = str(info.value)
    assert "3 steps in a row" in message and "step 5" in message and "ckpt/iter_0000004" in message


def test_watchdog_reports_a_stalled_main_thread():
    reports = []
    with HangWatchdog(0.3, rank=5, on_hang=reports.append, poll_interval=0.05) as dog:
        dog.beat(12, "optimizer")
        deadline = time.monotonic() + 30
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(reports) == 1
    assert "rank 5" in reports[0] and "step 12" in reports[0] and "'optimizer'" in reports[0]
    assert "not inside a torch.distributed call" in reports[0]


def test_watchdog_default_action_dumps_stacks_and_exits():
    code = (
        "import time\nfrom mcore.train.fault import HangWatchdog\n"
        "HangWatchdog(0.3, rank=2, poll_interval=0.05).start()\ntime.sleep(60)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "hang watchdog: rank 2 made no progress" in proc.stderr
    assert "Python stacks of rank 2" in proc.stderr and "time.sleep" not in proc.stdout


def _stuck_in_recv(rank: int, world_size: int, flag: str):
    if rank == 0:
        reports = []

        def on_hang(report: str) -> None:
            reports.append(report)
            Path(flag).write_text("fired")

        with HangWatchdog(0.5, rank=0, on_hang=on_hang, poll_interval=0.05) as dog:
            dog.beat(3, "pipeline receive")
            buf = torch.zeros(1)
            dist.recv(buf, src=1)
        return reports
    deadline = time.monotonic() + 120
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.send(torch.ones(1), dst=0)
    return None


def test_watchdog_names_the_blocking_collective(tmp_path):
    reports = run_workers(2, _stuck_in_recv, str(tmp_path / "fired"))[0]
    assert len(reports) == 1
    assert "rank 0" in reports[0] and "step 3" in reports[0] and "'pipeline receive'" in reports[0]
    assert "blocked in torch.distributed recv()" in reports[0]
    assert "test_fault.py" in reports[0]  # the caller of the collective
