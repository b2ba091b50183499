"""Streaming: converting a synthetic ~1 GB Llama-shaped checkpoint (10 layers, hidden 2048, bf16) stays within
2x the largest output tensor plus a fixed overhead, in both directions, measured as the peak RSS of a fresh
conversion process above its RSS after imports. A converter that held the model would need ~1 GB more."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB, LAYERS = 2048, 5632, 16, 4, 16000, 10
HEAD_DIM = HIDDEN // HEADS
FIXED_OVERHEAD = 64 * 2**20  # allocator slack, file headers, metadata; independent of the model size


def _layer_tensors(i: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = {
        "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    return {
        f"model.layers.{i}.{k}": torch.randn(s, generator=generator, dtype=torch.bfloat16) for k, s in shapes.items()
    }


def _write_synthetic_hf(path: Path) -> int:
    """One shard per layer (and per vocabulary tensor), so that the generator never holds the model either."""
    path.mkdir()
    generator = torch.Generator().manual_seed(0)
    shards = [{"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.bfloat16)}]
    weight_map, total = {}, 0
    for i in range(LAYERS + 2):
        if i == LAYERS:
            tensors = {"model.norm.weight": torch.rand(HIDDEN, generator=generator).to(torch.bfloat16)}
            tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.bfloat16)
        elif i == LAYERS + 1:
            tensors = shards.pop()
        else:
            tensors = _layer_tensors(i, generator)
        name = f"model-{i + 1:05d}-of-{LAYERS + 2:05d}.safetensors"
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map |= {k: name for k in tensors}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
    }
    (path / "config.json").write_text(json.dumps(config))
    return total


def _probe(src: Path, dst: Path) -> dict:
    probe = Path(__file__).with_name("_memory_probe.py")
    done = subprocess.run(
        [sys.executable, str(probe), str(src), str(dst)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp("memory")
    return root, _write_synthetic_hf(root / "hf")


def test_both_directions_stream_within_twice_the_largest_tensor(synthetic):
    root, total = synthetic
    assert total > 900 * 2**20
    largest = VOCAB * HIDDEN * 2  # the (already 128-aligned) embedding; gate_up is 2 * 5632 * 2048 * 2 bytes
    assert largest >= 2 * INTERMEDIATE * HIDDEN * 2
    bound = 2 * largest + FIXED_OVERHEAD

    to_mcore = _probe(root / "hf", root / "mcore")
    used = to_mcore["peak"] - to_mcore["baseline"]
    assert used < bound, f"hf -> mcore used {used / 2**20:.0f} MiB above baseline, bound {bound / 2**20:.0f} MiB"

    to_hf = _probe(root / "mcore", root / "back")
    used = to_hf["peak"] - to_hf["baseline"]
    assert used < bound, f"mcore -> hf used {used / 2**20:.0f} MiB above baseline, bound {bound / 2**20:.0f} MiB"
    assert sorted(p.name for p in (root / "back").iterdir()) == ["config.json", "model.safetensors"]
