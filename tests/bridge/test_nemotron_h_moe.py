"""The bridge on Nemotron-H with MoE layers: config.json both ways (the MoE keys become num_experts... and the
router's knobs; a model without MoE layers has no experts whatever the file's default MoE keys say), the tensor
rules of the experts, and the refusal of latent experts, and the score-correction bias buffer carried both ways."""

from __future__ import annotations

import json

import pytest
import torch

from mcore.bridge.config_translation import hf_to_mcore, mcore_to_hf
from mcore.bridge.conversion_plan import steps_for
from mcore.bridge.convert import convert
from mcore.bridge.errors import BridgeError
from mcore.bridge.mappings import FAMILIES
from mcore.models.families import get_config
from tests.models.hf_weights import hf_model

FAMILY = FAMILIES["nemotron_h"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h_moe")
    hf_model(get_config("nemotron_h-moe-tiny"), seed=0).save_pretrained(path)
    return path


def test_config_both_ways(moe_dir):
    original = json.loads((moe_dir / "config.json").read_text())
    config = hf_to_mcore(original, FAMILY)
    want = get_config("nemotron_h-moe-tiny")
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "moe_router", "layer_types", "mlp_layer_types"):  # fmt: skip
        assert getattr(config, field) == getattr(want, field), field
    assert mcore_to_hf(config, FAMILY, original) == original
    fresh = mcore_to_hf(config, FAMILY)
    assert hf_to_mcore(fresh, FAMILY) == config
    assert fresh["n_routed_experts"] == 4 and fresh["routed_scaling_factor"] == 2.5 and fresh["n_group"] == 2


def test_dense_pattern_has_no_experts_whatever_the_default_keys(moe_dir):
    original = json.loads((moe_dir / "config.json").read_text())
    dense = {**original, "layers_block_type": ["linear_attention", "mlp", "full_attention"]}
    config = hf_to_mcore(dense, FAMILY)
    assert config.num_experts is None and config.moe_router is None
    assert "n_routed_experts" not in mcore_to_hf(config, FAMILY)


def test_expert_tensor_rules():
    config = get_config("nemotron_h-moe-tiny")
    steps = {s.mcore: s for s in steps_for(FAMILY, config)}
    up = steps["layers.1.mlp.experts.up"]
    assert up.op == "experts" and up.hf == tuple(
        f"backbone.layers.1.mixer.experts.{e}.up_proj.weight" for e in range(4)
    )
    assert steps["layers.3.mlp.shared_expert.down.weight"].hf == (
        "backbone.layers.3.mixer.shared_experts.down_proj.weight",
    )
    assert steps["layers.4.mlp.up.weight"].hf == ("backbone.layers.4.mixer.up_proj.weight",)  # the dense MLP layer
    assert "layers.1.mlp.up.weight" not in steps


def test_refusals_name_the_key_or_tensor(moe_dir, tmp_path):
    original = json.loads((moe_dir / "config.json").read_text())
    with pytest.raises(BridgeError, match="moe_latent_size=64 .* is not supported"):
        hf_to_mcore({**original, "moe_latent_size": 64}, FAMILY)


def test_score_correction_bias_round_trips(moe_dir, tmp_path):
    """The router's e_score_correction_bias (a buffer, our mlp.expert_bias) comes back bit for bit."""
    from safetensors.torch import load_file

    convert(moe_dir, tmp_path / "mcore", to="mcore", progress=False)
    convert(tmp_path / "mcore", tmp_path / "hf", to="hf", progress=False)
    source = {k: v for f in moe_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    back = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    biases = [k for k in source if k.endswith("gate.e_score_correction_bias")]
    assert biases and all(torch.equal(source[k], back[k]) for k in biases)
