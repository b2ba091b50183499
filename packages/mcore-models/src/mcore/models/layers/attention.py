"""Causal self-attention with grouped-query heads, RoPE, optional q/k norms and sliding windows.

The fused QKV weight holds, for each KV head g, the rows ``[q heads of group g; k_g; v_g]``. A TP rank's
contiguous row slice is therefore a set of whole query groups, and its projection output views as
``[s, b, groups, heads_per_group + 2, head_dim]`` without any copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcore.kernels import apply_rotary, attention
from mcore.models.config import TransformerConfig
from mcore.models.layers.attention_sinks import AttentionSinks
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.norm import build_norm
from mcore.models.layers.projection_norm import ProjectionRMSNorm
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.models.rope import RopeTables
from mcore.parallel.init import normal_init
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:  # the CP context lives in mcore.parallel; the model only calls it
    from mcore.parallel.cp_attention import CPContext


class SelfAttention(nn.Module):
    """One attention block: ``out_proj(attention(rope(norm?(q)), rope(norm?(k)), v))``.

    Input and output ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism). ``recompute_core``
    discards the attention core's activations in forward and recomputes them in backward (selective
    recompute). ``layer_index`` is the global index; it picks the layer's sliding window.
    """

    def __init__(
        self, config: TransformerConfig, layer_index: int, context: PartContext | None = None, *, rotary: bool = True
    ) -> None:
        super().__init__()
        ctx = PartContext() if context is None else context
        self.rotary = rotary  # False: no positional encoding at all (Nemotron-H's attention layers)
        self.key_multiplier = config.key_multiplier
        tp_size, params_dtype, device = ctx.tp_size, ctx.params_dtype, ctx.device
        check_attention_tensor_parallel(config, tp_size)
        self.layer_index = layer_index
        self.head_dim = config.head_dim
        self.heads_per_group = config.query_heads_per_kv_head
        self.local_groups = config.num_key_value_heads // tp_size
        self.window = config.window_for_layer(layer_index)
        self.recompute_core = ctx.recomputes("core_attn")
        init = normal_init(config.initializer_range)
        common = dict(
            tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel, params_dtype=params_dtype, device=device
        )
        self.qkv = ColumnParallelLinear(
            config.hidden_size,
            config.q_size + 2 * config.kv_size,
            bias=config.attention_bias,
            init_method=init,
            **common,
        )
        self.qk_norm_over_projection = config.qk_norm and config.qk_norm_scope == "projection"
        if self.qk_norm_over_projection:  # OLMoE: one norm over all q features, one over all k features
            norm_kwargs = dict(tp_group=ctx.tp_group, params_dtype=params_dtype, device=device)
            self.q_norm = ProjectionRMSNorm(config.q_size, config.rms_norm_eps, **norm_kwargs)
            self.k_norm = ProjectionRMSNorm(config.kv_size, config.rms_norm_eps, **norm_kwargs)
        elif config.qk_norm:
            # Each TP rank normalises only its own heads, so these weights get partial gradients under TP.
            norm_kwargs = dict(sequence_parallel=tp_size > 1, params_dtype=params_dtype, device=device)
            self.q_norm = build_norm(config, config.head_dim, **norm_kwargs)
            self.k_norm = build_norm(config, config.head_dim, **norm_kwargs)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = None  # GPT-OSS: per-head logits in the softmax denominator
        if config.attention_sinks:
            self.sinks = AttentionSinks(config, ctx.tp_group, tp_size, params_dtype, device)
        self.out_proj = RowParallelLinear(
            config.q_size,
            config.hidden_size,
            bias=config.attention_out_bias,
            input_is_parallel=True,
            init_method=init,
            **common,
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        *,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        context_parallel: CPContext | None = None,
    ) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]``; ``rope`` the cos/sin tables ``[s, b, 1, head_dim]`` of the tokens' positions.
        ``context_parallel`` (an ``mcore.parallel.cp_attention.CPContext``): this rank holds its CP shard of
        the sequence and the core attends over the whole sequence through the CP group."""
        cos, sin = rope.cos, rope.sin
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        g, d = self.local_groups, self.head_dim
        q, k, v = qkv.view(s, b, g, self.heads_per_group + 2, d).split([self.heads_per_group, 1, 1], dim=3)
        if self.qk_norm_over_projection:
            q = self.q_norm(q.reshape(s, b, -1)).view(q.shape)
            k = self.k_norm(k.reshape(s, b, -1)).view(k.shape)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.key_multiplier != 1.0:  # Falcon-H1's muP key multiplier
            k = k * self.key_multiplier
        # Rotating the 5-D views keeps the per-group layout; the rotated q/k come back contiguous, so the
        # head reshapes below are free.
        if self.rotary:
            q, k = apply_rotary(q, k, cos, sin)
        q = q.reshape(s, b, g * self.heads_per_group, d).transpose(0, 1)
        k = k.reshape(s, b, g, d).transpose(0, 1)
        v = v.reshape(s, b, g, d).transpose(0, 1)
        if kv_cache is not None:
            out = self._attend_with_cache(q, k, v, kv_cache, cu_seqlens)
        elif context_parallel is not None:
            if self.sinks is not None:
                raise ValueError("attention sinks (GPT-OSS) under context parallelism are not supported; set cp=1")
            core = lambda q, k, v: context_parallel.attention(q, k, v, window_size=self.window)  # noqa: E731
            recompute = self.recompute_core and torch.is_grad_enabled()
            out = checkpoint(core, q, k, v, use_reentrant=False) if recompute else core(q, k, v)
        elif self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, cu_seqlens, use_reentrant=False)
        else:
            out = self._core(q, k, v, cu_seqlens)
        # [b, s, heads, d] -> [s, b, heads * d]: the one copy of the block (free when b == 1).
        return self.out_proj(out.transpose(0, 1).reshape(s, b, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        sinks = None if self.sinks is None else self.sinks.logits()
        return attention(q, k, v, causal=True, window_size=self.window, cu_seqlens=cu_seqlens, sinks=sinks)

    def _attend_with_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        if cu_seqlens is not None:
            raise ValueError("KV-cached attention does not take cu_seqlens (one sequence per batch row)")
        offset, n = cache.length, q.shape[1]
        keys, values = cache.update(self.layer_index, k, v)
        if offset == 0:
            return self._core(q, keys, values, None)
        if n != 1:
            raise ValueError(
                f"KV-cached attention after a prefill takes one new token per step, got {n} (cache holds {offset})"
            )
        # The single new token sees every cached key (inside its window), so no causal mask is needed.
        if self.window is not None:
            start = max(0, offset + 1 - self.window)
            keys, values = keys[:, start:], values[:, start:]
        return attention(q, keys, values, causal=False, sinks=None if self.sinks is None else self.sinks.logits())


def check_attention_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """TP splits whole query groups (a KV head and its query heads): ``tp`` must divide the KV heads."""
    kv = config.num_key_value_heads
    if kv % tp != 0:
        raise ValueError(
            f"tensor parallel size {tp} must divide num_key_value_heads ({kv}) so that each rank holds whole "
            "query groups"
        )


def attention_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    """Parameters of one attention block (fused QKV, output projection, optional biases and q/k norms)."""
    h, d = config.hidden_size, config.head_dim
    qkv_out = config.q_size + 2 * config.kv_size
    n = h * qkv_out + config.q_size * h
    if config.attention_bias:
        n += qkv_out
    if config.attention_out_bias:
        n += h
    if config.attention_sinks:
        n += config.num_attention_heads
    if config.qk_norm and config.qk_norm_scope == "projection":
        n += config.q_size + config.kv_size
    elif config.qk_norm:
        n += 2 * d * (2 if config.normalization == "layernorm" else 1)
    return n


def attention_matmul_weights(config: TransformerConfig, layer_index: int = 0) -> int:
    """Weight elements each token multiplies: the fused QKV and the output projection."""
    return config.hidden_size * (config.q_size + 2 * config.kv_size) + config.q_size * config.hidden_size


def attention_sequence_flops(config: TransformerConfig, layer_index: int, seq_len: int) -> float:
    """QK^T and PV, forward and backward, over the whole sequence: 12 * q_size * seq per token (the PaLM /
    Megatron convention: causal masks and sliding windows are not discounted)."""
    return float(12 * config.q_size * seq_len)


def _part(name: str, build=SelfAttention) -> PartSpec:
    return PartSpec(
        name=name,
        attribute="attention",
        build=build,
        parameters=attention_parameters,
        matmul_weights=attention_matmul_weights,
        check_tensor_parallel=check_attention_tensor_parallel,
        sequence_flops=attention_sequence_flops,
    )


# Both names build the same module: the layer's window comes from config.window_for_layer.
FULL_ATTENTION = _part("full_attention")
SLIDING_ATTENTION = _part("sliding_attention")


def _attention_without_rope(config: TransformerConfig, layer_index: int, context: PartContext) -> SelfAttention:
    return SelfAttention(config, layer_index, context, rotary=False)


# Causal attention with no positional encoding (NoPE: Nemotron-H, whose Mamba layers carry the order).
NOPE_ATTENTION = _part("nope_attention", _attention_without_rope)
