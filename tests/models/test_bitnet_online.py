"""The BitNet family under ``quant: bitnet`` equals Hugging Face's ``BitNetForCausalLM`` in its online mode (every
linear but ``lm_head`` an ``AutoBitLinear(online_quant=True)``): logits, loss and gradients, given the same weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.kernels.low_precision_linear import Recipe
from mcore.models.gpt import GPTModel
from mcore.parallel.low_precision import enable_low_precision
from tests.helpers.families import tiny_config
from tests.models.hf_weights import hf_model, hf_to_mcore_state, load_hf_weights, mcore_grads_as_hf


def _online(hf: torch.nn.Module) -> torch.nn.Module:
    """``hf`` with its linears swapped for online AutoBitLinear layers sharing the same weights (HF's QAT mode)."""
    from transformers.integrations.bitnet import AutoBitLinear

    for name, module in list(hf.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            quantized = AutoBitLinear(module.in_features, module.out_features, bias=module.bias is not None)
            quantized.online_quant = True
            quantized.weight = module.weight
            hf.set_submodule(name, quantized)
    return hf


@pytest.fixture
def no_compile():
    # HF's quantizers are torch.compile'd. Not monkeypatch: pytest >= 9.2 undoes a patched config entry with
    # delattr, which hides it from torch for the rest of the session (every later torch.compile then fails).
    with torch._dynamo.config.patch(disable=True):
        yield


def test_quant_bitnet_equals_hf_online_bitlinear(no_compile):
    config = tiny_config("bitnet")
    hf = hf_model(config, 0)
    ours = GPTModel(config)
    ours.init_weights(1)
    load_hf_weights(ours, hf, config)
    plain = ours(torch.zeros(1, 4, dtype=torch.long)).detach()
    decisions = enable_low_precision(ours, Recipe("bitnet"), keep=("output",))
    assert sum(d.recipe == "bitnet" for d in decisions) == 4 * config.num_hidden_layers
    hf = _online(hf)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    ref_logits, logits = hf(ids).logits, ours(ids)[..., : config.vocab_size]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours(torch.zeros(1, 4, dtype=torch.long)), plain)  # the quantizers are on
    labels = torch.randint(0, config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(4))
    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    expected = hf_to_mcore_state({k: p.grad for k, p in hf.named_parameters()}, config)
    for name, grad in mcore_grads_as_hf(ours, config).items():
        atol = 1e-5 * max(1.0, expected[name].abs().max().item())
        torch.testing.assert_close(grad, expected[name], rtol=1e-3, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
