"""One pre-norm decoder layer composed from registered parts: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``.

Which mixer and which MLP layer ``i`` uses comes from the config (``config.mixer_type(i)``,
``config.mlp_type(i)``); each part's module sits under the name its spec gives (``attention``, ``mlp``...), so
parameter names are those of the checkpoints whatever the part. The part ``"none"`` of either slot leaves that
sub-block out, norm and residual branch included (a Mamba-2 layer is ``x + mixer(norm(x))`` alone).

Selective recompute by module (``mcore.models.recompute``) is decided here for the norms (``layernorm``: their
outputs are rebuilt in backward) and for the MLP slot as a whole (``mlp`` for a dense MLP, ``moe`` for an MoE
layer); the parts decide for what is inside them (``core_attn``, ``mla_up_proj``, ``shared_experts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore.models.config import TransformerConfig
from mcore.models.layers.kv_cache import KVCache
from mcore.models.layers.norm import build_norm
from mcore.models.parts.registry import MIXERS, MLPS, NO_PART, PartContext, PartSpec
from mcore.models.recompute import checkpoint_region, discard_output
from mcore.models.rope import RopeTables
from mcore.parallel.expert_parallel import MoELayer

if TYPE_CHECKING:  # the CP context lives in mcore.parallel; the model only calls it
    from mcore.parallel.cp_attention import CPContext


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
        self.mixer_name = self.mlp_name = None
        if mixer.name != NO_PART:
            self.mixer_name = mixer.attribute
            self.input_norm = build_norm(config, config.hidden_size, **norm_kwargs)
            self.add_module(mixer.attribute, mixer.build(config, layer_index, ctx))
        if mlp.name != NO_PART:
            self.mlp_name = mlp.attribute
            self.mlp_norm = build_norm(config, config.hidden_size, **norm_kwargs)
            self.add_module(mlp.attribute, mlp.build(config, layer_index, ctx))
        self.recompute_norms = ctx.recomputes("layernorm")
        self.recompute_feed_forward = ctx.recomputes("moe" if isinstance(self.feed_forward, MoELayer) else "mlp")

    @property
    def mixer(self) -> nn.Module | None:
        return None if self.mixer_name is None else getattr(self, self.mixer_name)

    @property
    def feed_forward(self) -> nn.Module | None:
        return None if self.mlp_name is None else getattr(self, self.mlp_name)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        context_parallel: CPContext | None = None,
    ) -> torch.Tensor:
        if self.mixer_name is not None:
            # Only mixers that support context parallelism take the keyword (the others raise TypeError).
            cp = {} if context_parallel is None else {"context_parallel": context_parallel}
            mixer = self.mixer
            x = x + self._after_norm(
                self.input_norm, x, lambda h: mixer(h, rope, cu_seqlens=cu_seqlens, kv_cache=kv_cache, **cp)
            )
        if self.mlp_name is not None:
            x = x + self._after_norm(self.mlp_norm, x, self._run_feed_forward)
        return x

    def _after_norm(self, norm: nn.Module, x: torch.Tensor, block) -> torch.Tensor:
        return discard_output(norm, (x,), block) if self.recompute_norms else block(norm(x))

    def _run_feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.recompute_feed_forward:
            # the buffers are put back after the recompute: an MoE layer counts its tokens once per micro-batch
            return checkpoint_region(self.feed_forward, h, state=self.feed_forward)
        return self.feed_forward(h)


def layer_module_names(config: TransformerConfig, layer_index: int) -> tuple[str, ...]:
    """Names of the modules ``DecoderLayer(config, layer_index)`` holds (its parameters' second name component):
    what a converter needs to know which per-layer tensors layer ``layer_index`` has."""
    names: list[str] = []
    for registry, part_name, norm in (
        (MIXERS, config.mixer_type(layer_index), "input_norm"),
        (MLPS, config.mlp_type(layer_index), "mlp_norm"),
    ):
        if part_name != NO_PART:
            names += [norm, registry.get(part_name).attribute]
    return tuple(names)


def _build_nothing(config: TransformerConfig, layer_index: int, context: PartContext) -> nn.Module:
    raise RuntimeError("the 'none' part has no module: DecoderLayer leaves the sub-block out")


def _zero(config: TransformerConfig, layer_index: int) -> int:
    return 0


def _any_tp(config: TransformerConfig, tp: int) -> None:
    return None


def _no_part(attribute: str) -> PartSpec:
    return PartSpec(
        name=NO_PART,
        attribute=attribute,
        build=_build_nothing,
        parameters=_zero,
        matmul_weights=_zero,
        check_tensor_parallel=_any_tp,
    )


NO_MIXER = _no_part("no_mixer")
NO_MLP = _no_part("no_mlp")
