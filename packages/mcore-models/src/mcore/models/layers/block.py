"""One pre-norm decoder layer composed from registered parts: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``.

Which mixer and which MLP layer ``i`` uses comes from the config (``config.mixer_type(i)``,
``config.mlp_type(i)``); each part's module sits under the name its spec gives (``attention``, ``mlp``...), so
parameter names are those of the checkpoints whatever the part.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.norm import build_norm
from mcore.models.parts.registry import MIXERS, MLPS, PartContext
from mcore.models.rope import RopeTables


class DecoderLayer(nn.Module):
    """Pre-norm residual block on ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism)."""

    def __init__(self, config: TransformerConfig, layer_index: int, context: PartContext | None = None) -> None:
        super().__init__()
        ctx = PartContext() if context is None else context
        mixer, mlp = MIXERS.get(config.mixer_type(layer_index)), MLPS.get(config.mlp_type(layer_index))
        if mixer.attribute in ("input_norm", "mlp_norm") or mixer.attribute == mlp.attribute:
            raise ValueError(
                f"layer {layer_index}: parts {mixer.name!r} and {mlp.name!r} need distinct module names, got "
                f"{mixer.attribute!r} and {mlp.attribute!r}"
            )
        norm_kwargs = dict(sequence_parallel=ctx.sequence_parallel, params_dtype=ctx.params_dtype, device=ctx.device)
        self.mixer_name, self.mlp_name = mixer.attribute, mlp.attribute
        self.input_norm = build_norm(config, config.hidden_size, **norm_kwargs)
        self.add_module(mixer.attribute, mixer.build(config, layer_index, ctx))
        self.mlp_norm = build_norm(config, config.hidden_size, **norm_kwargs)
        self.add_module(mlp.attribute, mlp.build(config, layer_index, ctx))

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    @property
    def feed_forward(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.mixer(self.input_norm(x), rope, cu_seqlens=cu_seqlens, kv_cache=kv_cache)
        return x + self.feed_forward(self.mlp_norm(x))
