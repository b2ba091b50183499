"""Reading HF directories (side files, entries deliberately not carried) and writing them (shard plan, index)."""

from __future__ import annotations

import json

import torch

from mcore.bridge.hf import HFWriter, read_hf_dir, shard_plan
from mcore.bridge.safetensors_io import TensorSpec
from tests.bridge.factory import read_state, save_tiny_hf


def test_side_files_are_carried_and_foreign_entries_are_named(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "mistral", seed=1, max_shard_size="100KB")
    (hf / "original").mkdir()
    (hf / "original" / "consolidated.00.pth").write_bytes(b"x")
    (hf / "pytorch_model.bin").write_bytes(b"x")
    (hf / "consolidated.safetensors").write_bytes(b"x")
    (hf / "README.md").write_text("# tiny")
    checkpoint = read_hf_dir(hf)
    assert sorted(f.name for f in checkpoint.side_files) == [
        "README.md",
        "chat_template.jinja",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert any(s.startswith("original/") for s in checkpoint.skipped)
    assert any(s.startswith("pytorch_model.bin") for s in checkpoint.skipped)
    assert any(s.startswith("consolidated.safetensors (not referenced") for s in checkpoint.skipped)
    assert len(checkpoint.weight_files) > 1
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert list(checkpoint.tensors) == list(index["weight_map"])


def test_shard_plan_respects_the_limit_and_keeps_order():
    specs = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    shards = shard_plan(specs, 80)  # 80 bytes = 20 floats; the 30-float tensor gets a shard of its own
    assert [[s.name for s in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_writer_builds_the_index_from_what_it_wrote(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16) for i in range(5)}
    writer = HFWriter(tmp_path, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 600)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_parameters": 5 * 128, "total_size": 5 * 256}
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == files
    state = read_state(tmp_path)
    assert all(torch.equal(state[n], t) for n, t in tensors.items())
