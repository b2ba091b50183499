"""Hybrid patterns: Megatron's pattern string and HF's block-type list give the same model; several Nemotron-H
patterns equal HF; packed documents equal separate HF runs for the state-space families; pipeline layouts of a
hybrid are balanced by per-layer cost (a Mamba layer does not cost what an MLP or attention layer costs)."""

from __future__ import annotations

import pytest
import torch

from mcore.models.accounting import layer_costs
from mcore.models.families import get_config
from mcore.models.families.nemotron_h import parts_pattern, pattern_parts
from mcore.models.gpt import GPTModel
from mcore.models.stages import pipeline_layout
from tests.models.hf_weights import hf_model, load_hf_weights


def test_pattern_string_and_hf_block_types_agree_and_round_trip():
    from_string = pattern_parts("M-*M")
    from_list = pattern_parts(["mamba", "mlp", "attention", "linear_attention"])
    assert from_string == from_list
    assert from_string["layer_types"] == ["mamba2", "none", "nope_attention", "mamba2"]
    assert from_string["mlp_layer_types"] == ["none", "relu2", "none", "none"]
    assert parts_pattern(from_string["layer_types"], from_string["mlp_layer_types"]) == "M-*M"
    with pytest.raises(ValueError, match=r"unknown entries \['X'\]"):
        pattern_parts("M-X")
    assert parts_pattern(**{k: v for k, v in pattern_parts("ME-").items() if k != "num_hidden_layers"}) == "ME-"
    with pytest.raises(ValueError, match="Nemotron-H layers are one of"):
        parts_pattern(["full_attention"], ["dense"])


def _pair(config, seed=0):
    hf = hf_model(config, seed)
    ours = GPTModel(config)
    ours.init_weights(seed + 1)
    load_hf_weights(ours, hf, config)
    return hf, ours


@pytest.mark.parametrize("pattern", ["*M-M", "MM", "-*-", "M*M*-"])
def test_nemotron_h_patterns_equal_hf(pattern):
    config = get_config("nemotron_h-tiny", **pattern_parts(pattern))
    hf, ours = _pair(config, seed=len(pattern))
    ids = torch.randint(0, config.vocab_size, (2, 20))
    with torch.no_grad():
        ref, got = hf(ids, use_cache=False).logits, ours(ids)[..., : config.vocab_size]
    assert (got - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h"])
def test_packed_documents_equal_hf_run_per_document(family):
    config = get_config(f"{family}-tiny")
    hf, ours = _pair(config)
    b, s = 2, 20
    cu = torch.tensor([0, 3, 4, 13, 20, 29, 40], dtype=torch.int32)  # inside chunks, a one-token document
    ids = torch.randint(0, config.vocab_size, (b, s))
    flat = ids.reshape(-1)
    with torch.no_grad():
        ref = torch.cat([hf(flat[a:z][None]).logits[0] for a, z in zip(cu[:-1].tolist(), cu[1:].tolist())])
        got = ours(ids, cu_seqlens=cu)[..., : config.vocab_size].reshape(b * s, -1)
        unpacked = ours(ids)[..., : config.vocab_size].reshape(b * s, -1)
    assert (got - ref).abs().max() <= 1e-4
    assert (unpacked - ref).abs().max() > 1e-3  # the documents would mix without the resets


def test_balanced_pipeline_layout_weighs_hybrid_layers_by_cost():
    config = get_config("nemotron-h-8b")
    costs = layer_costs(config, 8192)
    mamba, mlp, attention = costs[0], costs[1], costs[7]
    assert config.mixer_type(7) == "nope_attention" and len({mamba, mlp, attention}) == 3
    layout = pipeline_layout(config, 4, 1, "balanced", 8192)
    assert sum(layout) == 52 and len(set(layout)) > 1  # uneven layer counts
    starts = [sum(layout[:i]) for i in range(4)]
    stage_costs = [sum(costs[a : a + n]) for a, n in zip(starts, layout, strict=True)]
    even = [sum(costs[i * 13 : (i + 1) * 13]) for i in range(4)]
    stage_costs[-1] += 6 * config.vocab_size * config.hidden_size
    even[-1] += 6 * config.vocab_size * config.hidden_size
    assert max(stage_costs) < max(even)


@pytest.mark.parametrize(
    "overrides",
    [
        {"mamba_rms_norm": True},
        {"mamba_rms_norm": True, "mamba_norm_before_gate": False, "mamba_proj_bias": True, "projectors_bias": True},
        {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ],
    ids=["gated-norm", "gate-then-norm-biases", "attention-mlp-biases-tied"],
)
def test_falcon_h1_variants_equal_hf(overrides):
    config = get_config("falcon_h1-tiny", **overrides)
    hf, ours = _pair(config, seed=5)
    ids = torch.randint(0, config.vocab_size, (2, 20))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)[..., : config.vocab_size]
    assert (got - ref).abs().max() <= 1e-4


def test_published_totals():
    from mcore.models.accounting import parameter_counts

    # Pinned (each equals HF on the meta device, test_accounting); the model cards round them to 7.3B, 8B, 0.5B.
    assert parameter_counts(get_config("mamba-codestral-7b")).total == 7_285_403_648
    assert parameter_counts(get_config("nemotron-h-8b")).total == 8_100_852_736
    assert parameter_counts(get_config("falcon-h1-0.5b")).total == 521_411_104


def test_more_published_sizes():
    from mcore.models.accounting import parameter_counts

    # The model cards' rounded sizes (each preset equals HF on the meta device, test_accounting).
    billions = {
        "nemotron-h-47b": 46.8,
        "nemotron-h-56b": 56.3,
        "nemotron-nano-9b-v2": 8.89,
        "nemotron-nano-12b-v2": 12.3,
        "nemotron-3-nano-30b-a3b": 31.6,
    }
    for name, size in billions.items():
        digits = len(str(size).split(".")[1])
        assert round(parameter_counts(get_config(name)).total / 1e9, digits) == size, name


def test_nemotron_h_on_the_triton_kernels_equals_hf(monkeypatch):
    """Every op on its Triton kernel (the interpreter on CPU): SSD, conv, gated norm, attention, norms, loss."""
    from mcore.kernels import dispatch
    from tests.models.hf_weights import hf_to_mcore_state, mcore_grads_as_hf

    if not dispatch.triton_interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (CUDA runs the same kernels compiled in tests/models/test_gpu.py)")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    config = get_config("nemotron_h-tiny")
    hf, ours = _pair(config, seed=2)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    ref = hf(ids, use_cache=False).logits
    got = ours(ids)[..., : config.vocab_size]
    assert (got - ref).abs().max() <= 1e-4
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    (ref * gy).sum().backward()
    (got * gy).sum().backward()
    hf_grads = hf_to_mcore_state({n: p.grad for n, p in hf.named_parameters()}, config)
    for name, grad in mcore_grads_as_hf(ours, config).items():
        assert (grad - hf_grads[name]).abs().max() <= 1e-4 * hf_grads[name].abs().max() + 1e-7, name
