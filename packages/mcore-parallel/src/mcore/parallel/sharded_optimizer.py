"""AdamW on the local shards of a fully sharded (FSDP2) model: ZeRO-3's optimizer.

The sharded fp32 parameters of ``FullyShardedDataParallel`` are the master weights: each rank updates its shard
of each parameter in place (the next forward all-gathers them in the compute dtype), with its shard of the
reduce-scattered fp32 gradient. Everything else is ``MixedPrecisionOptimizer``'s: the step (fused kernel on CUDA,
``torch.optim.AdamW`` elsewhere), the loss scaler, clipping by the global norm, now summed over the disjoint dp
shards as well; and the state dict, which holds per parameter name the whole TP-local tensors
(``"<name>/master"``, ``"/exp_avg"``, ``"/exp_avg_sq"``) gathered over dp, the same format as the replicated and
ZeRO-1 optimizers: a state saved by any of the three loads into any other, at any dp size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mcore.parallel.fsdp import FullyShardedDataParallel, local_flat_range
from mcore.parallel.optimizer import STATE_KINDS, MasterPiece, MixedPrecisionOptimizer

__all__ = ["FullyShardedOptimizer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FullyShardedOptimizer(MixedPrecisionOptimizer):
    """AdamW over the local shards of ``FullyShardedDataParallel`` chunks (one dp mesh); arguments as
    ``MixedPrecisionOptimizer``'s. The chunks' parameters must be fp32 (the masters); compute in bf16 through the
    wrapper's ``param_dtype``."""

    def __init__(self, model_chunks: nn.Module | Sequence[nn.Module], param_groups=None, **kwargs) -> None:
        chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        for i, c in enumerate(chunks):
            if not isinstance(c, FullyShardedDataParallel):
                raise TypeError(
                    f"FullyShardedOptimizer: model_chunks[{i}] must be a FullyShardedDataParallel, "
                    f"got {type(c).__name__}"
                )
        if len({id(c.mesh.get_group()) for c in chunks}) != 1:
            raise ValueError("FullyShardedOptimizer: every model chunk must be sharded over the same dp mesh")
        self.dp_group = chunks[0].mesh.get_group() if chunks[0].dp_size > 1 else None
        super().__init__(chunks, param_groups, **kwargs)

    def _build_pieces(self) -> list[MasterPiece]:
        pieces = []
        for p, gi in self._group_index().items():
            local = _local(p.detach())
            if local.dtype != torch.float32:
                raise ValueError(
                    f"FullyShardedOptimizer: parameter {self.names[p]!r} is {local.dtype}; the sharded parameters are "
                    "the fp32 master weights: build the model in fp32 and compute in bf16 through param_dtype"
                )
            lo, hi = local_flat_range(p)
            # aliased: the update writes the shard itself, which FSDP all-gathers before the next forward
            pieces.append(MasterPiece(p, self.names[p], lo, hi, local.view(-1), gi, aliased=True, grad_view=None))
        return pieces

    def _gradients(self, upcast: bool) -> list[torch.Tensor | None]:
        grads = []
        for pc in self._pieces:
            g = pc.param.grad
            if g is None:
                grads.append(None)
                continue
            g = _local(g).reshape(-1)
            grads.append(g.float() if upcast else g)
        return grads

    def _norm_dp_group(self):
        return self.dp_group  # each dp rank holds a different shard of every gradient

    def _load_params(self, tensors: dict[str, torch.Tensor]) -> None:
        """Nothing left to do: the masters alias the parameter shards, which ``load_state_dict`` just set."""

    def _full_states(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's whole TP-local master and moments, all-gathered over dp (collective over the dp group)."""
        out = {}
        for pc in self._pieces:
            p = pc.param
            states = {}
            for kind in STATE_KINDS:
                flat = self._piece_state(pc, kind).detach()  # in its storage dtype (bf16 moments stay bf16)
                if isinstance(p, DTensor):
                    local = flat.view(p.to_local().shape)
                    whole = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    states[kind] = whole.full_tensor().clone()
                else:
                    states[kind] = flat.view(p.shape).clone()
            out[p] = states
        return out
