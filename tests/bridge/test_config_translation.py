"""config.json <-> TransformerConfig: every field is translated or carried, round trips keep the file as it was,
changes re-render only the keys they touch, and fresh exports describe the same model to transformers."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig

from mcore.bridge.config_translation import carried_keys, hf_to_mcore, mcore_to_hf
from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings import FAMILIES, family_for_hf_config
from mcore.models.config import TransformerConfig
from tests.bridge.factory import HF_CLASSES, LLAMA31_ROPE, legacy_config, save_tiny_hf, tiny_config_kwargs

# Per-family variants that exercise a translation rule (other families: their tiny defaults).
OVERRIDES = {
    "llama": {"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {"tie_word_embeddings": True},
    "mistral": {},
}


def _hf_config(family: str, legacy: bool, tmp_path) -> dict:
    path = save_tiny_hf(tmp_path / family, family, tokenizer=False, **OVERRIDES.get(family, {}))
    if legacy:
        legacy_config(path, custom_extra={"a": [1, 2]})
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("legacy", [False, True], ids=["transformers5", "legacy"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_returns_the_original_config(tmp_path, family, legacy):
    original = _hf_config(family, legacy, tmp_path)
    mapping = family_for_hf_config(original)
    config = hf_to_mcore(original, mapping)
    back = mcore_to_hf(config, mapping, original, weights_dtype="float32")
    assert back == original and list(back) == list(original)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_transformer_config_field_is_set_by_exactly_one_rule(family):
    fields = [f for rule in FAMILIES[family].config for f in rule.mcore_fields]
    assert sorted(fields) == sorted(f.name for f in dataclasses.fields(TransformerConfig))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fresh_export_describes_the_same_model_to_transformers(tmp_path, family):
    original = _hf_config(family, False, tmp_path)
    mapping = FAMILIES[family]
    config = hf_to_mcore(original, mapping)
    fresh = mcore_to_hf(config, mapping, None, weights_dtype="bfloat16")
    assert fresh["architectures"] == list(mapping.hf_architectures[:1]) and fresh["torch_dtype"] == "bfloat16"
    assert hf_to_mcore(fresh, mapping) == config
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.json").write_text(json.dumps(fresh))
    loaded = AutoConfig.from_pretrained(tmp_path / "fresh")
    want = HF_CLASSES[family][0](**tiny_config_kwargs(family, **OVERRIDES.get(family, {})))
    for key in KEYS_TRANSFORMERS_USES:
        assert _effective(loaded, key) == _effective(want, key), key


KEYS_TRANSFORMERS_USES = (
    "hidden_size",
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "sliding_window",
    "layer_types",
    "tie_word_embeddings",
    "rms_norm_eps",
    "vocab_size",
)


def _effective(config, key: str):
    """The value transformers' modeling code uses (Qwen2 derives head_dim when the config has none)."""
    value = getattr(config, key, None)
    if key == "head_dim" and value is None:
        return config.hidden_size // config.num_attention_heads
    return value


def test_a_changed_field_rerenders_only_its_keys(tmp_path):
    original = _hf_config("llama", True, tmp_path)
    mapping = FAMILIES["llama"]
    config = dataclasses.replace(hf_to_mcore(original, mapping), rope_theta=250000.0, num_hidden_layers=4)
    back = mcore_to_hf(config, mapping, original, weights_dtype="float32")
    changed = {k for k in original if back[k] != original[k]}
    assert changed == {"rope_theta", "num_hidden_layers"}
    assert back["rope_scaling"] == original["rope_scaling"] and back["custom_extra"] == {"a": [1, 2]}


def test_carried_keys_are_those_no_rule_translates(tmp_path):
    original = _hf_config("qwen2", True, tmp_path)
    carried = carried_keys(original, FAMILIES["qwen2"])
    assert {"torch_dtype", "bos_token_id", "eos_token_id", "custom_extra", "transformers_version"} <= set(carried)
    assert not {"hidden_size", "rope_theta", "rope_scaling", "use_sliding_window"} & set(carried)


def test_config_values_mcore_cannot_run_are_refused_with_the_field(tmp_path):
    original = _hf_config("llama", False, tmp_path)
    with pytest.raises(BridgeError, match="hidden_act"):
        hf_to_mcore({**original, "hidden_act": "relu"}, FAMILIES["llama"])
    with pytest.raises(BridgeError, match="no 'hidden_size'"):
        hf_to_mcore({k: v for k, v in original.items() if k != "hidden_size"}, FAMILIES["llama"])
    qwen3 = hf_to_mcore(_hf_config("qwen3", False, tmp_path), FAMILIES["qwen3"])
    with pytest.raises(BridgeError, match="qk_norm=True"):
        mcore_to_hf(dataclasses.replace(qwen3, qk_norm=False), FAMILIES["qwen3"])


def test_llama_attention_bias_sets_both_projection_biases(tmp_path):
    original = _hf_config("llama", False, tmp_path)
    config = hf_to_mcore({**original, "attention_bias": True}, FAMILIES["llama"])
    assert config.attention_bias and config.attention_out_bias
    with pytest.raises(BridgeError, match="sets Q/K/V and output-projection biases together"):
        mcore_to_hf(dataclasses.replace(config, attention_out_bias=False), FAMILIES["llama"])
