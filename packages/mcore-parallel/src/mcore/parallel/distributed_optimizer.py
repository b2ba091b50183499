"""ZeRO-1: :class:`DistributedOptimizer`, the :class:`~mcore.parallel.optimizer.MixedPrecisionOptimizer` whose
fp32 masters and Adam states are sharded over data parallelism, one shard of every gradient bucket per dp rank
(see :mod:`mcore.parallel.optimizer` for the step and the state format, which are the same)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mcore.parallel.comm import all_gather_into, group_size
from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.optimizer import STATE_KINDS, MasterPiece, MixedPrecisionOptimizer

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO-1: each dp rank keeps fp32 masters and Adam states only for its shard of every gradient bucket.

    ``model_chunks`` must be ``DistributedDataParallel`` wrappers built with ``use_distributed_optimizer=True``
    over one dp group; the other arguments are those of ``MixedPrecisionOptimizer``.
    """

    def __init__(self, model_chunks: nn.Module | Sequence[nn.Module], param_groups=None, **kwargs) -> None:
        chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        for i, c in enumerate(chunks):
            if not isinstance(c, DistributedDataParallel) or not c.use_distributed_optimizer:
                raise TypeError(
                    f"DistributedOptimizer: model_chunks[{i}] must be a DistributedDataParallel built with "
                    f"use_distributed_optimizer=True, got {type(c).__name__}"
                )
        if len({id(c.dp_group) for c in chunks}) != 1:
            raise ValueError("DistributedOptimizer: every model chunk must use the same dp group")
        self.dp_group = chunks[0].dp_group
        super().__init__(chunks, param_groups, **kwargs)

    def _build_pieces(self) -> list[MasterPiece]:
        group_of = self._group_index()
        pieces = []
        for chunk in self.chunks:
            for buf in chunk.grad_buffers:
                for bucket in buf.buckets:
                    for p in bucket.params:
                        if p not in group_of:
                            continue
                        lo, hi = buf.ranges[p]
                        a, b = max(lo, bucket.shard_start), min(hi, bucket.shard_end)
                        if a >= b:
                            continue
                        master = buf.param_data[a:b].float().clone()
                        grad_view = buf.grad_data[lo:hi]
                        pieces.append(
                            MasterPiece(p, self.names[p], a - lo, b - lo, master, group_of[p], False, grad_view)
                        )
        return pieces

    _shards_over_dp = True  # expert buffers are sharded over expert dp: their norm is summed over it

    def _norm_dp_group(self):
        return self.dp_group  # each dp rank holds a different shard of the gradients

    def _after_update(self) -> None:
        for chunk in self.chunks:
            chunk.start_param_sync()

    def _load_params(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every rank sets its whole parameters from the loaded masters; the wrappers then drop fp8 copies cast from
        the old values (``fp8_param_gather``)."""
        super()._load_params(tensors)
        for chunk in self.chunks:
            chunk.params_replaced()

    def _full_states(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Gather every bucket's shards of master/exp_avg/exp_avg_sq over dp (collective over the dp group)."""
        by_param: dict[int, list[MasterPiece]] = {}
        for pc in self._pieces:
            by_param.setdefault(id(pc.param), []).append(pc)
        optimized = {id(p) for p in self._optimized_params()}
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for chunk in self.chunks:
            chunk.finish_param_sync()
            for buf in chunk.grad_buffers:
                dp = group_size(buf.dp_group)  # expert buffers are sharded over expert dp
                for bucket in buf.buckets:
                    length = bucket.shard_end - bucket.shard_start
                    shard = torch.zeros(len(STATE_KINDS), length, dtype=torch.float32, device=self.device)
                    for p in bucket.params:
                        lo, _ = buf.ranges[p]
                        for pc in by_param.get(id(p), []):
                            dst = slice(lo + pc.lo - bucket.shard_start, lo + pc.hi - bucket.shard_start)
                            for k, kind in enumerate(STATE_KINDS):
                                shard[k, dst] = self._piece_state(pc, kind)
                    kinds = len(STATE_KINDS)
                    gathered = torch.empty(dp * kinds, length, dtype=torch.float32, device=self.device)
                    if dp == 1:
                        gathered.copy_(shard)
                    else:
                        all_gather_into(gathered, shard, buf.dp_group)
                    # [dp, kind, shard] -> [kind, dp * shard]: the bucket in order, one row per state kind
                    full = gathered.view(dp, kinds, length).permute(1, 0, 2).reshape(kinds, dp * length)
                    for p in bucket.params:
                        if id(p) not in optimized:
                            continue
                        lo, hi = buf.ranges[p]
                        rng = slice(lo - bucket.start, hi - bucket.start)
                        # gathered in fp32 (exact for bf16 moments), returned in their storage dtype
                        out[p] = {
                            kind: full[k, rng].view(p.shape).to(self.state_dtypes[kind], copy=True)
                            for k, kind in enumerate(STATE_KINDS)
                        }
        return out
