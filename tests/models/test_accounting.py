"""Parameter counts against Hugging Face models (built on the meta device) and FLOPs against a count of the
HF model's own matmul weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore.models.accounting import (
    H100_BF16_PEAK_FLOPS,
    layer_flops_per_token,
    matmul_weight_count,
    mfu,
    model_flops_per_token,
    output_layer_flops_per_token,
    parameter_counts,
)
from mcore.models.families import family_of, get_config, preset_names
from tests.helpers.families import hf_classes, hf_config_kwargs


def _hf_meta_model(name: str):
    c = get_config(name)
    config_cls, _ = hf_classes(family_of(name))
    hf = config_cls(**hf_config_kwargs(c))
    with torch.device("meta"):
        return c, AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize("name", preset_names())
def test_parameter_count_equals_hf(name):
    config, model = _hf_meta_model(name)
    counts = parameter_counts(config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.embedding == model.model.embed_tokens.weight.numel()
    mlp = sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    attn = sum(p.numel() for n, p in model.named_parameters() if ".self_attn." in n)
    assert (counts.mlps, counts.mixers) == (mlp, attn)
    assert counts.output == (0 if config.tie_word_embeddings else model.lm_head.weight.numel())


def test_published_totals():
    # Sizes quoted by the model cards (exact counts of the released checkpoints).
    assert parameter_counts(get_config("llama2-7b")).total == 6_738_415_616
    assert parameter_counts(get_config("llama3-8b")).total == 8_030_261_248
    assert parameter_counts(get_config("qwen2.5-7b")).total == 7_615_616_512


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-0.5b", "qwen3-8b", "mistral-nemo-12b"])
def test_matmul_weights_are_the_hf_linear_weights(name):
    config, model = _hf_meta_model(name)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_weight_count(config) == linear


def test_flops_per_token_formula():
    config, model = _hf_meta_model("qwen3-8b")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    seq = 4096
    expected = 6 * linear + 12 * 36 * (32 * 128) * seq
    assert model_flops_per_token(config, seq) == expected
    # the per-layer and output-layer parts (used to balance pipeline stages) from HF's own modules
    layer0 = sum(m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    assert layer_flops_per_token(config, seq) == 6 * layer0 + 12 * (32 * 128) * seq
    assert output_layer_flops_per_token(config) == 6 * model.lm_head.weight.numel()
    for fn in (model_flops_per_token, layer_flops_per_token):
        with pytest.raises(ValueError, match="seq_len must be a positive int"):
            fn(config, 0)


def test_mfu():
    flops = model_flops_per_token(get_config("llama3-8b"), 8192)
    tokens = 0.4 * 8 * H100_BF16_PEAK_FLOPS / flops
    assert mfu(tokens, flops, num_gpus=8) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="num_gpus must be >= 1"):
        mfu(1.0, 1.0, num_gpus=0)
