"""Falcon-H1's parts: attention and Mamba-2 side by side in one mixer, and a gated MLP with muP multipliers.

``falcon_h1_parallel`` (mixer): ``mamba(h) * ssm_out_multiplier + attention(h * attention_in_multiplier) *
attention_out_multiplier`` on the same normed input ``h`` (the layer adds the residual). Both halves are the
ordinary parts (``Mamba2Mixer`` with its ``ssm_in_multiplier`` / ``ssm_multipliers``, ``SelfAttention`` with its
``key_multiplier``), each with its own TP split and its own output reduction.
``falcon_h1_mlp`` (MLP): ``down(up(x) * silu(gate(x) * mlp_multipliers[0])) * mlp_multipliers[1]``.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.attention import (
    SelfAttention,
    attention_matmul_weights,
    attention_parameters,
    attention_sequence_flops,
    check_attention_tensor_parallel,
)
from mcore.models.layers.mamba2 import (
    Mamba2Mixer,
    check_mamba2_tensor_parallel,
    mamba2_matmul_weights,
    mamba2_parameters,
    mamba2_sequence_flops,
)
from mcore.models.layers.mlp import (
    GatedMLP,
    check_dense_mlp_tensor_parallel,
    dense_mlp_matmul_weights,
    dense_mlp_parameters,
)
from mcore.models.parts.registry import PartContext, PartSpec


class ParallelHybridMixer(nn.Module):
    def __init__(self, config: TransformerConfig, layer_index: int, context: PartContext | None = None) -> None:
        super().__init__()
        self.mamba = Mamba2Mixer(config, layer_index, context)
        self.attention = SelfAttention(config, layer_index, context)
        self.attention_in = config.attention_in_multiplier
        self.attention_out = config.attention_out_multiplier
        self.ssm_out = config.ssm_out_multiplier

    def forward(self, x: torch.Tensor, rope, *, cu_seqlens=None, kv_cache=None, context_parallel=None) -> torch.Tensor:
        cp = {} if context_parallel is None else {"context_parallel": context_parallel}
        m = self.mamba(x, rope, cu_seqlens=cu_seqlens, kv_cache=kv_cache, **cp)
        # no copy at a multiplier of 1: the attention's projections then keep the norm output itself, which
        # recompute_modules' layernorm can drop
        h = x if self.attention_in == 1.0 else x * self.attention_in
        a = self.attention(h, rope, cu_seqlens=cu_seqlens, kv_cache=kv_cache, **cp)
        return m * self.ssm_out + a * self.attention_out


class MupGatedMLP(GatedMLP):
    def __init__(self, config: TransformerConfig, layer_index: int = 0, context: PartContext | None = None) -> None:
        super().__init__(config, layer_index, context)
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.gate_multiplier != 1.0:
            gate, up = gate_up.chunk(2, dim=-1)
            gate_up = torch.cat([gate * self.gate_multiplier, up], dim=-1)
        return self.down(self.activation(gate_up)) * self.down_multiplier


def _both_tp(config: TransformerConfig, tp: int) -> None:
    check_mamba2_tensor_parallel(config, tp)
    check_attention_tensor_parallel(config, tp)


FALCON_H1_PARALLEL = PartSpec(
    name="falcon_h1_parallel",
    attribute="parallel",
    build=ParallelHybridMixer,
    parameters=lambda c, i: mamba2_parameters(c, i) + attention_parameters(c, i),
    matmul_weights=lambda c, i: mamba2_matmul_weights(c, i) + attention_matmul_weights(c, i),
    check_tensor_parallel=_both_tp,
    sequence_flops=lambda c, i, s: mamba2_sequence_flops(c, i, s) + attention_sequence_flops(c, i, s),
)

FALCON_H1_MLP = PartSpec(
    name="falcon_h1_mlp",
    attribute="mlp",
    build=MupGatedMLP,
    parameters=dense_mlp_parameters,
    matmul_weights=dense_mlp_matmul_weights,
    check_tensor_parallel=check_dense_mlp_tensor_parallel,
)
