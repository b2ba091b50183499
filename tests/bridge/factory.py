"""Tiny random Hugging Face checkpoints, built offline, for the bridge tests.

``save_tiny_hf`` writes what a hub download looks like: ``config.json``, safetensors weights (sharded on request),
``generation_config.json`` and a small ``tokenizers`` tokenizer with a chat template, so that tests can check that
every file survives a round trip verbatim. Norm weights and biases are redrawn at random (HF initialises them to
one and zero, which would hide a mapping that swaps or drops them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.helpers.families import families, hf_classes, hf_moe_kwargs, tiny_config
from tests.helpers.hf_adapters import adapter

# family -> (HF config class, HF model class), for every registered family.
HF_CLASSES = {family: hf_classes(family) for family in families()}
FAMILIES = tuple(HF_CLASSES)
VOCAB = 300  # not a multiple of 128: padding and unpadding are exercised

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_config_kwargs(family: str, **overrides: Any) -> dict[str, Any]:
    """Sizes of a two-layer GQA model; per family the feature that sets it apart (as its ``<family>-tiny`` preset
    has it: a decoupled head_dim, a sliding window, per-layer attention types) is switched on."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    tiny = tiny_config(family)
    special = adapter(family)
    if special is not None:  # not Llama-shaped: the tiny preset's own HF kwargs, the bridge tests' vocab and ids
        return {**special.config_kwargs(tiny), "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    if tiny.head_dim * tiny.num_attention_heads != tiny.hidden_size:
        kwargs["head_dim"] = tiny.head_dim  # qwen3: 4 heads x 24 != hidden 64
    if tiny.sliding_window is not None:
        kwargs["sliding_window"] = tiny.sliding_window  # mistral: 8, shorter than the test sequences
    if tiny.layer_types is not None:
        kwargs["layer_types"] = list(tiny.layer_types)
    if tiny.num_experts is not None:  # the preset's small experts, not transformers' default 60-128 of them
        kwargs.update(hf_moe_kwargs(tiny))
    kwargs.update(overrides)
    return kwargs


def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    config_cls, model_cls = HF_CLASSES[family]
    config = config_cls(**tiny_config_kwargs(family, **overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():  # DeepSeek-V3's routing bias (zeros in HF)
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    return model


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def save_tiny_hf(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Save a tiny random model of ``family`` to ``path`` like a hub checkpoint; returns ``path``."""
    model = tiny_hf_model(family, seed, **overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_tokenizer(path)
    return path


def legacy_config(path: Path, **extra: Any) -> None:
    """Rewrite ``config.json`` the way transformers 4 (and most hub checkpoints) spell it: ``rope_theta`` and
    ``rope_scaling`` at top level, ``torch_dtype`` instead of ``dtype``; ``extra`` keys are added."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    out = {}
    for key, value in config.items():
        if key == "dtype":
            out["torch_dtype"] = value
        else:
            out[key] = value
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    out.update(extra)
    (path / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, by name (through the safetensors library, independent of the bridge)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            assert name not in state, f"{name} stored twice"
            state[name] = tensor
    return state
