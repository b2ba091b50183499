"""The loop's fault handling: SIGTERM saves and exits cleanly; NaN steps are skipped, then stop the run;
asynchronous checkpoints commit the same state as synchronous ones."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from mcore.train.checkpoint import CheckpointReader
from mcore.train.fault import TrainingDiverged
from mcore.train.trainer import Trainer
from tests.train.tiny import train, train_records


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, monkeypatch):
    original = Trainer.train_step

    def step_then_signal(self, microbatches):
        out = original(self, microbatches)
        if self.iteration == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    result, log = train(tmp_path / "run")
    assert result.status == "stopped" and result.iteration == 3
    assert "received signal 15: saving a checkpoint at step 3" in log
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed, log = train(tmp_path / "run")
    assert resumed.status == "finished" and resumed.iteration == 12 and "resuming from" in log


def _nan_from_step(first_bad_step: int):
    original = Trainer._forward_step

    def forward_step(self, chunk_index, input_tensor, batch):
        out = original(self, chunk_index, input_tensor, batch)
        if self.iteration + 1 >= first_bad_step and out.dim() == 0:
            return out * float("nan")
        return out

    return forward_step


def test_nan_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_forward_step", _nan_from_step(5))
    with pytest.raises(TrainingDiverged) as info:
        train(tmp_path / "run", "checkpoint.save_interval=2", "train.max_nonfinite_steps=3")
    message = str(info.value)
    assert "3 steps in a row (last at step 7)" in message
    assert "iter_0000006" in message  # the last good checkpoint (steps 5 and 6 were skipped, not applied)
    records = train_records(tmp_path / "run")
    assert records[6]["skipped_steps"] == 2 and records[4]["skipped_steps"] == 0
    assert all(torch.isfinite(torch.tensor(records[s]["loss"])) for s in (1, 2, 3, 4))
    ckpts = tmp_path / "run" / "checkpoints"
    with CheckpointReader(ckpts / "iter_0000006") as after_skips, CheckpointReader(ckpts / "iter_0000004") as before:
        for name in before.tensor_names():  # skipped steps left the weights alone
            assert torch.equal(after_skips.read_full(name), before.read_full(name)), name


def test_nan_without_per_step_check_stops_at_the_log_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_forward_step", _nan_from_step(3))
    with pytest.raises(TrainingDiverged) as info:
        train(tmp_path / "run", "train.skip_nonfinite=false", "log.interval=4", "checkpoint.save_interval=2")
    message = str(info.value)
    assert "at step 3" in message and "skip_nonfinite off" in message and "iter_0000002" in message
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "iter_0000002"  # nothing trained on NaN gradients was saved


def test_async_checkpoints_match_synchronous_ones(tmp_path):
    train(tmp_path / "sync", "train.steps=6", "checkpoint.save_interval=2")
    train(tmp_path / "async", "train.steps=6", "checkpoint.save_interval=2", "checkpoint.async_save=true")
    for run in ("sync", "async"):
        assert (tmp_path / run / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
    for step in ("iter_0000004", "iter_0000006"):  # keep_last=2
        sync, asynchronous = (tmp_path / run / "checkpoints" / step for run in ("sync", "async"))
        with CheckpointReader(sync) as a, CheckpointReader(asynchronous) as b:
            assert a.train_state["consumed_samples"] == b.train_state["consumed_samples"]
            for name in a.tensor_names():
                assert torch.equal(a.read_full(name), b.read_full(name))
                key = f"{name}/exp_avg_sq"
                assert torch.equal(a.read_full(name, kind="optim", key=key), b.read_full(name, kind="optim", key=key))
    assert not (tmp_path / "async" / "checkpoints" / "iter_0000002").exists()
