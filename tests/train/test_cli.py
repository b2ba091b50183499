"""The ``mcore-train`` command: bad input gives one clear line and exit code 2; evaluate and plan print results."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mcore.train.cli import main
from tests.train.tiny import TINY, train


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run of the tiny model (its checkpoint feeds the evaluate and bad-checkpoint cases)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    train(run_dir, "train.steps=4")
    return run_dir


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train.stpes=3"], "unknown config key 'train.stpes'; did you mean 'train.steps'?"),
        (["train.steps=abc"], "config key 'train.steps' expects an integer, got 'abc'"),
        (["model=llama3-8"], "did you mean 'llama3-8b'?"),
        (["data.path=/nonexistent/corpus"], "/nonexistent/corpus"),
        (["--config", "/nonexistent/run.yaml"], "config file not found: /nonexistent/run.yaml"),
        (["--load", "/nonexistent/ckpt"], "checkpoint path does not exist: /nonexistent/ckpt"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, tmp_path, argv, message):
    code, out, err = _run(capsys, *TINY, *argv, f"log.run_dir={tmp_path / 'run'}")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcore-train: error: "), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_debug_shows_the_traceback(capsys, tmp_path):
    code, _, err = _run(capsys, "--debug", *TINY, "train.stpes=3")
    assert code == 2 and "Traceback" in err and "did you mean 'train.steps'" in err


def test_checkpoint_of_another_model_shape_is_refused(capsys, tmp_path, trained):
    before = _tree_digest(trained)
    code, _, err = _run(capsys, *TINY, "model.hidden_size=96", f"--load={trained}", f"log.run_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in err
    assert "different model (hidden_size: checkpoint 64, config 96" in err
    assert _tree_digest(trained) == before  # nothing overwritten


def test_truncated_checkpoint_is_refused_and_left_alone(capsys, tmp_path, trained):
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(trained, copy)
    shard = copy / "checkpoints" / "iter_0000004" / "model" / "tp00-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    before = _tree_digest(copy)
    code, _, err = _run(capsys, *TINY, "train.steps=8", f"log.run_dir={copy}")  # resumes from latest
    assert code == 2 and "Traceback" not in err
    assert "corrupt or truncated" in err and "tp00-pp00.safetensors" in err
    assert _tree_digest(copy) == before


def test_corrupt_metadata_is_refused(capsys, tmp_path, trained):
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(trained, copy)
    (copy / "checkpoints" / "iter_0000004" / "metadata.json").write_text('{"format": "mcore", "vers')
    code, _, err = _run(capsys, *TINY, "train.steps=8", f"log.run_dir={copy}")
    assert code == 2 and "invalid JSON" in err and "Traceback" not in err


def test_fine_tune_from_a_model_only_checkpoint(capsys, tmp_path, trained):
    import torch

    from mcore.train.checkpoint import CheckpointReader, ModelCheckpointWriter
    from tests.train.tiny import train_records

    # What mcore-bridge does: stream full tensors into a model-only checkpoint.
    reader = CheckpointReader(trained)
    with reader, ModelCheckpointWriter(tmp_path / "model-only", reader.model_config, dtype=torch.float32) as writer:
        for name in reader.tensor_names():
            writer.add(name, reader.read_full(name))
    code, out, err = _run(
        capsys, *TINY, "train.steps=2", f"--load={tmp_path / 'model-only'}", f"log.run_dir={tmp_path / 'ft'}"
    )
    assert code == 0, err
    assert "fine-tuning from step 0" in out
    scratch = _run(capsys, *TINY, "train.steps=2", f"log.run_dir={tmp_path / 'scratch'}")
    assert scratch[0] == 0
    fine_tuned, from_scratch = train_records(tmp_path / "ft")[1], train_records(tmp_path / "scratch")[1]
    assert fine_tuned["loss"] < from_scratch["loss"] - 0.3  # the loaded weights had already learned
    assert sorted(train_records(tmp_path / "ft")) == [1, 2]


def test_evaluate_prints_loss_and_perplexity(capsys, trained):
    code, out, err = _run(capsys, "evaluate", "--load", str(trained / "checkpoints"), *TINY, "train.eval_steps=2")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["iteration"] == 4
    assert 0 < result["val_loss"] < 10
    assert result["val_perplexity"] == pytest.approx(2.718281828459045 ** result["val_loss"], rel=1e-6)
    assert result["tokens"] == 2 * 4 * 32


def test_evaluate_without_config_reuses_the_run_config(capsys, trained):
    code, out, err = _run(capsys, "evaluate", "--load", str(trained), "train.eval_steps=2")
    assert code == 0, err
    alone = json.loads(out.strip().splitlines()[-1])
    code, out, _ = _run(capsys, "evaluate", "--load", str(trained), *TINY, "train.eval_steps=2")
    explicit = json.loads(out.strip().splitlines()[-1])
    assert alone["val_loss"] == explicit["val_loss"] and alone["tokens"] == explicit["tokens"]


def test_plan_reports_memory_and_fit(capsys):
    code, out, _ = _run(
        capsys,
        "plan",
        "model=llama3-8b",
        "parallel.tp=2",
        "parallel.pp=2",
        "data.seq_length=4096",
        "train.micro_batch_size=1",
        "train.global_batch_size=64",
        "--gpu-memory",
        "80",
    )
    assert code == 0
    assert "parameters: 8.030 B" in out
    assert "tp 2 x pp 2 x dp 1" in out and "fits in 80 GB" in out
    code, out, _ = _run(capsys, "plan", "model=llama3-8b", "data.seq_length=4096", "--gpu-memory", "80", "--json")
    plan = json.loads(out)
    assert plan["fits"] is False  # 8B on one 80 GB GPU with fp32 AdamW states does not fit
    assert plan["memory_gb"][0]["optimizer"] > 80


def test_plot_needs_a_run_dir(capsys, tmp_path):
    code, _, err = _run(capsys, "plot", str(tmp_path))
    assert code == 2 and "holds no metrics.jsonl" in err
