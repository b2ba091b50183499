"""GPTModel in one process: parameter names and attributes of the contract, layout-independent init,
pipeline stages composing to the whole model, recomputation, and input validation."""

import dataclasses

import pytest
import torch

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel

QWEN3 = get_config("qwen3-tiny")
QWEN2 = get_config("qwen2-tiny", tie_word_embeddings=True)


def _expected_names(config, layers, *, first=True, last=True):
    names = set()
    if first or (last and config.tie_word_embeddings):
        names.add("embedding.weight")
    for i in layers:
        p = f"layers.{i}."
        names |= {p + n for n in ("input_norm.weight", "attention.qkv.weight", "attention.out_proj.weight")}
        names |= {p + n for n in ("mlp_norm.weight", "mlp.gate_up.weight", "mlp.down.weight")}
        if config.attention_bias:
            names.add(p + "attention.qkv.bias")
        if config.qk_norm:
            names |= {p + "attention.q_norm.weight", p + "attention.k_norm.weight"}
    if last:
        names.add("final_norm.weight")
        if not config.tie_word_embeddings:
            names.add("output.weight")
    return names


@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2-tied"])
def test_parameter_names_shapes_and_attributes(config):
    model = GPTModel(config)
    params = dict(model.named_parameters())
    assert set(params) == _expected_names(config, range(config.num_hidden_layers))
    assert set(model.state_dict()) == set(params)
    d, g = config.head_dim, config.num_key_value_heads
    assert params["layers.1.attention.qkv.weight"].shape == ((config.query_heads_per_kv_head + 2) * d * g, 64)
    assert params["layers.0.mlp.gate_up.weight"].partition_blocks == (176, 176)
    assert params["layers.0.mlp.down.weight"].partition_dim == 1
    emb = params["embedding.weight"]
    assert emb.shape == (384, 64) and (emb.vocab_padded_dim, emb.vocab_size) == (0, 320)
    assert not emb.shared_embedding  # a single pipeline stage holds both uses
    if "output.weight" in params:
        out = params["output.weight"]
        assert (out.vocab_padded_dim, out.vocab_size, out.partition_dim) == (0, 320, 0)


def test_init_is_seeded_by_name_and_zeroes_vocab_padding():
    a, b, c = GPTModel(QWEN3), GPTModel(QWEN3), GPTModel(QWEN3)
    a.init_weights(5)
    b.init_weights(5)
    c.init_weights(6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    emb = dict(a.named_parameters())["embedding.weight"]
    assert (emb[320:] == 0).all() and emb[:320].std().item() == pytest.approx(0.02, rel=0.1)
    # Different parameters get different streams (no two layers identical).
    assert not torch.equal(a.layers["0"].attention.qkv.weight, a.layers["1"].attention.qkv.weight)


@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2-tied"])
def test_pipeline_stages_compose_to_the_whole_model(config):
    """Stages built separately (same seed) have the whole model's names and values, and chained give its loss."""
    config = dataclasses.replace(config, num_hidden_layers=3)
    whole = GPTModel(config)
    whole.init_weights(11)
    stages = [
        GPTModel(config, layer_range=(0, 1), post_process=False),
        GPTModel(config, layer_range=(1, 1), pre_process=False, post_process=False),
        GPTModel(config, layer_range=(1, 3), pre_process=False),
    ]
    ref = dict(whole.named_parameters())
    for i, stage in enumerate(stages):
        stage.init_weights(11)
        names = dict(stage.named_parameters())
        assert set(names) == _expected_names(config, range(*stage.layer_range), first=i == 0, last=i == 2)
        for n, p in names.items():
            assert torch.equal(p, ref[n]), n
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    cu = torch.tensor([0, 9, 16, 20, 32], dtype=torch.int32)
    x = stages[0](ids, cu_seqlens=cu)
    assert x.shape == (16, 2, 64)
    x = stages[1](hidden_states=x, cu_seqlens=cu)
    loss = stages[2](hidden_states=x, labels=labels, cu_seqlens=cu)
    torch.testing.assert_close(loss, whole(ids, labels=labels, cu_seqlens=cu), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_identical_gradients(mode):
    config = get_config("mistral-tiny", num_hidden_layers=3)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    labels = torch.randint(0, config.vocab_size, (2, 24))
    cu = torch.tensor([0, 10, 24, 31, 48], dtype=torch.int32)
    grads, losses = [], []
    for recompute in (None, mode):
        model = GPTModel(config, recompute=recompute)
        model.init_weights(2)
        loss = model(ids, labels=labels, cu_seqlens=cu)
        loss.sum().backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_selective_recompute_saves_fewer_activations():
    """Recompute must actually drop saved tensors (else the identical-gradient test proves nothing)."""
    config = get_config("llama-tiny")
    ids = torch.randint(0, config.vocab_size, (2, 32))

    def saved_bytes(recompute):
        model = GPTModel(config, recompute=recompute)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids).sum()
        return total

    none, selective, full = saved_bytes(None), saved_bytes("selective"), saved_bytes("full")
    assert full < selective < none


def test_invalid_construction_and_inputs():
    with pytest.raises(ValueError, match="recompute must be one of"):
        GPTModel(QWEN3, recompute="some")
    with pytest.raises(ValueError, match=r"layer_range \(1, 5\)"):
        GPTModel(QWEN3, layer_range=(1, 5))
    model = GPTModel(QWEN3)
    ids = torch.randint(0, 320, (2, 8))
    with pytest.raises(ValueError, match="first pipeline stage takes input_ids"):
        model(hidden_states=torch.randn(8, 2, 64))
    with pytest.raises(ValueError, match=r"labels must be \[b, s\] = \[2, 8\]"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(ValueError, match="position_ids must be integer"):
        model(ids, position_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(ids.float())
    stage = GPTModel(QWEN3, layer_range=(1, 2), pre_process=False)
    with pytest.raises(ValueError, match=r"hidden_states must be \[s, b, 64\]"):
        stage(hidden_states=torch.randn(8, 2, 32))
