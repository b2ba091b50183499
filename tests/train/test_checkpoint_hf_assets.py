"""A run that starts from a checkpoint with an ``hf/`` directory writes the same files into every checkpoint it saves.

- fine-tuning from a model-only checkpoint (as mcore-bridge writes it): each saved checkpoint's ``hf/`` is
  byte-identical to the source's, also the ones after the source is gone and the run resumes from its own;
- a run from random weights (no source ``hf/``) writes none;
- the asset helpers refuse names that would leave ``hf/``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.train.checkpoint import (
    HF_ASSETS_DIR,
    CheckpointError,
    CheckpointReader,
    ModelCheckpointWriter,
    read_hf_assets,
    write_hf_assets,
)
from tests.train.tiny import train


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _model_only_checkpoint(path: Path, generator: torch.Generator) -> dict[str, bytes]:
    """A llama-tiny model-only checkpoint with random weights and an ``hf/`` of fresh random content."""
    config = get_config("llama-tiny")
    model = GPTModel(config)
    model.init_weights(int(torch.randint(0, 2**31, (1,), generator=generator)))
    with ModelCheckpointWriter(path, config) as writer:
        for name, param in model.named_parameters():
            full = param.detach()
            if getattr(param, "vocab_padded_dim", None) == 0:
                full = full[: config.vocab_size]
            writer.add(name, full)
    vocab = {f"tok{int(i)}": n for n, i in enumerate(torch.randperm(10_000, generator=generator)[:50])}
    files = {
        "config.json": json.dumps({"model_type": "llama", "extra": torch.rand(3, generator=generator).tolist()}),
        "tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": vocab}}, indent=2),
        "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}", "bos_token": "<s>"}),
        "special_tokens_map.json": '{"eos_token": "</s>"}\n',
        # Not valid UTF-8: the files must be carried as bytes, never decoded and re-encoded.
        "tokenizer.model": bytes(torch.randint(0, 256, (4096,), generator=generator, dtype=torch.uint8).tolist()),
    }
    sidecar = path / HF_ASSETS_DIR
    sidecar.mkdir()
    for name, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        (sidecar / name).write_bytes(data)
    return _tree(sidecar)


def test_hf_assets_follow_fine_tuning_and_resume(tmp_path):
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    source = tmp_path / "converted"
    expected = _model_only_checkpoint(source, generator)
    assert expected["tokenizer.json"] and len(expected) == 5
    run = tmp_path / "run"
    ckpts = run / "checkpoints"

    # Fine-tune 2 steps from the model-only checkpoint, saving after each.
    result, out = train(run, "train.steps=2", f"checkpoint.load={source}", "checkpoint.save_interval=1")
    assert result.status == "finished" and "fine-tuning from step 0" in out
    saved = sorted(p for p in ckpts.iterdir() if p.name.startswith("iter_"))
    assert [p.name for p in saved] == ["iter_0000001", "iter_0000002"]
    for ckpt in saved:
        assert _tree(ckpt / HF_ASSETS_DIR) == expected
        with CheckpointReader(ckpt) as reader:
            assert reader.has_optimizer_state  # a full training checkpoint, not a copy of the source

    # The source disappears; the resumed run takes hf/ from its own latest checkpoint.
    shutil.rmtree(source)
    result, out = train(run, "train.steps=3", f"checkpoint.load={source}")
    assert result.status == "finished" and "resuming from" in out and result.iteration == 3
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "iter_0000003"
    assert _tree(result.last_checkpoint / HF_ASSETS_DIR) == expected


def test_no_hf_assets_without_a_source_that_has_them(tmp_path):
    result, _ = train(tmp_path / "run", "train.steps=2")
    assert result.last_checkpoint is not None and (result.last_checkpoint / "metadata.json").is_file()
    assert not (result.last_checkpoint / HF_ASSETS_DIR).exists()
    assert read_hf_assets(result.last_checkpoint) is None


@pytest.mark.parametrize("name", ["../escape.json", "/abs/config.json", "sub/../../x"])
def test_write_hf_assets_refuses_names_outside_hf(tmp_path, name):
    with pytest.raises(CheckpointError, match="not a relative path inside hf/"):
        write_hf_assets({name: b"{}"}, tmp_path)
    assert not list(tmp_path.parent.glob("escape.json"))


def test_hf_assets_round_trip_nested_files(tmp_path):
    files = {"config.json": os.urandom(64), "nested/dir/tokenizer.json": os.urandom(128)}
    write_hf_assets(files, tmp_path / "ckpt")
    assert read_hf_assets(tmp_path / "ckpt") == files
