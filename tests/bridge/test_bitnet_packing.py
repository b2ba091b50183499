"""HF's packed BitNet checkpoints (2-bit ternary weights, 4 per uint8, plus weight_scale): the codec against
transformers' own pack/unpack, conversion both ways (packed -> mcore -> packed keeps every packed bit), and the
imported model under ``quant: bitnet`` computing what transformers' ``BitLinear`` computes from the packed files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore.bridge.api import load_hf_into
from mcore.bridge.bitnet_packing import (
    dequantize_weight,
    pack_ternary,
    quantize_weight,
    unpack_ternary,
)
from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from mcore.kernels.bitnet import ternary_weight
from mcore.kernels.low_precision_linear import Recipe
from mcore.models.gpt import GPTModel
from mcore.parallel.low_precision import enable_low_precision
from tests.bridge.factory import read_state, save_tiny_hf

hf_bitnet = pytest.importorskip("transformers.integrations.bitnet")


@pytest.fixture
def no_compile():
    # transformers' unpack is torch.compile'd. Not monkeypatch: pytest >= 9.2 undoes a patched config entry with
    # delattr, which hides it from torch for the rest of the session (every later torch.compile then fails).
    with torch._dynamo.config.patch(disable=True):
        yield


def _ternary(rows, cols, seed=0):
    return torch.randint(-1, 2, (rows, cols), generator=torch.Generator().manual_seed(seed)).to(torch.int8)


def test_pack_and_unpack_agree_with_transformers(no_compile):
    t = _ternary(96, 40)
    ours = pack_ternary(t)
    theirs = hf_bitnet.pack_weights(t.clone().float())
    assert ours.dtype == torch.uint8 and ours.shape == (24, 40) and torch.equal(ours, theirs)
    torch.testing.assert_close(hf_bitnet.unpack_weights(ours, torch.float32), t.float(), rtol=0, atol=0)
    assert torch.equal(unpack_ternary(theirs), t)
    with pytest.raises(BridgeError, match="divisible by 4"):
        pack_ternary(_ternary(6, 4))
    with pytest.raises(BridgeError, match="code 3"):
        unpack_ternary(torch.full((1, 2), 255, dtype=torch.uint8))


def test_the_imported_latent_weight_quantizes_back_to_the_packed_one():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=gen) * 0.03
    packed, scale = quantize_weight(w)
    torch.testing.assert_close(unpack_ternary(packed).float() / scale, ternary_weight(w), rtol=0, atol=0)
    latent = dequantize_weight(packed, scale, torch.float32)
    again = ternary_weight(latent)  # the online quantizer, as training and the model use it
    torch.testing.assert_close(again, unpack_ternary(packed).float() / scale, rtol=1e-6, atol=0)
    packed2, scale2 = quantize_weight(latent)
    assert torch.equal(packed2, packed)
    torch.testing.assert_close(scale2, scale, rtol=1e-6, atol=0)


def _packed_hf_dir(path: Path) -> Path:
    """A tiny bitnet HF directory rewritten as an offline packed checkpoint (every *_proj weight packed)."""
    save_tiny_hf(path, "bitnet")
    state = {}
    for file in path.glob("*.safetensors"):
        for name, tensor in load_file(file).items():
            if name.endswith("_proj.weight"):
                state[name], state[name + "_scale"] = quantize_weight(tensor)
            else:
                state[name] = tensor
        file.unlink()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="bitnet", linear_class="bitlinear", quantization_mode="offline")
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_packed_to_mcore_to_packed_keeps_every_packed_bit(tmp_path):
    packed = _packed_hf_dir(tmp_path / "hf")
    convert(packed, tmp_path / "mcore", to="mcore", progress=False)
    convert(tmp_path / "mcore", tmp_path / "back", to="hf", progress=False)
    before, after = read_state(packed), read_state(tmp_path / "back")
    assert set(before) == set(after)
    for name, tensor in before.items():
        if name.endswith("_scale"):
            torch.testing.assert_close(after[name], tensor, rtol=1e-6, atol=0, msg=name)
        else:
            assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitnet"


def _config_of(hf_dir: Path):
    from mcore.bridge.config_translation import hf_to_mcore
    from mcore.bridge.mappings import family_for_hf_config

    hf = json.loads((hf_dir / "config.json").read_text())
    return hf_to_mcore(hf, family_for_hf_config(hf, "config.json"), "config.json")


def test_cli_writes_a_trained_checkpoint_packed_on_request(tmp_path):
    from mcore.bridge.cli import main

    plain = save_tiny_hf(tmp_path / "plain", "bitnet")
    assert main(["convert", str(plain), str(tmp_path / "mcore"), "--no-progress"]) == 0
    args = ["convert", str(tmp_path / "mcore"), str(tmp_path / "packed"), "--no-progress", "--bitnet-packed", "yes"]
    assert main(args) == 0
    state = read_state(tmp_path / "packed")
    assert state["model.layers.1.self_attn.q_proj.weight"].dtype == torch.uint8
    assert "model.layers.1.self_attn.q_proj.weight_scale" in state
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitnet"
    with pytest.raises(BridgeError, match="--bitnet-packed applies to mcore -> hf"):
        convert(plain, tmp_path / "x", bitnet_packed=True, progress=False)


def test_plain_export_of_a_packed_import_drops_the_quantization_config(tmp_path):
    packed = _packed_hf_dir(tmp_path / "hf")
    config = _config_of(packed)
    model = GPTModel(config)
    load_hf_into(model, packed)
    from mcore.bridge.api import export_hf

    export_hf(model, tmp_path / "plain", bitnet_packed=False, hf_assets=packed)
    state = read_state(tmp_path / "plain")
    assert all(t.dtype == torch.float32 for t in state.values()) and not any(n.endswith("_scale") for n in state)
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    export_hf(model, tmp_path / "repacked", bitnet_packed=True)
    assert torch.equal(read_state(tmp_path / "repacked")["model.layers.0.mlp.down_proj.weight"],
                       read_state(packed)["model.layers.0.mlp.down_proj.weight"])  # fmt: skip


def test_imported_model_computes_what_hf_bitlinear_computes_from_the_packed_files(tmp_path, no_compile):
    packed = _packed_hf_dir(tmp_path / "hf")
    config = _config_of(packed)
    ours = GPTModel(config)
    load_hf_into(ours, packed)
    enable_low_precision(ours, Recipe("bitnet"), keep=("output",))
    # transformers' offline BitLinear layers holding the packed tensors as stored
    from tests.bridge.factory import tiny_hf_model

    hf = tiny_hf_model("bitnet")
    state = read_state(packed)
    for name, module in list(hf.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            layer = hf_bitnet.BitLinear(module.in_features, module.out_features, bias=False, dtype=torch.float32)
            layer.weight.copy_(state[f"{name}.weight"])
            layer.weight_scale.copy_(state[f"{name}.weight_scale"])
            hf.set_submodule(name, layer)
    hf.load_state_dict({k: v for k, v in state.items() if not k.endswith("_proj.weight")}, strict=False)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)[..., : config.vocab_size]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
