"""One pre-norm decoder layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

from __future__ import annotations

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.attention import SelfAttention
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.mlp import GatedMLP
from mcore.models.layers.norm import build_norm


class TransformerLayer(nn.Module):
    """Pre-norm residual block on ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        *,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        recompute_attention_core: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        norm_kwargs = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
        self.input_norm = build_norm(config, config.hidden_size, **norm_kwargs)
        self.attention = SelfAttention(
            config,
            layer_index,
            tp_group=tp_group,
            tp_size=tp_size,
            sequence_parallel=sequence_parallel,
            recompute_core=recompute_attention_core,
            params_dtype=params_dtype,
            device=device,
        )
        self.mlp_norm = build_norm(config, config.hidden_size, **norm_kwargs)
        self.mlp = GatedMLP(
            config, tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), cos, sin, cu_seqlens=cu_seqlens, kv_cache=kv_cache)
        return x + self.mlp(self.mlp_norm(x))
