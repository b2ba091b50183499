"""Non-gated MLP with squared ReLU (``"relu2"``, Nemotron-H): ``down(relu(up(x))^2)``, up column-parallel, down
row-parallel (TP splits the hidden width)."""

from __future__ import annotations

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.mlp import check_dense_mlp_tensor_parallel
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.parallel.init import normal_init
from mcore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class SquaredReluMLP(nn.Module):
    def __init__(self, config: TransformerConfig, layer_index: int = 0, context: PartContext | None = None) -> None:
        super().__init__()
        ctx = PartContext() if context is None else context
        check_dense_mlp_tensor_parallel(config, ctx.tp_size)
        h, ffn = config.hidden_size, config.intermediate_size
        init = normal_init(config.initializer_range)
        common = dict(tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel)
        common.update(params_dtype=ctx.params_dtype, device=ctx.device, init_method=init)
        self.up = ColumnParallelLinear(h, ffn, bias=config.mlp_bias, **common)
        self.down = RowParallelLinear(ffn, h, bias=config.mlp_bias, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)).square())


def relu2_mlp_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    h, f = config.hidden_size, config.intermediate_size
    return 2 * h * f + (f + h if config.mlp_bias else 0)


def relu2_mlp_matmul_weights(config: TransformerConfig, layer_index: int = 0) -> int:
    return 2 * config.hidden_size * config.intermediate_size


RELU2_MLP = PartSpec(
    name="relu2",
    attribute="mlp",
    build=SquaredReluMLP,
    parameters=relu2_mlp_parameters,
    matmul_weights=relu2_mlp_matmul_weights,
    check_tensor_parallel=check_dense_mlp_tensor_parallel,
)
