"""Layer modules against plain float64 torch: norms, gated MLPs (both activations), logit masking, KV cache."""

import pytest
import torch
import torch.nn.functional as F

from mcore.models.families import get_config
from mcore.models.gpt import GPTModel
from mcore.models.layers import GatedMLP, KVCache, LayerNorm, RMSNorm, mask_padded_logits


def test_rms_norm_equals_float64_formula():
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 3, 48)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)


def test_layer_norm_equals_torch():
    norm = LayerNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    x = torch.randn(5, 3, 48, requires_grad=True)
    expected = F.layer_norm(x.double(), (48,), norm.weight.double(), norm.bias.double(), 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_equals_separate_gate_and_up(act):
    config = get_config("llama-tiny", hidden_act=act, mlp_bias=True)
    mlp = GatedMLP(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(6, 2, 64)
    gate_w, up_w = mlp.gate_up.weight.double().chunk(2)
    gate_b, up_b = mlp.gate_up.bias.double().chunk(2)
    gate = F.linear(x.double(), gate_w, gate_b)
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    expected = F.linear(gate * F.linear(x.double(), up_w, up_b), mlp.down.weight.double(), mlp.down.bias.double())
    scale = expected.abs().max().item()
    torch.testing.assert_close(mlp(x).double(), expected, rtol=1e-5, atol=1e-6 * scale)


def test_layernorm_gelu_model_trains_end_to_end():
    """The non-Llama options (LayerNorm with bias, GeGLU) build, init, and give finite gradients everywhere."""
    config = get_config("llama-tiny", normalization="layernorm", hidden_act="gelu_pytorch_tanh")
    model = GPTModel(config)
    model.init_weights(0)
    assert "layers.0.input_norm.bias" in dict(model.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, 8))
    model(ids, labels=ids).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_mask_padded_logits_per_tp_rank():
    # vocab 300 padded to 512 over tp=2: rank 0 holds 0..255 (all real), rank 1 holds 256..511 (real up to 299).
    rank0, rank1 = torch.randn(3, 256), torch.randn(3, 256)
    assert torch.isfinite(mask_padded_logits(rank0.clone(), 300, 0)).all()
    masked = mask_padded_logits(rank1.clone(), 300, 1)
    assert torch.equal(masked[:, :44], rank1[:, :44])
    assert torch.isneginf(masked[:, 44:]).all()


def test_bf16_model_tracks_fp32():
    config = get_config("qwen3-tiny")
    fp32, bf16 = GPTModel(config), GPTModel(config, params_dtype=torch.bfloat16)
    fp32.init_weights(4)
    bf16.init_weights(4)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        a, b = fp32(ids, labels=ids), bf16(ids, labels=ids)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05


def test_kv_cache_rejects_overflow_and_unknown_layers():
    cache = KVCache([0, 1], 2, 4, 2, 8, dtype=torch.float32)
    k = torch.randn(2, 3, 2, 8)
    keys, _ = cache.update(0, k, k)
    assert torch.equal(keys, k)
    with pytest.raises(ValueError, match="no buffers for layer 5"):
        cache.update(5, k, k)
    cache.advance(3)
    with pytest.raises(ValueError, match="cannot add keys of shape"):
        cache.update(1, k, k)
