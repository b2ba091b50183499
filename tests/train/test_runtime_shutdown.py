"""How a run lets go of torch.distributed: destroyed after success, left to the launcher after a failure.

Destroying NCCL communicators waits on the other ranks; when this rank failed they may be blocked in a
collective with it, and the job hangs instead of ending (seen on 2 H200s: a rank that failed while building
its model sat in ``destroy_process_group`` for minutes). Gloo does not hang there, so these tests check the
decision rather than the hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mcore.train.loop
import mcore.train.runtime
from mcore.train.cli import main
from mcore.train.runtime import Runtime
from tests.train.tiny import TINY


def _runtime(world_size: int) -> Runtime:
    return Runtime(
        rank=0,
        world_size=world_size,
        local_rank=0,
        device=torch.device("cpu"),
        groups=None,
        control_group=None,
        owns_process_group=True,
    )


@pytest.fixture
def destroyed(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append(1))
    return calls


def test_shutdown_destroys_the_group_unless_this_rank_failed(destroyed):
    _runtime(2).shutdown()
    assert len(destroyed) == 1
    _runtime(2).shutdown(failed=True)
    assert len(destroyed) == 1, "a failed rank of a multi-rank job must not wait on its peers"
    _runtime(1).shutdown(failed=True)  # alone: nobody to wait for
    assert len(destroyed) == 2


class _RecordingRuntime:
    is_logging_rank = True
    __enter__, __exit__ = Runtime.__enter__, Runtime.__exit__

    def __init__(self) -> None:
        self.shutdowns: list[bool] = []

    def shutdown(self, *, failed: bool = False) -> None:
        self.shutdowns.append(failed)


@pytest.mark.parametrize("fails", [False, True])
def test_train_command_shuts_down_once_and_says_whether_it_failed(monkeypatch, tmp_path, fails):
    runtime = _RecordingRuntime()
    monkeypatch.setattr(mcore.train.runtime, "init_runtime", lambda config: runtime)

    def run_training(config, rt, **_):
        assert rt is runtime
        if fails:
            raise RuntimeError("a rank failed while building its model")

    monkeypatch.setattr(mcore.train.loop, "run_training", run_training)
    argv = [*TINY, f"log.run_dir={tmp_path / 'run'}"]
    if fails:
        with pytest.raises(RuntimeError, match="while building its model"):
            main(argv)
    else:
        assert main(argv) == 0
    assert runtime.shutdowns == [fails]
