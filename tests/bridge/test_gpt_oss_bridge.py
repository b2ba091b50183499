"""GPT-OSS through the bridge: HF's stacked-expert layout both ways bit-exact, MXFP4 files dequantized on import
(against a dequantizer written here from the OCP MX definition), exported as bf16 or, on request, as MXFP4 with a
bit-exact round trip from an MXFP4 source, and an unknown quantization config refused before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mcore.bridge import mxfp4
from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from mcore.train.checkpoint import CheckpointReader
from tests.bridge.factory import read_state, save_tiny_hf

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _e2m1(code: int) -> float:
    """OCP MX v1.0 FP4 E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)
    return sign * magnitude


def _reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp64 [..., G * 32] from uint8 blocks [..., G, 16] (element 2i in the low nibble of byte i) and E8M0 scales
    [..., G] (2^(s - 127), 255 = NaN), element by element."""
    flat_b, flat_s = blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()
    out = []
    for row, s in zip(flat_b, flat_s):
        scale = math.nan if s == 255 else 2.0 ** (s - 127)
        for byte in row:
            out += [_e2m1(byte & 0xF) * scale, _e2m1(byte >> 4) * scale]
    return torch.tensor(out, dtype=torch.float64).reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def test_dequantize_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 2), dtype=torch.uint8, generator=g)
    scales[0, 0, 0], scales[1, 2, 1], scales[2, 4, 0] = 255, 0, 254 - 127  # NaN, the smallest scale, 2^0
    want = _reference_dequantize(blocks, scales)
    got = mxfp4.dequantize(blocks, scales, torch.float32).double()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    bf16 = mxfp4.dequantize(blocks, scales, torch.bfloat16)  # exact in bf16 too
    assert torch.equal(bf16.double().nan_to_num(), want.nan_to_num())


def _hf_dir(tmp_path: Path, name: str = "hf") -> Path:
    return save_tiny_hf(tmp_path / name, "gpt_oss", seed=5, dtype=torch.bfloat16)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """An independent spelling of HF's even (gate) / odd (up) columns as [gate; up]."""
    half = t.shape[-1] // 2
    return torch.stack([t[..., 2 * j] for j in range(half)] + [t[..., 2 * j + 1] for j in range(half)], dim=-1)


def _check_experts(reader: CheckpointReader, source: dict[str, torch.Tensor], layers: int) -> None:
    for i in range(layers):
        hf, ours = f"model.layers.{i}.mlp.experts.", f"layers.{i}.mlp.experts."
        assert torch.equal(reader.read_full(ours + "gate_up"), _deinterleave(source[hf + "gate_up_proj"]).mT)
        assert torch.equal(reader.read_full(ours + "gate_up_bias"), _deinterleave(source[hf + "gate_up_proj_bias"]))
        assert torch.equal(reader.read_full(ours + "down"), source[hf + "down_proj"].mT)
        assert torch.equal(reader.read_full(ours + "down_bias"), source[hf + "down_proj_bias"])
        a = f"model.layers.{i}.self_attn."
        assert torch.equal(reader.read_full(f"layers.{i}.attention.sinks.weight"), source[a + "sinks"])
        assert torch.equal(reader.read_full(f"layers.{i}.mlp.router.bias"), source[f"model.layers.{i}.mlp.router.bias"])


def test_bf16_round_trip_is_bit_exact(tmp_path):
    hf = _hf_dir(tmp_path)
    source = read_state(hf)
    assert source["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # [E, H, 2I]
    convert(hf, tmp_path / "mcore", progress=False)
    with CheckpointReader(tmp_path / "mcore") as reader:
        _check_experts(reader, source, reader.model_config.num_hidden_layers)
    convert(tmp_path / "mcore", tmp_path / "back", progress=False)
    back = read_state(tmp_path / "back")
    assert sorted(back) == sorted(source)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in source.items())
    assert (tmp_path / "back" / "config.json").read_bytes() == (hf / "config.json").read_bytes()


