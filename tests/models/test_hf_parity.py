"""Each family equals its Hugging Face transformers model (eager attention, fp32) given the same weights:
logits, per-token loss and every parameter gradient, for plain and packed batches."""

import pytest
import torch
import torch.nn.functional as F

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from tests.helpers.families import families, tiny_config
from tests.models.hf_weights import hf_model, hf_to_mcore_state, load_hf_weights, mcore_grads_as_hf

LOGIT_ATOL = 1e-4
# atol is relative to the largest gradient of the tensor: fp32 rounding of a sum of O(|g|) terms is ~1e-7 |g|, and
# transformers 5.2x's Qwen3 differs from ours by 1.2e-6 on an embedding gradient of scale 8 (both are 4e-6 from the
# float64 HF gradient, so neither is wrong).
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
# Every registered family's tiny preset (mistral's has window 8 < the test sequences), plus variants.
CASES = {
    **{family: tiny_config(family) for family in families()},
    # Llama 3.1 rope scaling with a short original context, so the scaled frequencies differ from plain RoPE.
    "llama3.1-rope": get_config(
        "llama-tiny",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-tied-mha": get_config("llama-tiny", tie_word_embeddings=True, num_key_value_heads=4),
    "qwen2-tied": get_config("qwen2-tiny", tie_word_embeddings=True),
    # DeepSeek: full-rank queries (V2-Lite, Moonlight); 2 groups of 4 experts, only the best group; YaRN with
    # DeepSeek's mscale in the softmax scale and halves-layout rotary dims; V2 with YaRN.
    "deepseek_v3-no-q-lora": get_config("deepseek_v3-tiny", q_lora_rank=None),
    "deepseek_v3-groups-2-1": get_config(
        "deepseek_v3-tiny", moe_router={"score_function": "sigmoid", "expert_bias": True, "n_group": 2, "topk_group": 1}
    ),
    "deepseek_v3-yarn": get_config("deepseek_v3-tiny", rope_interleave=False, rope_scaling=_YARN),
    "deepseek_v2-yarn": get_config("deepseek_v2-tiny", rope_scaling=_YARN),
    # V2's group_limited_greedy: a group scores its best expert
    "deepseek_v2-groups-4-2": get_config(
        "deepseek_v2-tiny",
        moe_router={"n_group": 4, "topk_group": 2, "group_score": "max", "routed_scaling_factor": 1.5},
    ),
}


def _pair(config, seed=0):
    hf = hf_model(config, seed)
    ours = GPTModel(config)
    ours.init_weights(seed + 1)
    load_hf_weights(ours, hf, config)
    return hf, ours


def _labels(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, ids.shape)
    labels[torch.rand(ids.shape) < 0.2] = -100
    return labels


def _hf_grads(hf, config):
    grads = {k: p.grad for k, p in hf.named_parameters()}
    if config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return hf_to_mcore_state(grads, config)


def _assert_grads_equal(hf, ours, config):
    expected = _hf_grads(hf, config)
    got = mcore_grads_as_hf(ours, config)
    assert set(expected) == set(got)
    for name, g in got.items():
        atol = GRAD_ATOL * max(1.0, expected[name].abs().max().item())
        torch.testing.assert_close(g, expected[name], rtol=GRAD_RTOL, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_grads_equal_hf(case):
    config = CASES[case]
    hf, ours = _pair(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    labels = _labels(ids, config.vocab_size)

    ref_logits = hf(ids).logits
    ref_loss = F.cross_entropy(
        ref_logits.reshape(-1, config.vocab_size), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(2, 24)
    logits = ours(ids)
    assert logits.shape == (2, 24, config.padded_vocab_size(1))
    assert (logits[..., : config.vocab_size] - ref_logits).abs().max() <= LOGIT_ATOL
    assert torch.isneginf(logits[..., config.vocab_size :]).all()

    loss = ours(ids, labels=labels)
    assert loss.dtype == torch.float32 and loss.shape == (2, 24)
    assert (loss[labels == -100] == 0).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)

    # A random weighting of the tokens, so that every position's gradient matters differently.
    weights = torch.rand(2, 24)
    (ref_loss * weights).sum().backward()
    (loss * weights).sum().backward()
    _assert_grads_equal(hf, ours, config)


@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral"])
def test_packed_documents_equal_hf_run_per_document(case):
    """Documents packed into rows (boundaries inside and at the end of each row) equal HF run on each alone."""
    config = CASES[case]
    hf, ours = _pair(config)
    b, s = 2, 24
    cu_seqlens = torch.tensor([0, 5, 18, 24, 35, 48], dtype=torch.int32)
    ids = torch.randint(0, config.vocab_size, (b, s))
    labels = _labels(ids, config.vocab_size)
    weights = torch.rand(b, s)

    flat_ids, flat_labels, flat_w = ids.reshape(-1), labels.reshape(-1), weights.reshape(-1)
    ref_logits, ref_loss = [], []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        doc_logits = hf(flat_ids[start:end][None]).logits[0]
        doc_loss = F.cross_entropy(doc_logits, flat_labels[start:end], ignore_index=-100, reduction="none")
        (doc_loss * flat_w[start:end]).sum().backward()
        ref_logits.append(doc_logits)
        ref_loss.append(doc_loss)
    ref_logits = torch.cat(ref_logits).view(b, s, -1)
    ref_loss = torch.cat(ref_loss).view(b, s)

    positions = torch.cat([torch.arange(e - st) for st, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    with torch.no_grad():
        logits = ours(ids, cu_seqlens=cu_seqlens)
        logits_explicit = ours(ids, cu_seqlens=cu_seqlens, position_ids=positions.view(b, s))
    assert (logits[..., : config.vocab_size] - ref_logits).abs().max() <= LOGIT_ATOL
    torch.testing.assert_close(logits, logits_explicit, rtol=0, atol=0)

    loss = ours(ids, labels=labels, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    (loss * weights).sum().backward()
    _assert_grads_equal(hf, ours, config)


def test_packing_changes_the_result():
    """Guard against a vacuous packed test: without cu_seqlens the same rows give different logits."""
    config = CASES["llama"]
    _, ours = _pair(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    cu_seqlens = torch.tensor([0, 5, 18, 24, 35, 48], dtype=torch.int32)
    with torch.no_grad():
        plain, packed = ours(ids), ours(ids, cu_seqlens=cu_seqlens)
    v = config.vocab_size
    assert (plain[..., :v] - packed[..., :v]).abs().max() > 1e-3
