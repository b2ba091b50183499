"""Gated MLP: one fused ``[gate; up]`` column-parallel projection, a gated activation, a row-parallel down."""

from __future__ import annotations

import functools

import torch
from torch import nn

from mcore.kernels import geglu, swiglu
from mcore.models.config import TransformerConfig
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.parallel.init import normal_init
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _relu2_gated(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's ``relu2`` in a gated MLP (BitNet): ``relu(gate)^2 * up`` from ``cat([gate, up], -1)`` (torch ops)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.relu(gate).square() * up


# HF hidden_act -> the fused kernel computing act(gate) * up from cat([gate, up], -1).
_GATED = {"silu": swiglu, "gelu_pytorch_tanh": functools.partial(geglu, approximate="tanh"), "relu2": _relu2_gated}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul.

    The fused weight is the concatenation of two partition blocks ``(ffn, ffn)``; each TP rank keeps its
    slice of both, so its local output is ``[gate_local, up_local]`` and the activation needs no
    communication.
    """

    def __init__(self, config: TransformerConfig, layer_index: int = 0, context: PartContext | None = None) -> None:
        super().__init__()
        ctx = PartContext() if context is None else context
        check_dense_mlp_tensor_parallel(config, ctx.tp_size)
        h, ffn = config.hidden_size, config.intermediate_size
        init = normal_init(config.initializer_range)
        common = dict(
            tp_group=ctx.tp_group,
            sequence_parallel=ctx.sequence_parallel,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        self.gate_up = ColumnParallelLinear(
            h, 2 * ffn, bias=config.mlp_bias, partition_blocks=(ffn, ffn), init_method=init, **common
        )
        self.down = RowParallelLinear(ffn, h, bias=config.mlp_bias, input_is_parallel=True, init_method=init, **common)
        self.activation = _GATED[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.gate_up(x)))


def check_dense_mlp_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """TP splits the hidden width of the MLP: ``tp`` must divide ``intermediate_size``."""
    if config.intermediate_size % tp != 0:
        raise ValueError(f"tensor parallel size {tp} must divide intermediate_size ({config.intermediate_size})")


def dense_mlp_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    """Parameters of one gated MLP (fused [gate; up] and down projections, optional biases)."""
    h, f = config.hidden_size, config.intermediate_size
    return 3 * h * f + (2 * f + h if config.mlp_bias else 0)


def dense_mlp_matmul_weights(config: TransformerConfig, layer_index: int = 0) -> int:
    return 3 * config.hidden_size * config.intermediate_size


DENSE_MLP = PartSpec(
    name="dense",
    attribute="mlp",
    build=GatedMLP,
    parameters=dense_mlp_parameters,
    matmul_weights=dense_mlp_matmul_weights,
    check_tensor_parallel=check_dense_mlp_tensor_parallel,
)
