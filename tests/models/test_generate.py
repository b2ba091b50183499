"""generate(): greedy output equals Hugging Face generate(do_sample=False); top-p equals HF's warper."""

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from mcore.models.families import get_config
from mcore.models.generate import generate, top_p_filter
from mcore.models.gpt import GPTModel
from tests.helpers.families import families, tiny_config
from tests.models.hf_weights import hf_model, load_hf_weights

# Every registered family's tiny preset (mistral's window 8 < prompt + 20 new tokens: the cache must drop keys
# that leave the window), plus tied embeddings.
CONFIGS = {
    **{family: tiny_config(family) for family in families()},
    "llama-tied": get_config("llama-tiny", tie_word_embeddings=True),
    "nemotron_h-moe": get_config("nemotron_h-moe-tiny"),  # MoE layers between Mamba and attention
}


def _pair(config):
    hf = hf_model(config, seed=3)
    ours = GPTModel(config)
    ours.init_weights(0)
    load_hf_weights(ours, hf, config)
    return hf, ours


@pytest.mark.parametrize("case", list(CONFIGS))
def test_greedy_equals_hf_generate(case):
    config = CONFIGS[case]
    hf, ours = _pair(config)
    prompt = torch.randint(0, config.vocab_size, (2, 6))
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    got = generate(ours, prompt, 20)
    assert got.shape == (2, 26)
    assert torch.equal(got, expected)


def test_cached_decoding_equals_full_recomputation():
    """Each greedy token is the argmax of a fresh forward over the whole prefix (no cache)."""
    config = CONFIGS["mistral"]
    _, ours = _pair(config)
    out = generate(ours, torch.randint(0, config.vocab_size, (3, 4)), 12)
    with torch.no_grad():
        for t in range(4, out.shape[1]):
            logits = ours(out[:, :t])[:, -1]
            assert torch.equal(logits.argmax(-1), out[:, t])


def test_top_p_filter_equals_hf_warper():
    logits = torch.randn(16, 300) * 3
    for top_p in (0.05, 0.3, 0.9, 1.0):
        expected = TopPLogitsWarper(top_p)(None, logits.clone())
        got = top_p_filter(logits, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        kept = ~torch.isinf(got)
        assert torch.equal(got[kept], logits[kept])


def test_sampling_is_reproducible_and_tiny_top_p_is_greedy():
    config = CONFIGS["llama"]
    _, ours = _pair(config)
    prompt = torch.randint(0, config.vocab_size, (2, 5))
    a = generate(ours, prompt, 10, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(7))
    b = generate(ours, prompt, 10, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(7))
    c = generate(ours, prompt, 10, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    nucleus_of_one = generate(ours, prompt, 10, do_sample=True, top_p=1e-6, generator=torch.Generator())
    assert torch.equal(nucleus_of_one, generate(ours, prompt, 10))


def test_sampling_follows_the_filtered_distribution():
    """Empirical frequencies of one sampled step match the exact nucleus distribution."""
    config = get_config("llama-tiny", vocab_size=40, initializer_range=0.3)
    _, ours = _pair(config)
    prompt = torch.randint(0, config.vocab_size, (1, 4))
    with torch.no_grad():
        logits = ours(prompt)[0, -1, : config.vocab_size]
    expected = top_p_filter(logits / 0.7, 0.8).softmax(-1)
    n = 4000
    gen = torch.Generator().manual_seed(0)
    draws = generate(
        ours, prompt.expand(n, -1).contiguous(), 1, do_sample=True, temperature=0.7, top_p=0.8, generator=gen
    )[:, -1]
    freq = torch.bincount(draws, minlength=config.vocab_size).float() / n
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected).abs().max() < 0.04


def test_eos_pads_finished_rows_and_stops_early():
    config = CONFIGS["llama"]
    _, ours = _pair(config)
    prompt = torch.randint(0, config.vocab_size, (2, 5))
    free = generate(ours, prompt, 8)
    eos = int(free[0, 7])  # row 0 emits it at its third new token
    out = generate(ours, prompt, 8, eos_token_id=eos)
    first_eos = {r: next((t for t in range(5, out.shape[1]) if out[r, t] == eos), None) for r in range(2)}
    for r, t in first_eos.items():
        if t is not None:
            assert (out[r, t:] == eos).all()
            assert torch.equal(out[r, :t], free[r, :t])
    if all(t is not None for t in first_eos.values()):
        assert out.shape[1] == max(first_eos.values()) + 1
    else:
        assert out.shape[1] == free.shape[1]


def test_bad_arguments_raise():
    config = CONFIGS["llama"]
    _, ours = _pair(config)
    prompt = torch.randint(0, config.vocab_size, (1, 3))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        generate(ours, prompt, 0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(ours, prompt, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        generate(ours, prompt.float(), 2)
    stage = GPTModel(config, layer_range=(0, 1), post_process=False)
    with pytest.raises(ValueError, match="pipeline size 1"):
        generate(stage, prompt, 2)
