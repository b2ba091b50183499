"""HF -> mcore -> HF: bit-exact round trips, the mcore layout against an independent per-head fusion, dtype
conversion, configs without HF files, overwrite and all-or-nothing writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import mcore.bridge.convert as convert_module
from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from mcore.train.checkpoint import CheckpointReader
from tests.bridge.factory import LLAMA31_ROPE, legacy_config, read_state, save_tiny_hf

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3.1-rope": ("llama", {"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied-sliding": (
        "qwen2",
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


def _reference_qkv(q, k, v, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The contract's layout built row block by row block: for each KV group, its query heads, then k, then v."""
    rows = []
    per_group = heads // kv_heads
    for g in range(kv_heads):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * head_dim : (h + 1) * head_dim])
        rows.append(k[g * head_dim : (g + 1) * head_dim])
        rows.append(v[g * head_dim : (g + 1) * head_dim])
    return torch.cat(rows)


def _check_mcore_layout(hf_state: dict[str, torch.Tensor], mcore_dir: Path) -> None:
    with CheckpointReader(mcore_dir) as reader:
        c = reader.model_config
        assert reader.layout.tp == 1 and reader.layout.pp == 1
        embedding = reader.read_full("embedding.weight", padded=True)
        assert embedding.shape[0] == c.padded_vocab_size(1) > c.vocab_size
        assert torch.equal(embedding[: c.vocab_size], hf_state["model.embed_tokens.weight"])
        assert not embedding[c.vocab_size :].any(), "padding rows must be zero"
        for i in range(c.num_hidden_layers):
            attn = f"model.layers.{i}.self_attn."
            for kind in ("weight", "bias") if c.attention_bias else ("weight",):
                want = _reference_qkv(
                    *(hf_state[f"{attn}{p}_proj.{kind}"] for p in "qkv"),
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    c.head_dim,
                )
                assert torch.equal(reader.read_full(f"layers.{i}.attention.qkv.{kind}"), want)
            mlp = f"model.layers.{i}.mlp."
            gate_up = torch.cat([hf_state[mlp + "gate_proj.weight"], hf_state[mlp + "up_proj.weight"]])
            assert torch.equal(reader.read_full(f"layers.{i}.mlp.gate_up.weight"), gate_up)
        if c.tie_word_embeddings:
            assert "output.weight" not in reader.tensor_names()
        else:
            assert torch.equal(reader.read_full("output.weight"), hf_state["lm_head.weight"])


def _check_index(directory: Path) -> None:
    """The index lists exactly the tensors in the shards, in the right shard, with their total size."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    found, total = {}, 0
    for shard in directory.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                found[name] = shard.name
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == found
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_exact(tmp_path, case):
    family, overrides = CASES[case]
    hf = save_tiny_hf(tmp_path / "hf", family, seed=3, dtype=torch.bfloat16, max_shard_size="60KB", **overrides)
    result = convert(hf, tmp_path / "mcore", progress=False)
    assert (result.direction, result.family) == ("hf->mcore", family)
    source = read_state(hf)
    _check_mcore_layout(source, tmp_path / "mcore")

    convert(tmp_path / "mcore", tmp_path / "back", max_shard_size="40KB", progress=False)
    back = read_state(tmp_path / "back")
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    for f in SIDE_FILES:
        assert (tmp_path / "back" / f).read_bytes() == (hf / f).read_bytes(), f
    _check_index(tmp_path / "back")


def test_legacy_llama31_config_survives_with_every_extra_key(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "llama", seed=1, rope_parameters={**LLAMA31_ROPE, "rope_theta": 500000.0})
    legacy_config(hf, my_extra={"nested": [1, 2.5, None]}, pretraining_tp=1)
    original = json.loads((hf / "config.json").read_text())
    assert original["rope_scaling"]["rope_type"] == "llama3" and original["torch_dtype"] == "float32"

    convert(hf, tmp_path / "mcore", progress=False)
    with CheckpointReader(tmp_path / "mcore") as reader:
        config = reader.model_config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA31_ROPE
    convert(tmp_path / "mcore", tmp_path / "back", progress=False)
    assert (tmp_path / "back" / "config.json").read_bytes() == (hf / "config.json").read_bytes()


def test_dtype_option_converts_floating_tensors_and_the_config_dtype(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "qwen2", seed=2)  # float32
    convert(hf, tmp_path / "mcore", dtype="bf16", progress=False)
    with CheckpointReader(tmp_path / "mcore") as reader:
        assert {reader.tensor_meta(n).dtype for n in reader.tensor_names()} == {"bfloat16"}
    convert(tmp_path / "mcore", tmp_path / "back", progress=False)
    source, back = read_state(hf), read_state(tmp_path / "back")
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor.to(torch.bfloat16)), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    convert(tmp_path / "mcore", tmp_path / "fp32", dtype="fp32", progress=False)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


@pytest.mark.parametrize("case", ["llama3.1-rope", "qwen2-tied-sliding", "qwen3", "mistral"])
def test_export_without_hf_files_generates_a_config_transformers_runs_identically(tmp_path, case):
    family, overrides = CASES[case]
    hf = save_tiny_hf(tmp_path / "hf", family, seed=4, **overrides)
    convert(hf, tmp_path / "mcore", progress=False)
    for f in (tmp_path / "mcore" / "hf").iterdir():  # as if the checkpoint came from training
        f.unlink()
    (tmp_path / "mcore" / "hf").rmdir()
    result = convert(tmp_path / "mcore", tmp_path / "back", progress=False)
    assert any("no tokenizer files" in n for n in result.notes)
    assert not (tmp_path / "back" / "tokenizer.json").exists()

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")(ids).logits
    assert torch.equal(got, want)


def test_hf_assets_supply_config_and_tokenizer_to_a_bare_checkpoint(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "llama", seed=5)
    convert(hf, tmp_path / "mcore", progress=False)
    for f in (tmp_path / "mcore" / "hf").iterdir():
        f.unlink()
    convert(tmp_path / "mcore", tmp_path / "back", hf_assets=hf, progress=False)
    for f in SIDE_FILES:
        assert (tmp_path / "back" / f).read_bytes() == (hf / f).read_bytes(), f


def test_overwrite_replaces_a_destination_only_once_complete(tmp_path, monkeypatch):
    hf = save_tiny_hf(tmp_path / "hf", "llama", seed=6)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    with pytest.raises(BridgeError, match="already exists; pass --overwrite"):
        convert(hf, dst, progress=False)

    reads = []
    real_read = convert_module.read_tensor

    def failing_read(entry):
        reads.append(entry.name)
        if len(reads) == 5:
            raise OSError("disk went away")
        return real_read(entry)

    monkeypatch.setattr(convert_module, "read_tensor", failing_read)
    with pytest.raises(OSError, match="disk went away"):
        convert(hf, dst, overwrite=True, progress=False)
    assert (dst / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "hf"], "a failed conversion left files behind"

    monkeypatch.setattr(convert_module, "read_tensor", real_read)
    convert(hf, dst, overwrite=True, progress=False)
    assert not (dst / "keep.txt").exists() and (dst / "metadata.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "hf"]


def test_direction_option_is_checked_against_the_source(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "mistral", seed=7)
    with pytest.raises(BridgeError, match="converts --to mcore, not --to hf"):
        convert(hf, tmp_path / "x", to="hf", progress=False)
    assert not (tmp_path / "x").exists()
