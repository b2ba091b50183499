"""DeepSeek's block-wise FP8 checkpoints: dequantization against a float64 reference (edge blocks included), the
quantizer's amax rule, an FP8 source converted to mcore (bf16) and back to FP8 byte for byte, a bf16 export without
quantization_config, and malformed sources (missing scale, wrong block size) refused with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from mcore.bridge.fp8_blocks import BlockFormat, dequantize, is_projection
from mcore.bridge.fp8_blocks import quantize_blocks as quantize
from mcore.train.checkpoint import CheckpointReader
from tests.bridge.factory import save_tiny_hf

BLOCK = [16, 32]  # small blocks, so that the tiny model's weights span several, with partial edge blocks


def _random_fp8(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_dequantize_equals_a_float64_reference_with_edge_blocks():
    fmt = BlockFormat(128, 128)
    q = _random_fp8((300, 200))  # 3 x 2 blocks: the last row block has 44 rows, the last column block 72 columns
    scale = torch.rand(3, 2, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1e-5
    ref = torch.empty(300, 200, dtype=torch.float64)
    for i in range(300):
        for j in range(0, 200, 8):
            ref[i, j : j + 8] = q[i, j : j + 8].double() * scale[i // 128, j // 128].double()
    got = dequantize(q, scale, fmt)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=2**-23, atol=0)
    with pytest.raises(BridgeError, match=r"weight_scale_inv has shape \[3, 3\].*needs \[3, 2\]"):
        dequantize(q, torch.ones(3, 3), fmt)


def test_quantize_scales_each_block_by_its_amax():
    fmt = BlockFormat(16, 32)
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 70)  # very different column scales, partial edge blocks
    w[:16, :32] = 0.0  # an all-zero block
    q, scale = quantize(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3) and scale.dtype == torch.float32
    assert scale[0, 0] == 1.0 and (q[:16, :32].float() == 0).all()
    for bi in range(3):
        for bj in range(3):
            block = w[bi * 16 : (bi + 1) * 16, bj * 32 : (bj + 1) * 32]
            if block.abs().max() > 0:
                torch.testing.assert_close(scale[bi, bj], block.abs().max() / 448.0)
                assert q[bi * 16 : (bi + 1) * 16, bj * 32 : (bj + 1) * 32].float().abs().max() == 448.0
    back = dequantize(q, scale, fmt)
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()  # e4m3: 3 mantissa bits


def _fp8_source(path: Path) -> Path:
    """A tiny DeepSeek-V3 checkpoint in bf16 with every linear projection block-quantized, as DeepSeek ships it."""
    save_tiny_hf(path, "deepseek_v3", dtype=torch.bfloat16)
    state = load_file(str(path / "model.safetensors"))
    out = {}
    g = torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if is_projection(name, tuple(tensor.shape)):
            # scales up to 1.5x the amax rule's (other quantizers leave headroom): the export must reuse them
            _, amax_scale = quantize(tensor, BlockFormat(*BLOCK))
            roomy = amax_scale * (1 + 0.5 * torch.rand(amax_scale.shape, generator=g))
            out[name], out[name + "_scale_inv"] = quantize(tensor, BlockFormat(*BLOCK), roomy)
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": BLOCK,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_fp8_source_imports_dequantized_and_exports_back_byte_for_byte(tmp_path):
    src = _fp8_source(tmp_path / "fp8")
    source = load_file(str(src / "model.safetensors"))
    assert sum(t.dtype == torch.float8_e4m3fn for t in source.values()) > 10
    convert(src, tmp_path / "mcore", progress=False)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    with CheckpointReader(tmp_path / "mcore") as reader:
        kv_up = reader.read_full("layers.1.attention.kv_up.weight")
    assert kv_up.dtype == torch.bfloat16
    expected = dequantize(source[name], source[name + "_scale_inv"], BlockFormat(*BLOCK)).to(torch.bfloat16)
    assert torch.equal(kv_up, expected)

    convert(tmp_path / "mcore", tmp_path / "back", fp8_blocks=True, progress=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(source)
    for key, tensor in source.items():
        assert back[key].dtype == tensor.dtype, key
        assert torch.equal(back[key].view(torch.uint8), tensor.view(torch.uint8)), key  # every byte
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == BLOCK

    convert(tmp_path / "mcore", tmp_path / "bf16", progress=False)
    plain = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert not any(k.endswith("_scale_inv") for k in plain) and plain[name].dtype == torch.bfloat16
    assert torch.equal(plain[name], expected)
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


def test_fp8_export_of_a_bf16_model_uses_128_blocks(tmp_path):
    save_tiny_hf(tmp_path / "hf", "deepseek_v3", dtype=torch.bfloat16)
    convert(tmp_path / "hf", tmp_path / "mcore", progress=False)
    convert(tmp_path / "mcore", tmp_path / "fp8", fp8_blocks=True, progress=False)
    out = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    q, scale = (
        out["model.layers.0.self_attn.q_b_proj.weight"],
        out["model.layers.0.self_attn.q_b_proj.weight_scale_inv"],
    )
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1, 1)  # [4 x 32, 48] in one 128 x 128 block
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16  # embedding, norms and router stay bf16
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("damage", ["missing_scale", "wrong_block_size"])
def test_malformed_fp8_checkpoint_is_one_error_and_nothing_is_written(tmp_path, damage):
    src = _fp8_source(tmp_path / "fp8")
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    if damage == "missing_scale":
        state = load_file(str(src / "model.safetensors"))
        del state[name + "_scale_inv"]
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
        match = rf"float8 weights without a _scale_inv: \['{name}'\]"
    else:
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = [32, 32]
        (src / "config.json").write_text(json.dumps(config))
        match = r"_scale_inv has shape \[\d+, \d+\], but .* in blocks of 32x32 .*needs"
    with pytest.raises(BridgeError, match=match):
        convert(src, tmp_path / "mcore", progress=False)
    assert not (tmp_path / "mcore").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["fp8"]


def _with_mtp(path: Path, depth: int = 1) -> Path:
    """A tiny DeepSeek-V3 checkpoint laid out as DeepSeek ships MTP: depth k's decoder layer and its own tensors at
    model.layers.{num_hidden_layers + k}, with copies of the embedding and the output head."""
    save_tiny_hf(path, "deepseek_v3", num_hidden_layers=3 + depth)  # layers 3.. are the MTP depths' layers
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    h = state["model.embed_tokens.weight"].shape[1]
    for k in range(depth):
        at = f"model.layers.{3 + k}."
        for name in ("enorm", "hnorm", "shared_head.norm"):
            state[at + name + ".weight"] = torch.rand(h, generator=g) + 0.5
        state[at + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.05
        state[at + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[at + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=3, num_nextn_predict_layers=depth)
    config.pop("num_mtp_layers", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_mtp_tensors_at_the_layers_after_the_last_round_trip(tmp_path):
    src = _with_mtp(tmp_path / "hf")
    source = load_file(str(src / "model.safetensors"))
    convert(src, tmp_path / "mcore", progress=False)
    with CheckpointReader(tmp_path / "mcore") as reader:
        assert reader.model_config.num_nextn_predict_layers == 1
        names = set(reader.tensor_names())
        assert torch.equal(reader.read_full("mtp.layers.0.eh_proj.weight"), source["model.layers.3.eh_proj.weight"])
        kv_up = reader.read_full("mtp.layers.0.layer.attention.kv_up.weight")
        assert torch.equal(kv_up, source["model.layers.3.self_attn.kv_b_proj.weight"])
        bias = reader.read_full("mtp.layers.0.layer.mlp.expert_bias")
        assert torch.equal(bias, source["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in names)  # the copies are not stored
    convert(tmp_path / "mcore", tmp_path / "back", progress=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(source)
    for key, tensor in source.items():
        assert torch.equal(back[key], tensor), key


def test_a_config_announcing_mtp_without_its_tensors_imports_without_mtp(tmp_path):
    save_tiny_hf(tmp_path / "hf", "deepseek_v3")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    result = convert(tmp_path / "hf", tmp_path / "mcore", progress=False)
    assert any("imported without MTP modules" in note for note in result.notes)
    with CheckpointReader(tmp_path / "mcore") as reader:
        assert reader.model_config.num_nextn_predict_layers == 0
