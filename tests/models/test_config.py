"""TransformerConfig validation and the family presets, checked against Hugging Face configs."""

import dataclasses

import pytest

from mcore.models.config import TransformerConfig
from mcore.models.families import FAMILIES, PRESETS, family_config, family_of, get_config, preset_names
from tests.helpers.families import hf_classes, hf_config_kwargs
from tests.helpers.hf_adapters import adapter

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)


def test_defaults_resolve_kv_heads_and_head_dim():
    c = TransformerConfig(**TINY)
    assert c.num_key_value_heads == 4
    assert c.head_dim == 16
    assert c.query_heads_per_kv_head == 1
    assert (c.q_size, c.kv_size) == (64, 64)


def test_heads_not_divisible_by_kv_heads_names_the_fix():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"):
        TransformerConfig(**{**TINY, "num_key_value_heads": 3})


def test_hidden_not_divisible_by_heads_asks_for_head_dim():
    with pytest.raises(ValueError, match="set head_dim explicitly"):
        TransformerConfig(**{**TINY, "num_attention_heads": 6})
    c = TransformerConfig(**{**TINY, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12})
    assert (c.q_size, c.kv_size) == (72, 24)


@pytest.mark.parametrize(
    ("field", "value", "exc", "match"),
    [
        ("hidden_size", 0, ValueError, "hidden_size must be >= 1, got 0"),
        ("vocab_size", 3.5, TypeError, "vocab_size must be an int"),
        ("num_hidden_layers", True, TypeError, "num_hidden_layers must be an int"),
        ("rms_norm_eps", 0.0, ValueError, "rms_norm_eps must be a finite number > 0"),
        ("rope_theta", float("nan"), ValueError, "rope_theta must be a finite number > 0"),
        ("head_dim", 15, ValueError, "head_dim must be even"),
        ("sliding_window", 0, ValueError, "sliding_window must be >= 1"),
        ("hidden_act", "relu", ValueError, "hidden_act must be one of"),
        ("normalization", "batchnorm", ValueError, "normalization must be one of"),
        ("qk_norm", 1, TypeError, "qk_norm must be a bool"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, ValueError, "needs the keys"),
        ("rope_scaling", {"rope_type": "ntk"}, ValueError, "rope_type'\\] must be one of"),
        ("layer_types", ["full_attention"], ValueError, "layer_types has 1 entries but num_hidden_layers is 2"),
        ("layer_types", ["full_attention", "sliding_attention"], ValueError, "sliding_window is None"),
    ],
)
def test_invalid_fields_raise_naming_field_and_value(field, value, exc, match):
    with pytest.raises(exc, match=match):
        TransformerConfig(**{**TINY, field: value})


def test_tensor_parallel_must_divide_kv_heads():
    c = TransformerConfig(**{**TINY, "num_key_value_heads": 2})
    c.check_tensor_parallel(2)
    with pytest.raises(ValueError, match=r"tensor parallel size 4 must divide num_key_value_heads \(2\).*\[1, 2\]"):
        c.check_tensor_parallel(4)


def test_padded_vocab_is_a_multiple_of_128_times_tp():
    c = TransformerConfig(**TINY)
    assert c.padded_vocab_size(1) == 384
    assert c.padded_vocab_size(2) == 512
    assert c.padded_vocab_size(3) == 384
    assert TransformerConfig(**{**TINY, "vocab_size": 256}).padded_vocab_size(2) == 256


def test_window_per_layer():
    c = TransformerConfig(**{**TINY, "sliding_window": 8})
    assert [c.window_for_layer(i) for i in range(2)] == [8, 8]
    c = TransformerConfig(**{**TINY, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    assert [c.window_for_layer(i) for i in range(2)] == [8, None]
    with pytest.raises(ValueError, match=r"layer_index must be in \[0, 2\)"):
        c.window_for_layer(2)


def test_legacy_rope_scaling_type_key_is_normalised():
    c = TransformerConfig(**{**TINY, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_dict_round_trip_and_unknown_keys():
    c = get_config("llama3.1-8b")
    assert TransformerConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"unknown fields \['hidden_sise'\]"):
        TransformerConfig.from_dict({**TINY, "hidden_sise": 3})


def test_config_is_frozen_and_replace_revalidates():
    c = TransformerConfig(**TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 128
    with pytest.raises(ValueError, match="num_key_value_heads"):
        dataclasses.replace(c, num_key_value_heads=3)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'llama9-1t'.*llama3-8b"):
        get_config("llama9-1t")
    with pytest.raises(ValueError, match="unknown family"):
        family_config("gpt5", **TINY)


def test_overrides_and_family_behaviour_is_data():
    assert get_config("qwen2.5-7b").attention_bias
    assert not get_config("qwen2.5-7b").attention_out_bias
    assert get_config("qwen3-8b").qk_norm and get_config("qwen3-8b").head_dim == 128
    assert get_config("mistral-7b").sliding_window == 4096
    assert get_config("llama3.1-8b").rope_scaling["rope_type"] == "llama3"
    assert get_config("llama3.2-1b").tie_word_embeddings
    assert get_config("llama-tiny", num_hidden_layers=4).num_hidden_layers == 4
    assert family_config("qwen3", **TINY).qk_norm
    for name in ("llama3-8b", "llama3-70b", "qwen3-8b", "qwen2.5-7b", "mistral-7b", "llama2-7b"):
        assert name in preset_names()
    moe = {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe"}
    deepseek = {"deepseek_v3", "deepseek_v2"}
    ssm = {"mamba2", "nemotron_h", "falcon_h1"}
    assert set(FAMILIES) == {"llama", "qwen2", "qwen3", "mistral", *moe, *ssm, "bitnet", *deepseek, "gpt_oss"}


def test_presets_cannot_be_mutated_through_a_config():
    c = get_config("llama3.1-8b")
    c.rope_scaling["factor"] = 1.0
    assert get_config("llama3.1-8b").rope_scaling["factor"] == 8.0
    with pytest.raises(TypeError):
        PRESETS["llama3-8b"][1]["hidden_size"] = 1


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_a_valid_hf_config_with_the_same_fields(name):
    """Each preset builds the matching HF config class; the shared fields read back identical."""
    c = get_config(name)
    config_cls, _ = hf_classes(family_of(name))
    hf = config_cls(**hf_config_kwargs(c))
    assert hf.model_type == c.model_type
    special = adapter(c.model_type)
    assert getattr(hf, "hidden_act" if special is None else special.hf_hidden_act_key) == c.hidden_act
    assert hf.head_dim == getattr(c, "head_dim" if special is None else special.head_dim_field)
    c.check_tensor_parallel(1)
