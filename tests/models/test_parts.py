"""Layers from registered parts: names validated by the config, layers composed per index, accounting and the
tensor-parallel rule taken from each part, balanced pipeline layouts weighing each layer's own cost."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mcore.models.accounting import layer_costs, model_flops_per_token, parameter_counts
from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.models.layers.mlp import GatedMLP, dense_mlp_matmul_weights, dense_mlp_parameters
from mcore.models.parts import MIXERS, MLPS, PartSpec
from mcore.models.stages import build_stage_chunks, pipeline_layout
from mcore.parallel.grid import ProcessGroups


class WideMLP(GatedMLP):
    """A dense MLP of twice the hidden width, under another module name: a part a test can register."""

    def __init__(self, config, layer_index=0, context=None):
        super().__init__(
            dataclasses.replace(config, intermediate_size=2 * config.intermediate_size), layer_index, context
        )


def _wide(fn):
    return lambda config, i: fn(dataclasses.replace(config, intermediate_size=2 * config.intermediate_size), i)


def _check_wide_tp(config, tp):
    if tp > 2:  # a rule of its own, so that the test can tell whose rule refused
        raise ValueError(f"wide MLP: tp {tp} must be at most 2")


class NoMixer(nn.Module):
    """A token mixer whose output is zero (unlike the built-in "none" part it keeps its norm and branch)."""

    def forward(self, x, rope, *, cu_seqlens=None, kv_cache=None):
        return torch.zeros_like(x)


WIDE = PartSpec(
    name="wide",
    attribute="wide_mlp",
    build=WideMLP,
    parameters=_wide(dense_mlp_parameters),
    matmul_weights=_wide(dense_mlp_matmul_weights),
    check_tensor_parallel=_check_wide_tp,
)
ZERO = PartSpec(
    name="zero",
    attribute="no_mixer",
    build=lambda config, i, ctx: NoMixer(),
    parameters=lambda config, i: 0,
    matmul_weights=lambda config, i: 0,
    check_tensor_parallel=lambda config, tp: None,
)


@pytest.fixture
def parts():
    MLPS.register(WIDE)
    MIXERS.register(ZERO)
    yield
    MLPS.unregister("wide")
    MIXERS.unregister("zero")


def _mixed_config(**overrides):
    return get_config(
        "llama-tiny",
        num_hidden_layers=4,
        layer_types=["full_attention", "zero", "full_attention", "zero"],
        mlp_layer_types=["dense", "wide", "wide", "dense"],
        **overrides,
    )


def test_unknown_part_names_are_refused_naming_the_registered_ones():
    expected = (
        r"mlp_layer_types entries must be registered mlp parts "
        r"\['dense', 'relu2', 'falcon_h1_mlp', 'none', 'moe', 'bitnet_mlp'\].*'sparse9'"
    )
    with pytest.raises(ValueError, match=expected):
        get_config("llama-tiny", mlp_layer_types=["dense", "sparse9"])
    with pytest.raises(ValueError, match=r"layer_types entries must be registered mixer parts.*'mamba9'"):
        get_config("llama-tiny", layer_types=["full_attention", "mamba9"])
    with pytest.raises(ValueError, match="mlp_layer_types has 1 entries but num_hidden_layers is 2"):
        get_config("llama-tiny", mlp_layer_types=["dense"])
    with pytest.raises(ValueError, match="unknown mixer part 'mla'"):
        MIXERS.get("mla")
    with pytest.raises(ValueError, match="already registered"):
        MLPS.register(dataclasses.replace(WIDE, name="dense"))


def test_layers_are_composed_from_their_parts(parts):
    config = _mixed_config()
    model = GPTModel(config)
    model.init_weights(0)
    names = {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith("layers.")}
    assert names == {"input_norm", "attention", "mlp_norm", "mlp", "wide_mlp"}
    assert [type(layer.mixer).__name__ for layer in model.layers.values()] == [
        "SelfAttention",
        "NoMixer",
        "SelfAttention",
        "NoMixer",
    ]
    assert model.layers["1"].wide_mlp.gate_up.weight.shape[0] == 4 * config.intermediate_size
    ids = torch.randint(0, config.vocab_size, (2, 8))
    loss = model(ids, labels=ids)
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    # Every parameter gets a gradient, except the input norms of the layers whose mixer ignores its input.
    no_grad = {n for n, p in model.named_parameters() if p.grad is None}
    assert no_grad == {"layers.1.input_norm.weight", "layers.3.input_norm.weight"}
    # The same seed gives the same weights as a model built without the wide MLPs where the names agree.
    plain = GPTModel(get_config("llama-tiny", num_hidden_layers=4))
    plain.init_weights(0)
    torch.testing.assert_close(model.layers["0"].attention.qkv.weight, plain.layers["0"].attention.qkv.weight)


def test_accounting_sums_the_parts(parts):
    config = _mixed_config()
    model = GPTModel(config)
    counts = parameter_counts(config)
    real_vocab_rows = config.padded_vocab_size(1) - config.vocab_size
    padding = real_vocab_rows * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    assert counts.total == sum(p.numel() for p in model.parameters()) - padding
    h, f, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    attention = h * (q + 2 * kv) + q * h
    assert counts.mixers == 2 * attention
    seq = 64
    costs = layer_costs(config, seq)
    assert costs == [
        6 * (attention + 3 * h * f) + 12 * q * seq,
        6 * (3 * h * 2 * f),
        6 * (attention + 3 * h * 2 * f) + 12 * q * seq,
        6 * (3 * h * f),
    ]
    assert model_flops_per_token(config, seq) == sum(costs) + 6 * config.vocab_size * h


def test_tensor_parallel_rule_comes_from_each_part(parts):
    config = _mixed_config(intermediate_size=8, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"wide MLP: tp 4 must be at most 2; valid tp for this model: \[1, 2\]"):
        config.check_tensor_parallel(4)
    config.check_tensor_parallel(2)


def test_balanced_pipeline_layout_weighs_each_layer(parts):
    config = get_config(
        "llama-tiny",
        num_hidden_layers=6,
        layer_types=["zero"] * 3 + ["full_attention"] * 3,
        mlp_layer_types=["dense"] * 6,
    )
    layout = pipeline_layout(config, 2, 1, "balanced", 64)
    costs = layer_costs(config, 64)
    assert costs[0] < costs[5]
    assert layout[0] > layout[1]  # cheap MLP-only layers first: the first stage holds more of them
    assert pipeline_layout(config, 2, 1, "even", 64) is None
    assert pipeline_layout(config, 1, 1, "balanced", 64) is None
    assert pipeline_layout(config, 2, 1, [5, 1], 64) == [5, 1]
    with pytest.raises(ValueError, match="pipeline layout must be one of"):
        pipeline_layout(config, 2, 1, "greedy", 64)


def test_the_none_part_leaves_its_sub_block_out():
    config = get_config(
        "llama-tiny",
        num_hidden_layers=3,
        layer_types=["full_attention", "none", "full_attention"],
        mlp_layer_types=["none", "dense", "dense"],
    )
    model = GPTModel(config)
    model.init_weights(0)
    names = {n for n, _ in model.named_parameters() if n.startswith(("layers.0.", "layers.1."))}
    assert {n.split(".")[2] for n in names if n.startswith("layers.0.")} == {"input_norm", "attention"}
    assert {n.split(".")[2] for n in names if n.startswith("layers.1.")} == {"mlp_norm", "mlp"}
    padding = (config.padded_vocab_size(1) - config.vocab_size) * config.hidden_size * 2
    assert parameter_counts(config).total == sum(p.numel() for p in model.parameters()) - padding
    assert parameter_counts(config).norms == 5 * config.hidden_size  # 2 + 1 + ... : 4 sub-blocks and the final norm
    x = torch.randn(8, 2, config.hidden_size)
    rope = model.rotary(torch.arange(8).expand(2, 8))
    layer = model.layers["1"]
    torch.testing.assert_close(layer(x, rope), x + layer.mlp(layer.mlp_norm(x)))
    assert layer.mixer is None


def test_stage_chunks_of_one_rank_equal_the_whole_model():
    config = get_config("llama-tiny")
    (chunk,) = build_stage_chunks(config, ProcessGroups.single(), seed=7)
    whole = GPTModel(config)
    whole.init_weights(7)
    assert chunk.pre_process and chunk.post_process and chunk.layer_range == (0, config.num_hidden_layers)
    for (n, a), (m, b) in zip(chunk.named_parameters(), whole.named_parameters(), strict=True):
        assert n == m and torch.equal(a, b)
