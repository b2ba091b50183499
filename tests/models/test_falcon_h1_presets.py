"""Falcon-H1's released sizes: the presets' config.json (rendered by the bridge) against values published by a
second source beside Megatron-Bridge's providers, which the presets were written from; parameter counts against
HF on the meta device are in test_accounting (every preset)."""

import json

import pytest

from mcore.bridge.config_translation import mcore_to_hf
from mcore.bridge.mappings import FAMILIES
from mcore.models.accounting import parameter_counts
from mcore.models.families import get_config

# Falcon-H1-7B-Instruct's config.json as a GPTQ export repeats it (its text minus the quantization and context
# keys the export rewrote): a second source for every size, flag and multiplier of the 7B.
SEVEN_B = {
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "vocab_size": 130049,
    "num_hidden_layers": 44,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_d_conv": 4,
    "mamba_n_heads": 24,
    "mamba_d_state": 256,
    "mamba_chunk_size": 256,
    "mamba_n_groups": 1,
    "mamba_d_head": 128,
    "mamba_d_ssm": 3072,
    "mamba_norm_before_gate": False,
    "mamba_rms_norm": True,
    "mamba_proj_bias": False,
    "mamba_conv_bias": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e11,
    "attention_bias": False,
    "mlp_bias": False,
    "projectors_bias": False,
    "tie_word_embeddings": False,
    "embedding_multiplier": 5.656854249492381,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.10416666666666667,
    "key_multiplier": 0.030690398488999456,
    "ssm_in_multiplier": 0.4166666666666667,
    "ssm_out_multiplier": 0.11785113019775793,
    "lm_head_multiplier": 0.013020833333333334,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.1767766952966369, 0.5, 0.3535533905932738],
    "mlp_multipliers": [0.2946278254943948, 0.032552083333333336],
}

# tiny-random/falcon-h1's config.json (HF hub): a 2-layer random model that keeps the 34B's multipliers, groups,
# context and norm flags (its widths are shrunk, so only these keys are compared).
THIRTY_FOUR_B = {
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.0375,
    "embedding_multiplier": 5.656854249492381,
    "key_multiplier": 0.011048543456039804,
    "lm_head_multiplier": 0.0078125,
    "mlp_multipliers": [0.1767766952966369, 0.011160714285714284],
    "ssm_in_multiplier": 0.25,
    "mamba_n_groups": 2,
    "mamba_chunk_size": 128,
    "mamba_norm_before_gate": False,
    "mamba_rms_norm": True,
    "max_position_embeddings": 262144,
    "rope_theta": 1e11,
}

# The transformers FalconH1 documentation's size table: depth, width, attention heads, KV heads, Mamba heads,
# attention / Mamba head dims, state size.
DOC_TABLE = {
    "falcon-h1-0.5b": (36, 1024, 8, 2, 24, 64, 64, 128),
    "falcon-h1-1.5b-deep": (66, 1280, 6, 2, 24, 128, 64, 256),
    "falcon-h1-7b": (44, 3072, 12, 2, 24, 128, 128, 256),
    "falcon-h1-34b": (72, 5120, 20, 4, 32, 128, 128, 256),
}


def _rendered(name: str) -> dict:
    """The config.json as written to disk and read back (tuples become lists)."""
    return json.loads(json.dumps(mcore_to_hf(get_config(name), FAMILIES["falcon_h1"])))


@pytest.mark.parametrize(("name", "published"), [("falcon-h1-7b", SEVEN_B), ("falcon-h1-34b", THIRTY_FOUR_B)])
def test_config_json_has_the_published_values(name, published):
    rendered = _rendered(name)
    differing = {k: (rendered.get(k), v) for k, v in published.items() if rendered.get(k) != v}
    assert not differing, differing


@pytest.mark.parametrize("name", sorted(DOC_TABLE))
def test_sizes_match_the_transformers_doc_table(name):
    c = get_config(name)
    got = (
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.mamba_num_heads,
        c.head_dim,
        c.mamba_head_dim,
        c.ssm_state_size,
    )
    assert got == DOC_TABLE[name]


def test_totals():
    # Pinned (each equals HF's count on the meta device, test_accounting); 1.55B is the size quoted for the Deep.
    totals = {
        "falcon-h1-1.5b-deep": 1_554_874_768,
        "falcon-h1-7b": 7_585_654_880,
        "falcon-h1-34b": 33_642_516_224,
    }
    assert {name: parameter_counts(get_config(name)).total for name in totals} == totals
