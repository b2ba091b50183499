"""Causal self-attention with grouped-query heads, RoPE, optional q/k norms and sliding windows.

The fused QKV weight holds, for each KV head g, the rows ``[q heads of group g; k_g; v_g]``. A TP rank's
contiguous row slice is therefore a set of whole query groups, and its projection output views as
``[s, b, groups, heads_per_group + 2, head_dim]`` without any copy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcore.kernels import apply_rotary, attention
from mcore.models.config import TransformerConfig
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.norm import build_norm
from mcore.parallel.init import normal_init
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class SelfAttention(nn.Module):
    """One attention block: ``out_proj(attention(rope(norm?(q)), rope(norm?(k)), v))``.

    Input and output ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism). ``recompute_core``
    discards the attention core's activations in forward and recomputes them in backward (selective
    recompute). ``layer_index`` is the global index; it picks the layer's sliding window.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        *,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        config.check_tensor_parallel(tp_size)
        self.layer_index = layer_index
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_query_groups
        self.local_groups = config.num_key_value_heads // tp_size
        self.window = config.window_for_layer(layer_index)
        self.recompute_core = recompute_core
        init = normal_init(config.initializer_range)
        common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
        self.qkv = ColumnParallelLinear(
            config.hidden_size,
            config.q_size + 2 * config.kv_size,
            bias=config.attention_bias,
            init_method=init,
            **common,
        )
        if config.qk_norm:
            # Each TP rank normalises only its own heads, so these weights get partial gradients under TP.
            norm_kwargs = dict(sequence_parallel=tp_size > 1, params_dtype=params_dtype, device=device)
            self.q_norm = build_norm(config, config.head_dim, **norm_kwargs)
            self.k_norm = build_norm(config, config.head_dim, **norm_kwargs)
        else:
            self.q_norm = self.k_norm = None
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
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]``; ``cos``/``sin`` ``[s, b, 1, head_dim]`` for the tokens' positions."""
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        g, d = self.local_groups, self.head_dim
        q, k, v = qkv.view(s, b, g, self.heads_per_group + 2, d).split([self.heads_per_group, 1, 1], dim=3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotating the 5-D views keeps the per-group layout; the rotated q/k come back contiguous, so the
        # head reshapes below are free.
        q, k = apply_rotary(q, k, cos, sin)
        q = q.reshape(s, b, g * self.heads_per_group, d).transpose(0, 1)
        k = k.reshape(s, b, g, d).transpose(0, 1)
        v = v.reshape(s, b, g, d).transpose(0, 1)
        if kv_cache is not None:
            out = self._attend_with_cache(q, k, v, kv_cache, cu_seqlens)
        elif self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, cu_seqlens, use_reentrant=False)
        else:
            out = self._core(q, k, v, cu_seqlens)
        # [b, s, heads, d] -> [s, b, heads * d]: the one copy of the block (free when b == 1).
        return self.out_proj(out.transpose(0, 1).reshape(s, b, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return attention(q, k, v, causal=True, window_size=self.window, cu_seqlens=cu_seqlens)

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
        return attention(q, keys, values, causal=False)
