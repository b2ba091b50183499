"""BitNet b1.58's layers (HF ``BitNetForCausalLM``): Llama attention and a relu2-gated MLP, each with an RMSNorm over
the input of its output projection (``attn_sub_norm`` over the heads' outputs, ``ffn_sub_norm`` over the FFN
width). The norm sits inside the projection (:class:`SubNormRowParallelLinear`, parameter ``<proj>.sub_norm``):
under tensor parallelism its input is the rank's shard, and the norm's mean square is over every rank's features.

The fused projections mark which rows are which HF projection (``weight_row_segments``: q / k / v, gate / up), so
that ``quant: bitnet`` scales each like HF's separate ``AutoBitLinear`` layers do (one absmean per projection).
"""

from __future__ import annotations

import torch

from mcore.models.config import TransformerConfig
from mcore.models.layers.attention import SelfAttention, _part, attention_parameters
from mcore.models.layers.mlp import DENSE_MLP, GatedMLP, dense_mlp_parameters
from mcore.models.layers.projection_norm import ProjectionRMSNorm
from mcore.models.parts.registry import PartContext, PartSpec
from mcore.parallel.tensor_parallel import RowParallelLinear


class SubNormRowParallelLinear(RowParallelLinear):
    """A row-parallel linear that RMS-normalizes its (tp-sharded) input over the full ``in_features`` first."""

    def __init__(self, in_features: int, out_features: int, *, eps: float, **kwargs) -> None:
        super().__init__(in_features, out_features, **kwargs)
        norm_kwargs = dict(params_dtype=kwargs.get("params_dtype", torch.float32), device=kwargs.get("device"))
        self.sub_norm = ProjectionRMSNorm(in_features, eps, tp_group=kwargs.get("tp_group"), **norm_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.sub_norm(x))


def _sub_normed(proj: RowParallelLinear, eps: float, context: PartContext) -> SubNormRowParallelLinear:
    """``proj`` rebuilt with a sub-norm (same shape, bias, init and parallel layout)."""
    return SubNormRowParallelLinear(
        proj.in_features,
        proj.out_features,
        eps=eps,
        bias=proj.bias is not None,
        input_is_parallel=True,
        init_method=proj.init_method,
        tp_group=context.tp_group,
        sequence_parallel=context.sequence_parallel,
        params_dtype=context.params_dtype,
        device=context.device,
    )


def _segments(sizes: list[int], repeats: int, device) -> torch.Tensor:
    """Row ids ``[0] * sizes[0] + [1] * sizes[1] + ...``, the whole pattern ``repeats`` times (int64)."""
    one = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(sizes)])
    return one.repeat(repeats).to(device)


class BitNetAttention(SelfAttention):
    """Llama attention with ``attn_sub_norm`` before ``o_proj``."""

    def __init__(self, config: TransformerConfig, layer_index: int, context: PartContext | None = None) -> None:
        ctx = PartContext() if context is None else context
        super().__init__(config, layer_index, ctx)
        self.out_proj = _sub_normed(self.out_proj, config.rms_norm_eps, ctx)
        # the local fused qkv holds whole query groups: [q heads of the group, k, v] per group
        sizes = [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim]
        segments = _segments(sizes, self.local_groups, self.qkv.weight.device)
        self.qkv.register_buffer("weight_row_segments", segments, persistent=False)  # moves with the module


class BitNetMLP(GatedMLP):
    """``down(ffn_sub_norm(act(gate(x)) * up(x)))``, gate and up fused (BitNet's act: ``relu2``)."""

    def __init__(self, config: TransformerConfig, layer_index: int = 0, context: PartContext | None = None) -> None:
        ctx = PartContext() if context is None else context
        super().__init__(config, layer_index, ctx)
        self.down = _sub_normed(self.down, config.rms_norm_eps, ctx)
        local_ffn = config.intermediate_size // ctx.tp_size
        segments = _segments([local_ffn, local_ffn], 1, self.gate_up.weight.device)
        self.gate_up.register_buffer("weight_row_segments", segments, persistent=False)


def bitnet_attention_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    return attention_parameters(config, layer_index) + config.q_size


def bitnet_mlp_parameters(config: TransformerConfig, layer_index: int = 0) -> int:
    return dense_mlp_parameters(config, layer_index) + config.intermediate_size


_ATTENTION = _part("bitnet_attention", BitNetAttention)
BITNET_ATTENTION = PartSpec(**{**_ATTENTION.__dict__, "parameters": bitnet_attention_parameters})
BITNET_MLP = PartSpec(
    **{**DENSE_MLP.__dict__, "name": "bitnet_mlp", "build": BitNetMLP, "parameters": bitnet_mlp_parameters}
)
