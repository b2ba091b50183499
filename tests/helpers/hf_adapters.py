"""How the per-family tests speak to a family whose Hugging Face model is not Llama-shaped (Mamba-2 and the hybrid
families): the HF config keyword arguments of one of our configs, the renaming of HF tensors into our parameter
names, and which HF parameters belong to the token mixers and to the MLPs. Llama-shaped families need none (the
defaults in ``tests/helpers/families.py`` and ``tests/models/hf_weights.py`` serve them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore.models.config import TransformerConfig
from tests.helpers.gpt_oss_adapter import gpt_oss_config_kwargs, gpt_oss_to_mcore_state
from tests.helpers.hf_renames import LayerTable, ModelNames, count_parts, to_mcore_state


@dataclass(frozen=True)
class HfAdapter:
    config_kwargs: Callable[[TransformerConfig], dict[str, Any]]
    to_mcore_state: Callable[[dict[str, torch.Tensor], TransformerConfig], dict[str, torch.Tensor]]
    # (mixer parameters, MLP parameters) of an HF model of the config
    part_parameters: Callable[[torch.nn.Module, TransformerConfig], tuple[int, int]]
    # the config field HF's ``head_dim`` means, and the HF key of our ``hidden_act``
    head_dim_field: str = "head_dim"
    hf_hidden_act_key: str = "hidden_act"


# Every family without an adapter is Llama-shaped (dense or MoE; transformers 5 holds the experts merged in memory,
# ``experts.gate_up_proj`` [E, 2F, H] and ``experts.down_proj`` [E, H, F]: our layout).
LLAMA_LAYER = LayerTable(
    renames=(
        ("input_layernorm.", "input_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
        ("self_attn.o_proj.", "attention.out_proj."),
        ("self_attn.q_norm.", "attention.q_norm."),
        ("self_attn.k_norm.", "attention.k_norm."),
        ("mlp.down_proj.", "mlp.down."),
        ("mlp.gate.weight", "mlp.router.weight"),
        ("mlp.experts.gate_up_proj", "mlp.experts.gate_up"),
        ("mlp.experts.down_proj", "mlp.experts.down"),
        ("mlp.shared_expert.down_proj.", "mlp.shared_expert.down."),
        ("mlp.shared_expert_gate.", "mlp.shared_expert_gate."),
    ),
    qkv=(("self_attn.", "attention."),),
    gate_up=(("mlp.", "mlp."), ("mlp.shared_expert.", "mlp.shared_expert.")),
)


def llama_shaped_to_mcore_state(hf_state, config):
    """The renaming of a Llama-shaped family (every family without an adapter)."""
    return to_mcore_state(hf_state, config, LLAMA_LAYER)


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


# Mamba-2 and Nemotron-H layers are ``norm`` + ``mixer``; which of our modules they are depends on the layer.
_MAMBA_LAYER = LayerTable(renames=(("norm.", "input_norm."), ("mixer.", "mamba.")))


def mamba2_to_mcore_state(hf_state, config):
    return to_mcore_state(hf_state, config, _MAMBA_LAYER, ModelNames("backbone", "embeddings", "norm_f"))


def nemotron_h_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    from mcore.models.families.nemotron_h import SYMBOL_HF_BLOCK, parts_pattern

    pattern = parts_pattern(config.layer_types, config.mlp_layer_types)
    return dict(
        _mamba_kwargs(config),
        layers_block_type=[SYMBOL_HF_BLOCK[c] for c in pattern],
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        mamba_num_heads=config.mamba_num_heads,
        mamba_head_dim=config.mamba_head_dim,
        ssm_state_size=config.ssm_state_size,
        mamba_proj_bias=config.mamba_proj_bias,
        mlp_bias=config.mlp_bias,
        attention_bias=config.attention_bias,
        mlp_hidden_act="relu2",
        residual_in_fp32=False,
        **(_nemotron_h_moe_kwargs(config) if config.num_experts is not None else {}),
    )


def _routed_moe_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """The MoE fields that NemotronHConfig and the DeepSeek configs name alike (the router's knobs are ours)."""
    router = dict(config.moe_router or {})
    return dict(
        n_routed_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        n_group=router.get("n_group", 1),
        topk_group=router.get("topk_group", 1),
        routed_scaling_factor=router.get("routed_scaling_factor", 1.0),
    )


def _nemotron_h_moe_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """NemotronHConfig's MoE fields (its experts' width is moe_intermediate_size)."""
    return dict(_routed_moe_kwargs(config), moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size)


_NEMOTRON_LAYERS = {
    "mamba2": _MAMBA_LAYER,
    "nope_attention": LayerTable(
        renames=(("norm.", "input_norm."), ("mixer.", "attention."), ("mixer.o_proj.", "attention.out_proj.")),
        qkv=(("mixer.", "attention."),),
    ),
}
_NEMOTRON_MLP_LAYER = LayerTable(
    renames=(
        ("norm.", "mlp_norm."),
        ("mixer.", "mlp."),
        ("mixer.up_proj.", "mlp.up."),
        ("mixer.down_proj.", "mlp.down."),
        ("mixer.gate.weight", "mlp.router.weight"),
        ("mixer.gate.e_score_correction_bias", "mlp.expert_bias"),  # a persistent buffer on both sides
        ("mixer.experts.up_proj", "mlp.experts.up"),  # transformers 5 holds them merged in memory: [E, F, H], [E, H, F]
        ("mixer.experts.down_proj", "mlp.experts.down"),
        ("mixer.shared_experts.up_proj.", "mlp.shared_expert.up."),
        ("mixer.shared_experts.down_proj.", "mlp.shared_expert.down."),
    )
)


def nemotron_h_to_mcore_state(hf_state, config):
    def table(i: int) -> LayerTable:
        return _NEMOTRON_LAYERS.get(config.mixer_type(i), _NEMOTRON_MLP_LAYER)

    return to_mcore_state(hf_state, config, table, ModelNames(embedding="embeddings", final_norm="norm_f"))


def _nemotron_h_parts(model: torch.nn.Module, config: TransformerConfig) -> tuple[int, int]:
    mixers = mlps = 0
    for name, p in model.named_parameters():
        if ".mixer." not in name:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        if config.mlp_type(layer) == "none":
            mixers += p.numel()
        else:
            mlps += p.numel()
    return mixers, mlps


def falcon_h1_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    c = config
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        initializer_range=c.initializer_range,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        mamba_d_ssm=c.mamba_d_inner,
        mamba_n_heads=c.mamba_num_heads,
        mamba_d_head=c.mamba_head_dim,
        mamba_n_groups=c.n_groups,
        mamba_d_state=c.ssm_state_size,
        mamba_d_conv=c.conv_kernel,
        mamba_chunk_size=c.chunk_size,
        mamba_conv_bias=c.use_conv_bias,
        mamba_proj_bias=c.mamba_proj_bias,
        projectors_bias=c.projectors_bias,
        mamba_rms_norm=c.mamba_rms_norm,
        mamba_norm_before_gate=c.mamba_norm_before_gate,
        time_step_limit=list(c.time_step_limit),
        embedding_multiplier=c.embedding_multiplier,
        lm_head_multiplier=c.lm_head_multiplier,
        key_multiplier=c.key_multiplier,
        attention_in_multiplier=c.attention_in_multiplier,
        attention_out_multiplier=c.attention_out_multiplier,
        ssm_in_multiplier=c.ssm_in_multiplier,
        ssm_out_multiplier=c.ssm_out_multiplier,
        ssm_multipliers=list(c.ssm_multipliers),
        mlp_multipliers=list(c.mlp_multipliers),
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


_FALCON_LAYER = LayerTable(
    renames=(
        ("input_layernorm.", "input_norm."),
        ("pre_ff_layernorm.", "mlp_norm."),
        ("mamba.", "parallel.mamba."),
        ("self_attn.o_proj.", "parallel.attention.out_proj."),
        ("feed_forward.down_proj.", "mlp.down."),
    ),
    qkv=(("self_attn.", "parallel.attention."),),
    gate_up=(("feed_forward.", "mlp."),),
)


def falcon_h1_to_mcore_state(hf_state, config):
    return to_mcore_state(hf_state, config, _FALCON_LAYER, ModelNames(final_norm="final_layernorm"))


def bitnet_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """Llama's keyword arguments without our per-layer part names (HF BitNet has no layer list)."""
    from tests.helpers.families import llama_shaped_config_kwargs

    kwargs = llama_shaped_config_kwargs(config)
    kwargs.pop("layer_types", None)
    return kwargs


# BitNet is Llama with two sub-norms, which ours keep inside out_proj and down.
_BITNET_LAYER = dataclasses.replace(
    LLAMA_LAYER,
    renames=LLAMA_LAYER.renames
    + (("self_attn.attn_sub_norm.", "attention.out_proj.sub_norm."), ("mlp.ffn_sub_norm.", "mlp.down.sub_norm.")),
)


def bitnet_to_mcore_state(hf_state, config):
    return to_mcore_state(hf_state, config, _BITNET_LAYER)


_ATTENTION_AND_MLP = count_parts(mixer=(".self_attn.",), mlp=(".mlp.",))


ADAPTERS: dict[str, HfAdapter] = {
    "bitnet": HfAdapter(bitnet_config_kwargs, bitnet_to_mcore_state, _ATTENTION_AND_MLP),
    "falcon_h1": HfAdapter(
        falcon_h1_config_kwargs,
        falcon_h1_to_mcore_state,
        count_parts(mixer=(".mamba.", ".self_attn."), mlp=(".feed_forward.",)),
    ),
    "nemotron_h": HfAdapter(
        nemotron_h_config_kwargs, nemotron_h_to_mcore_state, _nemotron_h_parts, hf_hidden_act_key="mamba_hidden_act"
    ),
    "mamba2": HfAdapter(
        mamba2_config_kwargs,
        mamba2_to_mcore_state,
        count_parts(mixer=(".mixer.",), mlp=()),
        head_dim_field="mamba_head_dim",
    ),
    "gpt_oss": HfAdapter(gpt_oss_config_kwargs, gpt_oss_to_mcore_state, _ATTENTION_AND_MLP),
}


def adapter(family: str) -> HfAdapter | None:
    return ADAPTERS.get(family)


def deepseek_config_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """HF ``DeepseekV3Config`` / ``DeepseekV2Config`` of one of our DeepSeek configs."""
    c = config
    router = dict(c.moe_router or {})
    rope = {"rope_type": "default"} if c.rope_scaling is None else dict(c.rope_scaling)
    kwargs = dict(
        _routed_moe_kwargs(c),
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        n_shared_experts=(c.shared_expert_intermediate_size or 0) // c.moe_intermediate_size,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim,
        v_head_dim=c.v_head_dim,
        first_k_dense_replace=c.first_k_dense_replace,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=False,
        rope_parameters={**rope, "rope_theta": c.rope_theta},
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if c.model_type == "deepseek_v3":
        kwargs.update(rope_interleave=c.rope_interleave, num_mtp_layers=c.num_nextn_predict_layers)
    else:
        kwargs["topk_method"] = "group_limited_greedy" if router.get("n_group", 1) > 1 else "greedy"
    return kwargs


_DEEPSEEK_LAYER = LayerTable(
    renames=(
        ("input_layernorm.", "input_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
        ("self_attn.q_proj.", "attention.q_proj."),
        ("self_attn.q_a_proj.", "attention.q_down."),
        ("self_attn.q_a_layernorm.", "attention.q_norm."),
        ("self_attn.q_b_proj.", "attention.q_up."),
        ("self_attn.kv_a_proj_with_mqa.", "attention.kv_down."),
        ("self_attn.kv_a_layernorm.", "attention.kv_norm."),
        ("self_attn.kv_b_proj.", "attention.kv_up."),
        ("self_attn.o_proj.", "attention.out_proj."),
        ("mlp.down_proj.", "mlp.down."),
        ("mlp.gate.weight", "mlp.router.weight"),
        ("mlp.gate.e_score_correction_bias", "mlp.expert_bias"),
        ("mlp.experts.gate_up_proj", "mlp.experts.gate_up"),  # transformers 5 holds the experts merged, our layout
        ("mlp.experts.down_proj", "mlp.experts.down"),
        ("mlp.shared_experts.down_proj.", "mlp.shared_expert.down."),
    ),
    gate_up=(("mlp.", "mlp."), ("mlp.shared_experts.", "mlp.shared_expert.")),
)


def deepseek_to_mcore_state(hf_state, config):
    """HF DeepSeek tensors (V3 and V2) under our names."""
    return to_mcore_state(hf_state, config, _DEEPSEEK_LAYER)


for _family in ("deepseek_v3", "deepseek_v2"):
    ADAPTERS[_family] = HfAdapter(deepseek_config_kwargs, deepseek_to_mcore_state, _ATTENTION_AND_MLP)
