"""The hang report names the rank that stopped and what the others wait in (issue #25): heartbeat files,
their diagnosis, and the description of a blocked ``torch.distributed`` call or asynchronous wait."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore.train.blocking_call import describe_blocking_call
from mcore.train.fault import HangWatchdog
from mcore.train.heartbeat import Heartbeat, HeartbeatBoard, diagnose
from tests.helpers.distributed import run_workers


def _beat(rank: int, written: float, since: float, call: str | None = None, step: int = 7) -> Heartbeat:
    return Heartbeat(rank, 1000 + rank, "node-a", step, "forward-backward", since, call, written)


def test_diagnosis_names_the_stopped_rank_and_what_the_others_wait_in():
    now = 10_000.0
    beats = {
        0: _beat(0, now - 0.5, 20.0, call="torch.distributed all_reduce() over ranks [0, 1, 2, 3]"),
        1: _beat(1, now - 25.0, 0.1, step=6),  # its whole process stopped reporting
        2: _beat(2, now - 0.2, 0.3),  # fine
        3: _beat(3, now - 0.4, 21.0),  # alive but stuck outside torch.distributed
    }
    found = diagnose(beats, now=now, stale_after=5.0, started=now - 100)
    assert found.stopped == [1, 3] and [b.rank for b in found.frozen] == [1]
    assert "rank 0: waiting for 20 s in torch.distributed all_reduce() over ranks [0, 1, 2, 3]" in found.lines[0]
    assert "rank 1: stopped making progress: its process has not reported for 25 s" in found.lines[1]
    assert "step 6" in found.lines[1] and "pid 1001 on host node-a" in found.lines[1]
    assert found.lines[2].startswith("rank 2: making progress")
    assert "rank 3: stopped making progress: no progress for 21 s, not inside a torch.distributed" in found.lines[3]


def test_diagnosis_of_a_rank_without_heartbeat_in_this_run():
    now = 10_000.0
    found = diagnose({0: None, 1: _beat(1, now - 5000, 0.0)}, now=now, stale_after=5.0, started=now - 60)
    assert found.stopped == [0, 1] and found.frozen == []
    assert all("no heartbeat in this run" in line for line in found.lines)


def test_board_round_trip_and_cleanup(tmp_path):
    boards = [HeartbeatBoard(tmp_path / "hb", rank, 2) for rank in range(2)]
    boards[0].publish(3, "optimizer", 1.5, None)
    beats = boards[1].read_all()
    assert beats[1] is None and beats[0].step == 3 and beats[0].host == socket.gethostname()
    boards[1].publish(3, "data loading", 0.0, None)
    boards[0].remove_own()
    assert (tmp_path / "hb").is_dir()  # rank 1's file is still there
    boards[1].remove_own()
    assert not (tmp_path / "hb").exists()


def test_watchdog_report_lists_every_rank(tmp_path):
    peer = HeartbeatBoard(tmp_path, 1, 2)
    peer.publish(4, "forward-backward", 0.0, None)  # and then never again: a stopped process
    reports = []
    with HangWatchdog(0.6, rank=0, on_hang=reports.append, poll_interval=0.1, heartbeat_dir=tmp_path, world_size=2):
        deadline = time.monotonic() + 30
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(reports) == 1
    assert "rank(s) 0, 1 stopped making progress" in reports[0]
    assert "rank 1: stopped making progress: its process has not reported" in reports[0]
    assert "rank 0: stopped making progress: no progress for" in reports[0]  # it sleeps outside torch.distributed


class _Buckets:
    """Like the gradient buffer: an asynchronous all-reduce, waited for later through ``self``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.dp_group = group
        self.handle = None

    def finish(self) -> None:
        self.handle.wait()


def _describe_while_blocked(target, *args) -> str | None:
    """Run ``target(*args)`` in a thread; once it blocks, describe its stack from outside."""
    worker = threading.Thread(target=target, args=args)
    worker.start()
    described = None
    deadline = time.monotonic() + 60
    while described is None and time.monotonic() < deadline:
        time.sleep(0.05)
        described = describe_blocking_call(sys._current_frames().get(worker.ident))
    return described, worker


def _cases(rank: int, world_size: int, flag: str):
    group = dist.new_group([0, 1])
    out = {}
    if rank == 0:
        buckets = _Buckets(group)
        buckets.handle = dist.all_reduce(torch.ones(1), group=group, async_op=True)
        out["async"], worker = _describe_while_blocked(buckets.finish)
        Path(flag + ".async").write_text("go")
        worker.join()
        buf = torch.zeros(1)
        out["recv"], worker = _describe_while_blocked(dist.recv, buf, 1)
        Path(flag + ".recv").write_text("go")
        worker.join()
    else:
        for stage in ("async", "recv"):
            deadline = time.monotonic() + 120
            while not Path(f"{flag}.{stage}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if stage == "async":
                dist.all_reduce(torch.ones(1), group=group)
            else:
                dist.send(torch.ones(1), dst=0)
    return out


@pytest.fixture(scope="module")
def blocked(tmp_path_factory):
    return run_workers(2, _cases, str(tmp_path_factory.mktemp("blocked") / "flag"))[0]


def test_an_asynchronous_wait_is_named_with_its_peers(blocked):
    text = blocked["async"]
    assert text is not None and "the .wait() of an asynchronous torch.distributed operation" in text
    assert "`self.handle.wait()`" in text and "over ranks [0, 1]" in text and "(finish)" in text


def test_a_blocking_receive_names_its_peer(blocked):
    assert blocked["recv"].startswith("torch.distributed recv() from rank 1")
