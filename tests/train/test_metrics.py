"""Metrics: JSONL records, the console line, the straggler summary, and the plot of a run."""

from __future__ import annotations

import io
import json

import pytest

from mcore.train.errors import UserError
from mcore.train.gpu_stats import straggler_report
from mcore.train.metrics import MetricsLogger, format_train_line, read_metrics
from tests.train.tiny import train


def test_logger_writes_jsonl_and_console(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=100, tensorboard=False, stream=out)
    record = {"kind": "train", "step": 20, "loss": 2.5, "lr": 1e-3, "grad_norm": float("nan"), "tokens_per_s": 12345.0}
    logger.log(record, console=format_train_line(record, 100))
    logger.log({"kind": "eval", "step": 20, "loss": 2.7})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["kind"] for r in records] == ["train", "eval"]
    assert records[0]["loss"] == 2.5 and records[0]["grad_norm"] != records[0]["grad_norm"]  # NaN survives
    line = out.getvalue().strip()
    assert line.startswith("step  20/100 | loss 2.5000") and "12.3k tok/s" in line and "lr 1.00e-03" in line
    with pytest.raises(ValueError, match="needs 'step' and 'kind'"):
        MetricsLogger(tmp_path, total_steps=1, tensorboard=False, stream=out).log({"loss": 1.0})


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "x", total_steps=10, enabled=False, stream=io.StringIO())
    logger.log({"kind": "train", "step": 1, "loss": 1.0, "lr": 0.1})
    logger.close()
    assert not (tmp_path / "x").exists()


def test_partial_last_line_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1}) + '\n{"kind": "tr')
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1}]


def test_straggler_report_flags_slow_ranks():
    report = straggler_report([0.10, 0.11, 0.10, 0.25], [0.01, 0.01, 0.01, 0.12])
    assert report["slowest_rank"] == 3 and report["stragglers"] == [3]
    assert report["median_step_s"] == pytest.approx(0.105) and report["slowest_data_s"] == 0.12


def test_run_records_every_interval_with_throughput(tmp_path):
    train(tmp_path / "run", "train.steps=6", "log.interval=2", "train.eval_interval=3", "train.eval_steps=1")
    records = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == [2, 4, 6]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    first = records[0]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_gpu", "step_time_s", "peak_memory_gb"):
        assert first[key] is not None and first[key] > 0, key
    assert first["mfu"] is None  # no peak FLOP/s is known for a CPU
    assert first["skipped_steps"] == 0 and first["consumed_samples"] == 8


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from mcore.train.plot import plot_run

    train(tmp_path / "run", "train.steps=4", "log.interval=1")
    path = plot_run(tmp_path / "run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_an_empty_run_is_a_user_error(tmp_path):
    pytest.importorskip("matplotlib")
    from mcore.train.plot import plot_run

    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no training records"):
        plot_run(tmp_path)
