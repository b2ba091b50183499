"""GPT-OSS beyond the per-family tables: HF parity with the clamps of the SwiGLU active, the sinks' gradient against a
float64 attention written from the definition (GQA, sliding window, every backend that claims sinks on the CPU),
the layer pattern, YaRN, released sizes and the config's errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mcore.kernels import attention
from mcore.models.accounting import parameter_counts
from mcore.models.config import TransformerConfig
from mcore.models.families import get_config
from tests.models.test_hf_parity import LOGIT_ATOL, _assert_grads_equal, _pair


@pytest.mark.parametrize("limit", [0.05, 0.3])
def test_hf_parity_with_the_swiglu_clamps_active(limit):
    # The tiny model's expert pre-activations are ~0.2: a limit of 0.05 or 0.3 clamps many gates and ups.
    config = get_config("gpt_oss-tiny", swiglu_limit=limit, swiglu_alpha=1.3)
    hf, ours = _pair(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (2, 20))
    ref = hf(ids).logits
    logits = ours(ids)
    assert (logits[..., : config.vocab_size] - ref).abs().max() <= LOGIT_ATOL
    weights = torch.rand(2, 20, config.vocab_size)
    (ref * weights).sum().backward()
    (logits[..., : config.vocab_size] * weights).sum().backward()
    _assert_grads_equal(hf, ours, config)
    sinks = [p for n, p in ours.named_parameters() if n.endswith("sinks.weight")]
    assert len(sinks) == config.num_hidden_layers and all(p.grad.abs().sum() > 0 for p in sinks)


def _float64_attention(q, k, v, sinks, window):
    """softmax over [scores, sink] per query head, the sink's column dropped: the definition, in float64."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (j > i - window if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    logits = torch.cat([scores, sinks.view(1, hq, 1, 1).expand(b, hq, s, 1)], dim=-1)
    probs = F.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_gradient_against_float64(backend, window):
    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    torch.manual_seed(0)
    b, s, hq, hkv, d = 2, 19, 4, 2, 16
    q, k, v = (torch.randn(b, s, h, d) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq) * 2
    dout = torch.randn(b, s, hq, d)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out = attention(*inputs[:3], sinks=inputs[3], window_size=window, backend=backend)
    out.backward(dout)
    ref_inputs = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    ref = _float64_attention(*ref_inputs, window)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want, name in zip(inputs, ref_inputs, "qkvs"):
        message = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5, msg=message)
    assert inputs[3].grad.abs().min() > 0


def test_layer_pattern_yarn_and_sizes():
    c = get_config("gpt-oss-20b")
    assert c.layer_types[:4] == ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    assert [c.window_for_layer(i) for i in range(2)] == [128, None]
    assert c.rope_scaling == {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096,
    }  # fmt: skip
    # the released checkpoints' totals (safetensors index of openai/gpt-oss-20b and -120b, in bf16 terms)
    assert parameter_counts(c).total == 20_914_757_184
    assert parameter_counts(get_config("gpt-oss-120b")).total == 116_829_156_672


def test_yarn_attention_factor_scales_cos_and_sin():
    from mcore.kernels import rope_inv_freq

    c = get_config("gpt-oss-20b")
    _, factor = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    assert factor == pytest.approx(0.1 * math.log(32.0) + 1.0)


@pytest.mark.parametrize(
    "fields, error, pattern",
    [
        ({"swiglu_alpha": None}, ValueError, "swiglu_alpha .* and swiglu_limit"),
        ({"swiglu_limit": -1.0}, ValueError, "swiglu_limit must be a finite number > 0"),
        ({"swiglu_alpha": "1.7"}, TypeError, "swiglu_alpha must be a number"),
        ({"attention_sinks": 1}, TypeError, "attention_sinks must be a bool"),
        ({"num_experts": None}, ValueError, r"\['router_bias', 'expert_biases', 'swiglu_limit'\] apply to MoE"),
    ],
)
def test_bad_fields_are_one_clear_error(fields, error, pattern):
    base = get_config("gpt_oss-tiny").to_dict()
    with pytest.raises(error, match=pattern):
        TransformerConfig.from_dict({**base, **fields})


@pytest.mark.gpu
def test_cuda_equals_hf_and_bf16_tracks_fp32():
    """On CUDA: fp32 (sinks through FlexAttention) equals HF, logits and every gradient; bf16 (sinks, windows and the
    clamped SwiGLU through our Triton kernels) tracks fp32."""
    from mcore.models.gpt import GPTModel
    from tests.models.hf_weights import hf_model, load_hf_weights

    config = get_config("gpt_oss-tiny", swiglu_limit=0.3)
    hf = hf_model(config, seed=0).cuda()
    ours = GPTModel(config, device="cuda")
    ours.init_weights(1)
    load_hf_weights(ours, hf, config)
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    ref = hf(ids).logits
    logits = ours(ids)[..., : config.vocab_size]
    assert (logits - ref).abs().max() <= LOGIT_ATOL
    weights = torch.rand(ref.shape, device="cuda")
    (ref * weights).sum().backward()
    (logits * weights).sum().backward()
    _assert_grads_equal(hf, ours, config)
    bf16 = GPTModel(config, device="cuda")
    load_hf_weights(bf16, hf, config)
    bf16 = bf16.to(torch.bfloat16)
    with torch.no_grad():
        a, b = ours(ids, labels=ids), bf16(ids, labels=ids)
    assert b.dtype == torch.float32 and (a - b).abs().mean() < 0.02
    loss = bf16(ids, labels=ids).sum()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in bf16.parameters())
    assert all(p.grad.abs().sum() > 0 for n, p in bf16.named_parameters() if n.endswith("sinks.weight"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flex"])
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_sinks_gradient_against_float64(window, backend):
    """Every CUDA backend that takes sinks trains them: our Triton kernel (bf16) and FlexAttention (fp32)."""
    torch.manual_seed(0)
    b, s, hq, hkv, d = 1, 512, 8, 2, 64
    dtype = torch.bfloat16 if backend == "triton" else torch.float32
    q, k, v = (torch.randn(b, s, h, d, device="cuda") for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, device="cuda") * 2
    dout = torch.randn(b, s, hq, d, device="cuda")
    inputs = [t.to(dtype).requires_grad_(True) for t in (q, k, v)] + [sinks.clone().requires_grad_(True)]
    out = attention(*inputs[:3], sinks=inputs[3], window_size=window, backend=backend)
    out.backward(dout.to(dtype))
    ref_inputs = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = _float64_attention(*[t.cpu() for t in ref_inputs[:3]], ref_inputs[3].cpu(), window)
    ref.backward(dout.double().cpu())
    assert (out.double().cpu() - ref).abs().max() < 3e-2
    torch.testing.assert_close(inputs[3].grad.double().cpu(), ref_inputs[3].grad.cpu(), rtol=2e-2, atol=2e-2)
