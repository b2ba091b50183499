"""The way from the command line to a training step: the start state, the trainer's state dict, the public
checkpoint loader, and what users hit on the way (config listing, logging, evaluate without data, errors)."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import mcore.train.checkpoint.reader as reader_module
from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.train import log_setup
from mcore.train.checkpoint import CheckpointReader, ModelCheckpointWriter, load_model
from mcore.train.checkpoint.directory import CheckpointDirectory
from mcore.train.checkpoint.state import CheckpointSaver
from mcore.train.cli import main
from mcore.train.config import load_config
from mcore.train.config_help import config_keys
from mcore.train.datasets import build_run_data, microbatch_stream
from mcore.train.errors import UserError
from mcore.train.runtime import init_runtime
from mcore.train.start import RunStart
from mcore.train.trainer import Trainer, microbatch_to_device
from tests.train.tiny import TINY, train


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _batches(config, trainer, steps: int) -> list[list[dict]]:
    data = build_run_data(config)
    stream = microbatch_stream(data.train, config, consumed_samples=0, dp_rank=0, dp_size=1)
    return [[microbatch_to_device(next(stream), trainer.device) for _ in range(trainer.num_microbatches)]] * steps


def _copy_state(state: dict) -> dict:
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return value

    return copy(state)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("path") / "run"
    train(run_dir, "train.steps=3")
    return run_dir


# ------------------------------------------------------------------------------------------------ trainer state
def test_trainer_state_dict_restores_another_trainer_exactly():
    config = load_config(None, [*TINY, "train.skip_nonfinite=true"])
    runtime = init_runtime(config)
    first = Trainer(config, runtime)
    batches = _batches(config, first, 3)
    for micro in batches[:2]:
        first.train_step(micro)
    state = _copy_state(first.state_dict())
    assert state["iteration"] == 2 and state["consumed_samples"] == 2 * config.train.global_batch_size
    assert "embedding.weight" in state["model"] and state["optimizer"]["step"] == 2

    other = Trainer(load_config(None, [*TINY, "train.seed=99"]), runtime)  # different initial weights
    other.load_state_dict(state)
    assert (other.iteration, other.consumed_samples) == (2, state["consumed_samples"])
    a, b = first.train_step(batches[2]), other.train_step(batches[2])
    assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm) and a.lr == b.lr
    for (name, p, _), (_, q, _) in zip(first.named_local_parameters(), other.named_local_parameters()):
        assert torch.equal(p, q), name


def test_trainer_load_state_dict_names_what_is_missing():
    config = load_config(None, TINY)
    trainer = Trainer(config, init_runtime(config), with_optimizer=False)
    with pytest.raises(ValueError, match=r"lacks \['consumed_samples'\]"):
        trainer.load_state_dict({"iteration": 3})
    with pytest.raises(ValueError, match="the trainer has no optimizer"):
        trainer.load_state_dict({"iteration": 3, "consumed_samples": 0, "optimizer": {"step": 1}})


def test_the_start_checkpoint_is_opened_once(capsys, tmp_path, trained, monkeypatch):
    opened = []
    original = reader_module.CheckpointReader.__init__

    def counting(self, path):
        opened.append(Path(path))
        original(self, path)

    monkeypatch.setattr(reader_module.CheckpointReader, "__init__", counting)
    ckpt = trained / "checkpoints"
    code, out, _ = _run(capsys, *TINY, "train.steps=5", f"log.run_dir={tmp_path / 'ft'}", "--load", str(ckpt))
    assert code == 0 and "resuming from" in out and "done: step 5" in out
    assert opened == [ckpt]


def test_run_start_names_one_start_state(trained):
    config = load_config(None, [*TINY, "train.steps=5"])
    with RunStart.open(config, load=trained / "checkpoints") as start:
        assert start.full_resume and start.checkpoint is not None and start.trainer is None
        trainer = start.build(config, init_runtime(config))
    assert start.trainer is trainer and trainer.iteration == 3 and "resuming from" in start.description
    fresh = RunStart.open(config)
    assert fresh.checkpoint is None and fresh.description == "starting from random weights"


# ------------------------------------------------------------------------------------------------ load_model
def test_load_model_gives_the_saved_model_with_its_vocabulary_padded(tmp_path):
    # tp=1 training pads llama-tiny's 320 tokens to 384 (make_vocab_size_divisible_by 128): the loaded
    # model must pad the same way and give the trainer's logits exactly.
    config = load_config(None, [*TINY, "model.make_vocab_size_divisible_by=128"])
    trainer = Trainer(config, init_runtime(config))
    trainer.train_step(_batches(config, trainer, 1)[0])
    CheckpointSaver(trainer, CheckpointDirectory(tmp_path), keep_last=1, async_save=False).save(None)
    model = load_model(tmp_path)
    assert isinstance(model, GPTModel) and not model.training
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trainer.chunks[0].eval()(ids)
        got = model(ids)
    assert got.shape == expected.shape == (2, 16, 384)
    assert torch.equal(got, expected)


def test_load_model_re_pads_a_model_only_checkpoint(tmp_path):
    config = get_config("llama-tiny")
    source = GPTModel(config)
    source.init_weights(7)
    with ModelCheckpointWriter(tmp_path / "ckpt", config) as writer:  # stored without vocabulary padding
        for name, param in source.named_parameters():
            full = param.detach()
            writer.add(name, full[: config.vocab_size] if getattr(param, "vocab_padded_dim", None) == 0 else full)
    with CheckpointReader(tmp_path / "ckpt") as reader:
        model = load_model(reader)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))
    half = load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert torch.equal(half.embedding.weight, source.embedding.weight.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------ config command
def test_config_command_lists_every_key_with_type_default_and_help(capsys):
    code, out, _ = _run(capsys, "config")
    assert code == 0
    keys = config_keys()
    assert len(keys) > 80 and all(k.help for k in keys), [k.key for k in keys if not k.help]
    lines = out.splitlines()
    assert lines[0].split() == ["key", "type", "default", "help"]
    assert len(lines) == len(keys) + 1
    steps = next(line for line in lines if line.startswith("train.steps "))
    assert re.match(r"train\.steps\s+int\s+300\s+optimizer steps of the run$", steps)
    split = next(line for line in lines if line.startswith("data.split "))
    assert "'95,5,0'" in split and "train/valid/test" in split


def test_config_command_prints_the_resolved_config(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 40\nmodel: llama-tiny\n")
    code, out, _ = _run(capsys, "config", "--config", str(path), "optim.clip_grad=0.5")
    assert code == 0
    resolved = yaml.safe_load(out)
    assert resolved["train"]["steps"] == 40 and resolved["optim"]["clip_grad"] == 0.5
    assert resolved["model"]["hidden_size"] == get_config("llama-tiny").hidden_size
    code, _, err = _run(capsys, "config", "optim.clip_gard=0.5")
    assert code == 2 and "did you mean 'optim.clip_grad'" in err


# ------------------------------------------------------------------------------------------------ logging
@pytest.fixture
def fresh_logging(monkeypatch):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    # An earlier main() in this process captured warnings already (and logging then ignores a second request).
    current = warnings.showwarning
    logging.captureWarnings(False)
    warnings.showwarning = current
    for handler in list(root.handlers):
        if handler.get_name() == "mcore-train":
            root.removeHandler(handler)
    yield
    for handler in list(root.handlers):
        if handler.get_name() == "mcore-train":
            root.removeHandler(handler)
    for handler in saved[0]:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(saved[1])
    logging.captureWarnings(False)


def test_cli_logs_time_and_level_on_rank_zero(capsys, monkeypatch, fresh_logging):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["config"]) == 0
    capsys.readouterr()
    logging.getLogger("mcore.kernels").info("mcore.kernels.swiglu: using the reference backend")
    # what warnings.warn calls to show a warning (pytest records warn() itself, so call the hook directly)
    warnings.showwarning("something to look at", UserWarning, __file__, 1)
    err = capsys.readouterr().err.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" INFO mcore\.kernels: mcore\.kernels\.swiglu: using the reference backend", err[0])
    assert re.match(stamp + r" WARNING py\.warnings: .*something to look at", err[1])


def test_other_ranks_log_warnings_only_with_their_rank(capsys, monkeypatch, fresh_logging):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    log_setup.configure_logging()
    logging.getLogger("mcore.kernels").info("not shown")
    logging.getLogger("mcore.kernels").warning("shown")
    err = capsys.readouterr().err
    assert "not shown" not in err and re.search(r"WARNING \[rank 3\] mcore\.kernels: shown", err)


# ------------------------------------------------------------------------------------------------ what users hit
def test_evaluate_of_a_model_only_checkpoint_without_data_settings_refuses(capsys, tmp_path):
    config = get_config("llama-tiny")
    model = GPTModel(config)
    with ModelCheckpointWriter(tmp_path / "ckpt", config) as writer:
        for name, param in model.named_parameters():
            full = param.detach()
            writer.add(name, full[: config.vocab_size] if getattr(param, "vocab_padded_dim", None) == 0 else full)
    code, out, err = _run(capsys, "evaluate", "--load", str(tmp_path / "ckpt"), "train.device=cpu")
    assert code == 2 and out == ""
    line = err.strip().splitlines()[-1]
    assert line.startswith("mcore-train: error: checkpoint ") and "holds no training config" in line
    assert "data.path=PREFIX data.tokenizer=NAME" in line
    code, _, err = _run(capsys, "evaluate", "--load", str(tmp_path / "ckpt"), "train.device=cpu", "data.seq_length=32")
    assert code == 2 and "holds no training config" in err  # a sequence length does not say which tokens
    # naming the data is enough (here the embedded corpus, whose byte tokenizer fits the model's vocabulary)
    code, out, _ = _run(
        capsys, "evaluate", "--load", str(tmp_path / "ckpt"), "train.device=cpu", "data.tokenizer=byte",
        "data.seq_length=32", "train.eval_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2",
    )  # fmt: skip
    assert code == 0 and '"val_loss"' in out


def test_a_split_without_validation_documents_names_the_fix():
    config = load_config(None, [*TINY, "data.split=100,0,0", "train.eval_interval=5"])
    with pytest.raises(UserError) as info:
        build_run_data(config)
    message = str(info.value)
    assert "data.split='100,0,0' leaves no valid documents in 'embedded:tiny_corpus'" in message
    assert "data.split='95,5,0'" in message and "train.eval_interval=0" in message
    with pytest.raises(UserError, match="leaves no valid documents") as info:
        build_run_data(config, for_training=False)
    assert "eval_interval" not in str(info.value)


def test_a_value_error_while_the_trainer_is_built_is_one_line(capsys, tmp_path, monkeypatch):
    import mcore.train.trainer as trainer_module

    def refuse(*args, **kwargs):
        raise ValueError("layer range (3, 1) of virtual stage 1 is empty")

    monkeypatch.setattr(trainer_module, "build_stage_chunks", refuse)
    code, _, err = _run(capsys, *TINY, f"log.run_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "mcore-train: error: cannot build this run's model: layer range (3, 1) of virtual stage 1 is empty"
    )
