"""Benchmark workers end with their orchestrator: an orchestrator killed from outside (an outer ``timeout``)
must not leave its worker running (it held the GPU through the next benchmark on the H200, 2026-12-01)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_worker_dies_with_a_killed_orchestrator(tmp_path):
    pid_file = tmp_path / "worker.pid"
    worker = tmp_path / "worker.py"
    worker.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    orchestrator = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        from pathlib import Path
        from _common import launch_workers
        launch_workers(
            Path({str(worker)!r}), 1, [], names=["w"], log_path=Path({str(tmp_path / "log.txt")!r}), env={{}},
            timeout_s=600,
        )
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", orchestrator], env=env)
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and parent.poll() is None, "the worker never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        if not _alive(child):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the worker outlived its orchestrator")


def _alive(pid: int) -> bool:
    """Running (a killed orphan may linger as a zombie until its new parent reaps it: that counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
