"""The ``mla`` mixer on its own: selective recompute of the up-projections (same gradients, fewer saved bytes), its
parameter / FLOP accounting against the module and the issue's MLA formula, the TP rule, the DeepSeek config rules
with their errors, and the latent KV cache (greedy decoding equals recomputation from scratch)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.models.accounting import layer_flops_per_token, parameter_counts
from mcore.models.families import get_config
from mcore.models.generate import generate
from mcore.models.gpt import GPTModel
from mcore.models.layers.mla import MultiLatentAttention
from mcore.models.mla_fields import mla_softmax_scale
from mcore.models.parts.registry import MIXERS


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_selective_recompute_gives_identical_gradients_and_saves_less(q_lora_rank):
    config = get_config("deepseek_v3-tiny", q_lora_rank=q_lora_rank)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    cu = torch.tensor([0, 10, 24, 31, 48], dtype=torch.int32)
    grads, losses, saved = [], [], []
    for recompute in (None, "selective"):
        model = GPTModel(config, recompute=recompute)
        model.init_weights(2)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids, cu_seqlens=cu)
        loss.sum().backward()
        losses.append(loss.detach())
        saved.append(total)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name
    assert saved[1] < saved[0]


def test_accounting_matches_the_module_and_the_mla_formula():
    config = get_config("deepseek_v3-tiny")
    spec = MIXERS.get("mla")
    module = MultiLatentAttention(config, 0)
    assert spec.parameters(config, 0) == sum(p.numel() for p in module.parameters())
    linear = sum(m.weight.numel() for m in module.modules() if hasattr(m, "weight") and m.weight.dim() == 2)
    assert spec.matmul_weights(config, 0) == linear
    seq = 4096
    heads, qk, v = config.num_attention_heads, 24 + 8, 16
    assert spec.sequence_flops(config, 0, seq) == 6 * heads * (qk + v) * seq
    mlp = 3 * config.hidden_size * config.intermediate_size
    assert layer_flops_per_token(config, seq, 0) == 6 * (linear + mlp) + 6 * heads * (qk + v) * seq
    assert parameter_counts(get_config("deepseek-v3")).total == 671_026_404_352  # HF's count without the MTP depth


def test_tensor_parallel_splits_heads():
    config = get_config("deepseek_v3-tiny")  # 4 heads
    assert config.valid_tensor_parallel_sizes(8) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"must divide num_attention_heads \(4\)"):
        config.check_tensor_parallel(8)


def test_yarn_mscale_enters_the_softmax_scale():
    plain = get_config("deepseek_v3-tiny")
    assert mla_softmax_scale(plain) == (24 + 8) ** -0.5
    yarn = get_config("deepseek-v3")  # factor 40, mscale_all_dim 1
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert mla_softmax_scale(yarn) == pytest.approx((128 + 64) ** -0.5 * mscale**2, rel=1e-12)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"qk_rope_head_dim": None}, r"multi-head latent attention needs \['qk_rope_head_dim'\]"),
        ({"head_dim": 16}, r"head_dim \(16\) must equal qk_rope_head_dim \(8\)"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"attention_bias": True}, "multi-head latent attention has no biases"),
        ({"first_k_dense_replace": 9}, r"first_k_dense_replace \(9\) exceeds num_hidden_layers \(3\)"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be an int >= 1"),
    ],
)
def test_bad_deepseek_fields_are_one_clear_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        get_config("deepseek_v3-tiny", **overrides)
    with pytest.raises(ValueError, match=r"\['q_lora_rank'\] are multi-head latent attention fields"):
        get_config("llama-tiny", q_lora_rank=8)


def test_dense_first_layers_and_mla_everywhere():
    config = get_config("deepseek-v3")
    assert [config.mlp_type(i) for i in (0, 2, 3, 60)] == ["dense", "dense", "moe", "moe"]
    assert {config.mixer_type(i) for i in range(61)} == {"mla"}


def test_latent_cache_decoding_equals_full_recomputation():
    config = get_config("deepseek_v2-tiny")
    model = GPTModel(config)
    model.init_weights(5)
    out = generate(model, torch.randint(0, config.vocab_size, (2, 4)), 8)
    with torch.no_grad():
        for t in range(4, out.shape[1]):
            assert torch.equal(model(out[:, :t])[:, -1].argmax(-1), out[:, t])


def test_context_parallelism_refuses_cu_seqlens_clearly():
    # MLA under CP: tests/train/test_cp_sinks_mtp.py; its documents come from the CP sharding
    config = get_config("deepseek_v3-tiny")
    module = MultiLatentAttention(config, 0)
    with pytest.raises(ValueError, match="MLA under context parallelism takes no kv_cache or cu_seqlens"):
        module(torch.randn(8, 1, config.hidden_size), None, cu_seqlens=torch.tensor([0, 8]), context_parallel=object())
