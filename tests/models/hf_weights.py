"""Test helpers: tiny Hugging Face models from our configs, and their weights under our parameter names.

Our fused QKV weight holds, for each KV head g, the rows ``[q heads of group g; k_g; v_g]``; the fused MLP
weight is ``[gate; up]``. The bridge owns the real mapping; the tables in ``tests/helpers/hf_adapters.py`` (one
mechanism, ``tests/helpers/hf_renames.py``) exist so that the model's parity tests do not depend on a layer above
them.
"""

from __future__ import annotations

import torch

from mcore.models.config import TransformerConfig
from tests.helpers.families import hf_classes, hf_config
from tests.helpers.hf_adapters import adapter, llama_shaped_to_mcore_state


def hf_model(config: TransformerConfig, seed: int) -> torch.nn.Module:
    """A randomly initialised HF model of ``config`` (fp32, eval mode, no dropout).

    HF zero-initialises biases and sets norms to one; both are redrawn here so that a wrong mapping of
    either cannot hide behind a constant.
    """
    _, model_cls = hf_classes(config.model_type)
    torch.manual_seed(seed)
    model = model_cls(hf_config(config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        # DeepSeek-V3's aux-loss-free routing bias (zeros in HF): random, so that it changes which experts win.
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    # GPT-OSS's experts: transformers before ~5.2x hard-code alpha 1.702 and limit 7.0 in GptOssExperts instead of
    # reading config.swiglu_alpha / swiglu_limit (the GPU image's 5.17 does), so a test that sets a small limit to
    # make the clamps bite compared against limit 7.0 there. Set them on the modules: same reference either way.
    if getattr(config, "swiglu_limit", None) is not None:
        for module in model.modules():
            if hasattr(module, "limit") and hasattr(module, "alpha") and hasattr(module, "gate_up_proj"):
                module.limit, module.alpha = config.swiglu_limit, config.swiglu_alpha
    return model


def hf_to_mcore_state(hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) an HF Llama-family state dict into our global parameter names (unpadded vocab)."""
    special = adapter(config.model_type)
    if special is not None:
        return special.to_mcore_state(hf_state, config)
    return llama_shaped_to_mcore_state(hf_state, config)


def load_hf_weights(model: torch.nn.Module, hf: torch.nn.Module, config: TransformerConfig) -> None:
    """Copy an HF model's weights into a single-process mcore model (padding rows of the vocab are zeroed).

    Every parameter of ``model`` must be covered and every mapped tensor used, so a naming slip fails loudly.
    """
    state = hf_to_mcore_state({k: v.detach() for k, v in hf.state_dict().items()}, config)
    params = dict(model.named_parameters())
    # persistent buffers that HF holds as state too (the MoE expert bias)
    params.update({n: b for n, b in model.named_buffers() if n in state})
    missing = sorted(set(params) - set(state))
    unused = sorted(set(state) - set(params))
    if missing or unused:
        raise KeyError(f"weight mapping mismatch: missing {missing}, unused {unused}")
    with torch.no_grad():
        for name, p in params.items():
            src = state[name]
            if getattr(p, "vocab_padded_dim", None) is not None:
                p.zero_()
                p[: src.shape[0]].copy_(src)
            else:
                if p.shape != src.shape:
                    raise ValueError(f"{name}: ours {tuple(p.shape)} vs HF {tuple(src.shape)}")
                p.copy_(src)


def mcore_grads_as_hf(model: torch.nn.Module, config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Our parameter gradients, unpadded, keyed by our names (compare with ``hf_to_mcore_state`` of HF grads)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if getattr(p, "vocab_padded_dim", None) is not None:
            g = g[: config.vocab_size]
        out[name] = g
    return out
