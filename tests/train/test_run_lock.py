"""One live run per run directory (lock file with pid and host, stale locks taken over), and workers that end
when their parent dies (issue #25)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mcore.train.cli import main
from mcore.train.errors import UserError
from mcore.train.run_lock import LOCK_FILE, RunLock, held_by_parent, process_alive
from tests.train.tiny import TINY


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(run_dir, pid: int, host: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"pid": pid, "host": host or socket.gethostname(), "started": time.time()}
    (run_dir / LOCK_FILE).write_text(json.dumps(record))


def test_lock_names_its_owner_and_refuses_a_second_run(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        owner = json.loads((run_dir / LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        with pytest.raises(UserError) as info:
            RunLock(run_dir).acquire()
        message = str(info.value)
        assert "in use by a live run" in message and f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert (run_dir / LOCK_FILE).exists()  # the refused one did not remove the owner's lock
    assert not run_dir.exists()  # released: the lock file and the (empty) directory it made are gone


def test_stale_lock_is_taken_over_with_a_note(tmp_path):
    run_dir = tmp_path / "run"
    dead = _dead_pid()
    _write_lock(run_dir, dead)
    with RunLock(run_dir) as lock:
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert len(lock.notes) == 1 and f"stale lock of pid {dead}" in lock.notes[0]
    assert run_dir.is_dir() and not (run_dir / LOCK_FILE).exists()  # a directory it did not make stays


def test_a_stale_lock_replaced_meanwhile_by_another_starter_is_left_to_it(tmp_path):
    run_dir = tmp_path / "run"
    _write_lock(run_dir, _dead_pid())
    judged = json.loads((run_dir / LOCK_FILE).read_text())
    _write_lock(run_dir, os.getppid())  # another run took over first: its fresh lock now stands there
    fresh = (run_dir / LOCK_FILE).read_text()
    assert not RunLock(run_dir)._remove_stale(judged)
    assert (run_dir / LOCK_FILE).read_text() == fresh and sorted(os.listdir(run_dir)) == [LOCK_FILE]


def test_lock_of_another_host_is_refused_with_the_way_out(tmp_path):
    run_dir = tmp_path / "run"
    _write_lock(run_dir, 12345, host="some-other-node")
    with pytest.raises(UserError, match=r"another host \(pid 12345 on host some-other-node.*delete .*mcore-run.lock"):
        RunLock(run_dir).acquire()


def test_unreadable_lock_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text("{not json")
    with pytest.raises(UserError, match="unreadable lock file"):
        RunLock(run_dir).acquire()


def test_process_alive():
    assert process_alive(os.getpid())
    assert not process_alive(_dead_pid())
    assert not process_alive(0)


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    run_dir = tmp_path / "run"
    _write_lock(run_dir, os.getpid())  # a live pid ...
    record = json.loads((run_dir / LOCK_FILE).read_text())
    record["start_ticks"] = -1  # ... that a different, earlier process held when it took the lock
    (run_dir / LOCK_FILE).write_text(json.dumps(record))
    with RunLock(run_dir) as lock:
        assert lock.notes and "stale lock" in lock.notes[0]


def test_a_worker_recognises_its_launchers_lock(tmp_path):
    run_dir = tmp_path / "run"
    code = "import sys\nfrom mcore.train.run_lock import held_by_parent\nprint(held_by_parent(sys.argv[1]))\n"
    with RunLock(run_dir):
        assert not held_by_parent(run_dir)  # our own lock is not our parent's
        out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_cli_refuses_a_run_directory_in_use(capsys, tmp_path):
    run_dir = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _write_lock(run_dir, sleeper.pid)
        before = sorted(os.listdir(run_dir))
        code = main([*TINY, f"log.run_dir={run_dir}"])
    finally:
        sleeper.kill()
        sleeper.wait()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert f"in use by a live run (pid {sleeper.pid} on host {socket.gethostname()}" in lines[0]
    assert sorted(os.listdir(run_dir)) == before


# A parent that starts a child which asks to end with it, prints the child's pid, then waits to be killed.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
_CHILD = """
import time
import mcore.train.parent_watch as watch
if {force_watcher}:
    watch._request_parent_death_signal = lambda sig: False
print(watch.end_with_parent(poll_s=0.1), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("force_watcher", [False, True], ids=["prctl", "watcher"])
def test_child_ends_when_its_parent_is_killed(force_watcher):
    child_code = _CHILD.format(force_watcher=force_watcher)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, child_code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        how = parent.stdout.readline().strip()  # the child's line (it shares the parent's stdout)
        assert how == ("watcher" if force_watcher else "prctl")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(child), "the child outlived its parent"
    finally:
        if process_alive(child):
            os.kill(child, 9)
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize(
    "env,expected",
    [({}, "None"), ({"TORCHELASTIC_RUN_ID": "abc"}, "prctl"), ({"MCORE_LAUNCHER_PID": "PARENT"}, "prctl")],
    ids=["plain", "torchrun", "mcore-launcher"],
)
def test_workers_of_a_launcher_ask_to_end_with_it(env, expected):
    code = (
        "import os\nfrom mcore.train.parent_watch import end_with_launcher\n"
        "print(end_with_launcher(), 'MCORE_LAUNCHER_PID' in os.environ)\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "MCORE_LAUNCHER_PID")}
    env = {k: str(os.getpid()) if v == "PARENT" else v for k, v in env.items()}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected, "False"]  # the launcher's pid is not passed on to grandchildren
