"""On a CUDA device (Triton kernels, SDPA / FlexAttention): the models still equal Hugging Face, and bf16
tracks fp32. Skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F

from mcore.models.families import get_config
from mcore.models.generate import generate
from mcore.models.gpt import GPTModel
from tests.helpers.families import families, tiny_config
from tests.helpers.hf_adapters import adapter
from tests.models.hf_weights import hf_model, hf_to_mcore_state, load_hf_weights, mcore_grads_as_hf

pytestmark = pytest.mark.gpu

# Every registered family's tiny preset; llama wider (8 heads of 16) and qwen2 with tied embeddings as variants.
CONFIGS = {
    **{family: tiny_config(family) for family in families()},
    "llama": get_config("llama-tiny", hidden_size=128, intermediate_size=352, num_attention_heads=8),
    "qwen2-tied": get_config("qwen2-tiny", tie_word_embeddings=True),
}


def _pair(config, dtype=torch.float32):
    hf = hf_model(config, seed=0).cuda()
    ours = GPTModel(config, device="cuda")
    ours.init_weights(1)
    load_hf_weights(ours, hf, config)
    return hf, ours.to(dtype)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_cuda_logits_and_grads_equal_hf(case):
    config = CONFIGS[case]
    hf, ours = _pair(config)
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    labels = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    ref_logits = hf(ids).logits
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 64)
    logits = ours(ids)
    assert (logits[..., : config.vocab_size] - ref_logits).abs().max() <= 1e-4
    loss = ours(ids, labels=labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    ref_loss.sum().backward()
    loss.sum().backward()
    if adapter(config.model_type) is not None:
        # the state-space families (not Llama-shaped): every gradient, through the test mapping of HF's names
        hf_grads = hf_to_mcore_state({n: p.grad for n, p in hf.named_parameters()}, config)
        for name, grad in mcore_grads_as_hf(ours, config).items():
            assert (grad - hf_grads[name]).abs().max() <= 1e-3 * hf_grads[name].abs().max() + 1e-6, name
        return
    for got, want in _comparable_grads(ours, hf, config):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def _comparable_grads(ours, hf, config):
    """The output layer's weight gradient (the embedding's when tied) and, where layer 0 has a dense MLP, its down
    projection's (MoE layers have none)."""
    if config.tie_word_embeddings:
        yield ours.embedding.weight.grad[: config.vocab_size], hf.get_input_embeddings().weight.grad
    else:
        yield ours.output.weight.grad[: config.vocab_size], hf.lm_head.weight.grad
    down = getattr(getattr(ours.layers["0"], "mlp", None), "down", None)
    if down is not None:
        yield down.weight.grad, hf.model.layers[0].mlp.down_proj.weight.grad


@pytest.mark.parametrize("case", ["llama", "mistral", "mamba2", "nemotron_h"])
def test_cuda_packed_documents_equal_hf_per_document(case):
    config = CONFIGS[case]
    hf, ours = _pair(config)
    cu = torch.tensor([0, 20, 64, 100, 128], dtype=torch.int32, device="cuda")
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    flat = ids.flatten()
    with torch.no_grad():
        ref = torch.cat([hf(flat[a:b][None]).logits[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        got = ours(ids, cu_seqlens=cu)[..., : config.vocab_size].flatten(0, 1)
    assert (got - ref).abs().max() <= 1e-4
    loss = ours(ids, labels=ids, cu_seqlens=cu)
    loss.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.parametrize("case", list(CONFIGS))
def test_cuda_greedy_generate_equals_hf(case):
    config = CONFIGS[case]
    hf, ours = _pair(config)
    prompt = torch.randint(0, config.vocab_size, (2, 6), device="cuda")
    assert torch.equal(generate(ours, prompt, 20), hf.generate(prompt, max_new_tokens=20, do_sample=False))


def test_cuda_bf16_tracks_fp32():
    config = CONFIGS["qwen3"]
    _, fp32 = _pair(config)
    _, bf16 = _pair(config, torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (4, 128), device="cuda")
    with torch.no_grad():
        a, b = fp32(ids, labels=ids), bf16(ids, labels=ids)
    assert b.dtype == torch.float32
    assert (a - b).abs().mean() < 0.02
