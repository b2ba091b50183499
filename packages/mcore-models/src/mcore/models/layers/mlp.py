"""Gated MLP: one fused ``[gate; up]`` column-parallel projection, a gated activation, a row-parallel down."""

from __future__ import annotations

import functools

import torch
from torch import nn

from mcore.kernels import geglu, swiglu
from mcore.models.config import TransformerConfig
from mcore.parallel.init import normal_init
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# HF hidden_act -> the fused kernel computing act(gate) * up from cat([gate, up], -1).
_GATED = {"silu": swiglu, "gelu_pytorch_tanh": functools.partial(geglu, approximate="tanh")}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul.

    The fused weight is the concatenation of two partition blocks ``(ffn, ffn)``; each TP rank keeps its
    slice of both, so its local output is ``[gate_local, up_local]`` and the activation needs no
    communication.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        tp_group=None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.intermediate_size
        init = normal_init(config.initializer_range)
        common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
        self.gate_up = ColumnParallelLinear(
            h, 2 * ffn, bias=config.mlp_bias, partition_blocks=(ffn, ffn), init_method=init, **common
        )
        self.down = RowParallelLinear(ffn, h, bias=config.mlp_bias, input_is_parallel=True, init_method=init, **common)
        self.activation = _GATED[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.gate_up(x)))
