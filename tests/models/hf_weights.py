"""Test helpers: tiny Hugging Face models from our configs, and their weights under our parameter names.

Our fused QKV weight holds, for each KV head g, the rows ``[q heads of group g; k_g; v_g]``; the fused MLP
weight is ``[gate; up]``. The bridge owns the real mapping; this copy exists so that the model's parity
tests do not depend on a layer above them.
"""

from __future__ import annotations

import torch

from mcore.models.config import TransformerConfig
from tests.helpers.families import hf_classes, hf_config
from tests.helpers.hf_adapters import adapter


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


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    groups, d = config.num_key_value_heads, config.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, config.query_heads_per_kv_head * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def hf_to_mcore_state(hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) an HF Llama-family state dict into our global parameter names (unpadded vocab)."""
    special = adapter(config.model_type)
    if special is not None:
        return special.to_mcore_state(hf_state, config)
    return llama_shaped_to_mcore_state(hf_state, config)


def llama_shaped_to_mcore_state(
    hf_state: dict[str, torch.Tensor], config: TransformerConfig
) -> dict[str, torch.Tensor]:
    """The renaming of a Llama-shaped family (shared with the adapters that extend it)."""
    out: dict[str, torch.Tensor] = {"embedding.weight": hf_state["model.embed_tokens.weight"]}
    out["final_norm.weight"] = hf_state["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["output.weight"] = hf_state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        out[ours + "input_norm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[ours + "mlp_norm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in hf_state:
                out[ours + f"attention.qkv.{kind}"] = _fuse_qkv(
                    hf_state[attn + f"q_proj.{kind}"],
                    hf_state[attn + f"k_proj.{kind}"],
                    hf_state[attn + f"v_proj.{kind}"],
                    config,
                )
            if attn + f"o_proj.{kind}" in hf_state:
                out[ours + f"attention.out_proj.{kind}"] = hf_state[attn + f"o_proj.{kind}"]
            mlp = hf + "mlp."
            if mlp + f"gate_proj.{kind}" in hf_state:
                out[ours + f"mlp.gate_up.{kind}"] = torch.cat(
                    [hf_state[mlp + f"gate_proj.{kind}"], hf_state[mlp + f"up_proj.{kind}"]], dim=0
                )
                out[ours + f"mlp.down.{kind}"] = hf_state[mlp + f"down_proj.{kind}"]
        _moe_to_mcore(hf_state, hf + "mlp.", ours + "mlp.", out)
        for norm in ("q_norm", "k_norm"):
            if attn + f"{norm}.weight" in hf_state:
                out[ours + f"attention.{norm}.weight"] = hf_state[attn + f"{norm}.weight"]
    return out


def _moe_to_mcore(hf_state: dict[str, torch.Tensor], hf: str, ours: str, out: dict[str, torch.Tensor]) -> None:
    """transformers 5 holds the experts merged in memory (``experts.gate_up_proj`` [E, 2F, H] = our layout)."""
    if hf + "gate.weight" not in hf_state:
        return
    out[ours + "router.weight"] = hf_state[hf + "gate.weight"]
    out[ours + "experts.gate_up"] = hf_state[hf + "experts.gate_up_proj"]
    out[ours + "experts.down"] = hf_state[hf + "experts.down_proj"]
    shared = hf + "shared_expert."
    if shared + "gate_proj.weight" in hf_state:
        gate_up = [hf_state[shared + "gate_proj.weight"], hf_state[shared + "up_proj.weight"]]
        out[ours + "shared_expert.gate_up.weight"] = torch.cat(gate_up, dim=0)
        out[ours + "shared_expert.down.weight"] = hf_state[shared + "down_proj.weight"]
    if hf + "shared_expert_gate.weight" in hf_state:
        out[ours + "shared_expert_gate.weight"] = hf_state[hf + "shared_expert_gate.weight"]


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
