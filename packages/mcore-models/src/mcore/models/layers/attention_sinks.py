"""GPT-OSS's learned attention sinks: one logit per query head that joins the softmax denominator only.

``weight`` [Hq / tp] holds this tensor-parallel rank's heads (a rank holds whole query groups, so its heads are a
contiguous run of the global order, which is Hugging Face's ``self_attn.sinks`` order too). Stored in the
parameters' dtype like every other weight; :meth:`logits` hands the kernels fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.parallel.comm import group_rank
from mcore.parallel.init import partition_slice
from mcore.parallel.tensor_parallel import set_tensor_parallel_attributes


class AttentionSinks(nn.Module):
    """The sink logits of one attention block's local query heads; ``reset_parameters`` draws the full ``[Hq]``
    from ``normal(0, initializer_range)`` (Hugging Face's init) and keeps this rank's slice."""

    def __init__(
        self, config: TransformerConfig, tp_group=None, tp_size: int = 1, params_dtype=torch.float32, device=None
    ) -> None:
        super().__init__()
        self.num_heads, self.tp_size, self.tp_rank = config.num_attention_heads, tp_size, group_rank(tp_group)
        self.init_std = config.initializer_range
        local = config.num_attention_heads // tp_size
        self.weight = nn.Parameter(torch.empty(local, dtype=params_dtype, device=device))
        set_tensor_parallel_attributes(self.weight, tensor_parallel=tp_size > 1, partition_dim=0)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        full = torch.empty(self.num_heads).normal_(0.0, self.init_std, generator=generator)
        with torch.no_grad():
            self.weight.copy_(partition_slice(full, 0, self.tp_rank, self.tp_size))

    def logits(self) -> torch.Tensor:
        """The local heads' sink logits in fp32 (differentiable)."""
        return self.weight.float()
