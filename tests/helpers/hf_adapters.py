"""How the per-family tests speak to a family whose Hugging Face model is not Llama-shaped (Mamba-2 and the hybrid
families): the HF config keyword arguments of one of our configs, the renaming of HF tensors into our parameter
names, and which HF parameters belong to the token mixers and to the MLPs. Llama-shaped families need none (the
defaults in ``tests/helpers/families.py`` and ``tests/models/hf_weights.py`` serve them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore.models.config import TransformerConfig


@dataclass(frozen=True)
class HfAdapter:
    config_kwargs: Callable[[TransformerConfig], dict[str, Any]]
    to_mcore_state: Callable[[dict[str, torch.Tensor], TransformerConfig], dict[str, torch.Tensor]]
    # (mixer parameters, MLP parameters) of an HF model of the config
    part_parameters: Callable[[torch.nn.Module, TransformerConfig], tuple[int, int]]
    # the config field HF's ``head_dim`` means
    head_dim_field: str = "head_dim"


def _mamba_kwargs(config: TransformerConfig) -> dict[str, Any]:
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        n_groups=config.n_groups,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        use_conv_bias=config.use_conv_bias,
        layer_norm_epsilon=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        time_step_limit=list(config.time_step_limit),
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def mamba2_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    d_inner = config.mamba_d_inner
    expand = d_inner // config.hidden_size if d_inner % config.hidden_size == 0 else d_inner / config.hidden_size
    return dict(
        _mamba_kwargs(config),
        num_hidden_layers=config.num_hidden_layers,
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        state_size=config.ssm_state_size,
        expand=expand,
        use_bias=config.mamba_proj_bias,
        residual_in_fp32=True,
    )


def _one_block_per_layer_state(hf_state, config, prefix, mixer_names):
    """HF models whose layer ``i`` is ``norm`` + ``mixer`` (Mamba2, NemotronH): ``mixer_names(i)`` says which of our
    modules (``input_norm``/``mixer`` or ``mlp_norm``/``mlp``...) the HF layer's norm and mixer are."""
    out = {
        "embedding.weight": hf_state[f"{prefix}.embeddings.weight"],
        "final_norm.weight": hf_state[f"{prefix}.norm_f.weight"],
    }
    if not config.tie_word_embeddings:
        out["output.weight"] = hf_state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        norm, module = mixer_names(i)
        hf = f"{prefix}.layers.{i}."
        for name, tensor in hf_state.items():
            if name == hf + "norm.weight":
                out[f"layers.{i}.{norm}.weight"] = tensor
            elif name.startswith(hf + "mixer."):
                out[f"layers.{i}.{module}." + name[len(hf + "mixer.") :]] = tensor
    return out


def mamba2_to_mcore_state(hf_state, config):
    return _one_block_per_layer_state(hf_state, config, "backbone", lambda i: ("input_norm", "mamba"))


def _mixer_only(model: torch.nn.Module, config: TransformerConfig) -> tuple[int, int]:
    return sum(p.numel() for n, p in model.named_parameters() if ".mixer." in n), 0


ADAPTERS: dict[str, HfAdapter] = {
    "mamba2": HfAdapter(mamba2_config_kwargs, mamba2_to_mcore_state, _mixer_only, head_dim_field="mamba_head_dim"),
}


def adapter(family: str) -> HfAdapter | None:
    return ADAPTERS.get(family)
