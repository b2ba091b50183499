"""Nemotron-H's MoE layers (``E`` / ``moe``; our ``moe_relu2`` part) against transformers' ``NemotronHForCausalLM``:
logits and gradients with a non-zero score-correction bias and random router weights (so the group-limited sigmoid
routing really chooses), parameter counts, the pattern spellings, and bad configs."""

from __future__ import annotations

import pytest
import torch

from mcore.models.accounting import parameter_counts
from mcore.models.families import get_config
from mcore.models.families.nemotron_h import pattern_parts
from mcore.models.gpt import GPTModel
from mcore.models.layers.relu2_moe import SquaredReluMoEMLP
from tests.models.hf_weights import hf_model, hf_to_mcore_state, load_hf_weights, mcore_grads_as_hf


def _pair(config, seed):
    hf = hf_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in hf.state_dict(keep_vars=True).items():
            if name.endswith("gate.weight"):  # HF starts the router at zero: every expert would tie
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif name.endswith("gate.e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
    ours = GPTModel(config)
    ours.init_weights(seed + 1)
    load_hf_weights(ours, hf, config)
    hf_state = hf.state_dict()
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            if config.mlp_type(i) == "moe_relu2":
                ours.layers[str(i)].mlp.expert_bias.copy_(
                    hf_state[f"model.layers.{i}.mixer.gate.e_score_correction_bias"]
                )
    return hf.train(), ours.train()


@pytest.mark.parametrize("pattern", ["ME*E-", "EE"])
def test_nemotron_h_moe_logits_and_grads_equal_hf(pattern):
    config = get_config("nemotron_h-moe-tiny", **pattern_parts(pattern))
    hf, ours = _pair(config, seed=len(pattern))
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = hf(ids, use_cache=False).logits
    got = ours(ids)[..., : config.vocab_size]
    assert (got - ref).abs().max() <= 1e-4
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * gy).sum().backward()
    (got * gy).sum().backward()
    hf_grads = hf_to_mcore_state({n: p.grad for n, p in hf.named_parameters()}, config)
    for name, grad in mcore_grads_as_hf(ours, config).items():
        scale = hf_grads[name].abs().max().clamp_min(1e-6)
        assert ((grad - hf_grads[name]).abs().max() / scale) <= 1e-4, name


def test_expert_bias_changes_the_choice():
    """The copied score-correction bias matters: zeroing it changes our logits (so the parity above tests it)."""
    config = get_config("nemotron_h-moe-tiny", **pattern_parts("E"))
    _, ours = _pair(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with_bias = ours(ids)[..., : config.vocab_size]
        ours.layers["0"].mlp.expert_bias.zero_()
        without = ours(ids)[..., : config.vocab_size]
    assert (with_bias - without).abs().max() > 1e-3


def test_parameter_counts_equal_hf_on_meta():
    from tests.helpers.families import hf_classes, hf_config

    config = get_config("nemotron_h-moe-tiny")
    _, model_cls = hf_classes("nemotron_h")
    with torch.device("meta"):
        hf = model_cls(hf_config(config))
    assert parameter_counts(config).total == sum(p.numel() for p in hf.parameters())
    ours = GPTModel(config, device=torch.device("meta"))
    padding = 2 * (config.padded_vocab_size() - config.vocab_size) * config.hidden_size  # embedding and output rows
    assert parameter_counts(config).total == sum(p.numel() for p in ours.parameters()) - padding


def test_hf_block_types_and_pattern_string_agree_on_moe():
    assert pattern_parts(["mamba", "moe", "attention"]) == pattern_parts("ME*")
    assert pattern_parts("ME")["mlp_layer_types"] == ["none", "moe_relu2"]


def test_bad_moe_configs_name_the_field():
    config = get_config("nemotron_h-moe-tiny")
    with pytest.raises(ValueError, match="shared_expert_gate=False"):
        SquaredReluMoEMLP(get_config("nemotron_h-moe-tiny", shared_expert_gate=True))
    with pytest.raises(ValueError, match="needs TransformerConfig.num_experts"):
        SquaredReluMoEMLP(get_config("nemotron_h-tiny"))
    with pytest.raises(ValueError, match="must divide the experts' moe_intermediate_size"):
        from mcore.models.layers.relu2_moe import check_relu2_moe_tensor_parallel

        check_relu2_moe_tensor_parallel(config, 5)