def _mxfp4_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny model with its expert weights replaced by random MXFP4 pairs (random codes, scales near 2^0; half the
    32-blocks have no code above 1.5, so their scale is not the one OCP's rule would pick)."""
    hf = _hf_dir(tmp_path, "hf_mxfp4")
    state = read_state(hf)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in state if n.endswith(tuple(f"experts.{w}" for w in EXPERT_WEIGHTS))]:
        e, n_in, n_out = state.pop(name).shape
        blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        blocks[:, ::2] &= 0xBB  # codes of magnitude <= 1.5 (signs kept) in every other row of blocks
        state[name + "_blocks"] = blocks
        state[name + "_scales"] = torch.randint(120, 131, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
    for f in hf.glob("*.safetensors"):
        f.unlink()
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"}
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return hf, state


def _dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's bf16 layout of an MXFP4 state, through the reference dequantizer."""
    out = {n: t for n, t in state.items() if not n.endswith(("_blocks", "_scales"))}
    for name in [n[: -len("_blocks")] for n in state if n.endswith("_blocks")]:
        values = _reference_dequantize(state[name + "_blocks"], state[name + "_scales"])
        out[name] = values.transpose(1, 2).to(torch.bfloat16)
    return out


def test_mxfp4_import_then_bf16_and_mxfp4_exports(tmp_path):
    hf, state = _mxfp4_dir(tmp_path)
    result = convert(hf, tmp_path / "mcore", progress=False)
    assert any("MXFP4" in note for note in result.notes)
    with CheckpointReader(tmp_path / "mcore") as reader:
        _check_experts(reader, _dequantized(state), reader.model_config.num_hidden_layers)
    assert (tmp_path / "mcore" / "hf" / mxfp4.SCALES_FILE).is_file()

    convert(tmp_path / "mcore", tmp_path / "bf16", progress=False)
    bf16 = read_state(tmp_path / "bf16")
    want = _dequantized(state)
    assert sorted(bf16) == sorted(want) and all(torch.equal(bf16[n], t) for n, t in want.items())
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())

    convert(tmp_path / "mcore", tmp_path / "mxfp4", quantize="mxfp4", progress=False)
    back = read_state(tmp_path / "mxfp4")
    assert sorted(back) == sorted(state)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in state.items())
    assert json.loads((tmp_path / "mxfp4" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


def test_mxfp4_export_without_kept_scales_keeps_every_value(tmp_path):
    # A checkpoint without the source's scales (e.g. saved by training) is encoded with OCP's scales: other bytes
    # for blocks whose largest code is below 4, the same values everywhere.
    hf, state = _mxfp4_dir(tmp_path)
    convert(hf, tmp_path / "mcore", progress=False)
    (tmp_path / "mcore" / "hf" / mxfp4.SCALES_FILE).unlink()
    convert(tmp_path / "mcore", tmp_path / "ocp", quantize="mxfp4", progress=False)
    back = read_state(tmp_path / "ocp")
    blocks = [n for n in state if n.endswith("_blocks")]
    assert any(not torch.equal(back[n], state[n]) for n in blocks)
    for name in blocks:
        scales = name[: -len("_blocks")] + "_scales"
        want = _reference_dequantize(state[name], state[scales])
        assert torch.equal(_reference_dequantize(back[name], back[scales]), want), name


@pytest.mark.parametrize("quant", [{"quant_method": "gptq", "bits": 4}, "mxfp4", {"bits": 4}])
def test_unknown_quantization_config_is_one_error_and_nothing_is_written(tmp_path, quant):
    hf = _hf_dir(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(BridgeError, match="quantization_config .* is not supported; the bridge reads plain weights"):
        convert(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_mxfp4_pairs_must_be_complete(tmp_path):
    hf, state = _mxfp4_dir(tmp_path)
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    (hf / "model.safetensors").unlink()
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BridgeError, match=r"MXFP4 blocks model.layers.1.mlp.experts.down_proj_blocks have no"):
        convert(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_quantize_is_refused_where_it_does_not_apply(tmp_path):
    llama = save_tiny_hf(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    with pytest.raises(BridgeError, match="--quantize applies to mcore -> hf"):
        convert(llama, tmp_path / "x", quantize="mxfp4", progress=False)
    convert(llama, tmp_path / "llama_mcore", progress=False)
    with pytest.raises(BridgeError, match="applies to GPT-OSS experts"):
        convert(tmp_path / "llama_mcore", tmp_path / "y", quantize="mxfp4", progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_import_layout_equals_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (2, 6, 3), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # HF's [E, in, out] parameter
    ours = torch.stack([mxfp4.dequantize(blocks[e], scales[e]) for e in range(2)]).transpose(1, 2)
    assert want.shape == ours.shape == (2, 96, 6) and torch.equal(ours, want)


def test_cli_quantize_and_load_hf_into_read_mxfp4(tmp_path):
    from mcore.bridge import load_hf_into
    from mcore.bridge.cli import main
    from mcore.models.families import get_config
    from mcore.models.gpt import GPTModel

    hf, state = _mxfp4_dir(tmp_path)
    assert main(["convert", str(hf), str(tmp_path / "mcore"), "--no-progress"]) == 0
    argv = ["convert", str(tmp_path / "mcore"), str(tmp_path / "back"), "--quantize", "mxfp4", "--no-progress"]
    assert main(argv) == 0
    back = read_state(tmp_path / "back")
    assert all(torch.equal(back[n], t) for n, t in state.items())
    config = json.loads((hf / "config.json").read_text())
    model = GPTModel(get_config("gpt_oss-tiny", vocab_size=config["vocab_size"]))
    load_hf_into(model, hf)
    want = _dequantized(state)["model.layers.1.mlp.experts.down_proj"].mT.float()
    assert torch.equal(model.layers["1"].mlp.experts.down.detach(), want)


def test_inspect_describes_an_mxfp4_directory_as_its_bf16_weights(tmp_path):
    from mcore.bridge.describe import describe

    hf, _ = _mxfp4_dir(tmp_path)
    d = describe(hf)
    shapes = {t.name: (t.dtype, t.shape) for t in d.tensors}
    assert d.family == "gpt_oss" and "model.layers.0.mlp.experts.gate_up_proj_blocks" not in shapes
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == ("bfloat16", [4, 64, 64])
