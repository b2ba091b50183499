"""``parallel.cp_dynamic``: each document of a global batch gets the CP size its length needs (dynamic CP).

Static CP cuts every sequence over the same ``cp`` ranks. Here the ``dp x cp`` ranks are one pool of ``W`` ranks
(tp = pp = 1): every step, the documents of the whole global batch (the rows cut at ``cu_seqlens`` with packing,
else whole rows), each padded to a multiple of ``2 x W``, are placed by
:func:`mcore.parallel.dynamic_cp.plan_dynamic`: a document of ``n`` tokens gets the smallest power-of-two group
whose ranks hold at most ``seq_length / cp`` of its tokens each (a static-CP rank's share of one sequence), more
when its attention alone would outweigh a rank's fair share; short documents run whole on one rank, long ones
over an aligned group with the p2p ring. Every rank then runs the documents of each of its groups as one packed
row (one forward and backward per group), the groups in one global order (size, first rank), so that the
collectives of overlapping groups come in the same order everywhere.

The loss is static CP's: the mean over the micro-batches of each micro-batch's mean token loss. A document of
micro-batch ``m`` (``count_m`` tokens in the loss) adds ``W / (M x dp) x`` (its token-loss sum) ``/ count_m``
to the loss its ranks differentiate, so that DDP's average over the pool gives static CP's gradient.

The placement balances predicted attention time by a cost model (:data:`ATTENTION_RATES`: our Triton kernel's
forward + backward TFLOP/s on one H200 by document length, 2026-12-01; linear layers at
``LINEAR_TFLOPS``); the results do not depend on it, only the speed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore.models.accounting import parameter_counts
from mcore.parallel.context_parallel import CPSharding, pad_documents
from mcore.parallel.cp_attention import CPContext, CPGroups
from mcore.parallel.dynamic_cp import CostModel, Placement, aligned_groups, local_sequences, plan_dynamic
from mcore.parallel.grid import ProcessGroups
from mcore.train.errors import UserError

__all__ = ["DynamicCP"]

ATTENTION_RATES = ((128, 51.0), (512, 116.0), (4096, 199.0), (16384, 219.0))  # (tokens, TFLOP/s), H200, ours
LINEAR_TFLOPS = 600.0
_KEYS = ("tokens", "labels", "loss_mask")


@dataclass(frozen=True)
class _Document:
    microbatch: int  # index over the global batch's micro-batches (dp rank major)
    tensors: dict[str, torch.Tensor]  # 1-D, padded to a multiple of 2 x W


class DynamicCP:
    """The forward and backward of one step's global batch under dynamic CP (see the module docstring)."""

    def __init__(self, config: Any, groups: ProcessGroups, device: torch.device) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if groups.tp_size * groups.pp_size != 1 or world & (world - 1):
            raise UserError(
                f"parallel.cp_dynamic needs tp = pp = 1 and a power-of-two world (its groups are aligned blocks of "
                f"ranks); got tp={groups.tp_size}, pp={groups.pp_size}, world {world}"
            )
        model = config.model
        self.world, self.rank, self.groups, self.device = world, dist.get_rank(), groups, device
        self.tokens_per_rank = config.data.seq_length // config.parallel.cp
        self.cost = CostModel(
            attention_rates=ATTENTION_RATES,
            heads=model.num_attention_heads,
            head_dim=model.head_dim or model.hidden_size // model.num_attention_heads,
            layers=model.num_hidden_layers,
            linear_flops_per_token=6.0 * parameter_counts(model).total,
            linear_tflops=LINEAR_TFLOPS,
        )
        self.blocks = aligned_groups(world)  # collective: every rank creates every block's group
        self.last_placement: Placement | None = None

    def forward_backward(
        self, microbatches: Sequence[Mapping[str, Any]], module: torch.nn.Module, scale_loss: Callable
    ) -> torch.Tensor:
        """Run this rank's documents of the global batch (every dp rank's ``microbatches``) and backward them
        into ``module``'s gradient buffers (not reduced: call ``finalize_model_grads`` next); returns the step's
        loss (the same on every rank).

        The documents of one group run as one packed row (one forward and backward per group); groups are taken
        in one global order, (size, first rank), so that overlapping groups' collectives never wait on each other.
        """
        batches = self._global_batch(microbatches)
        counts = [max(float(b["loss_mask"].sum()), 1.0) for b in batches]
        docs = [doc for i, batch in enumerate(batches) for doc in self._documents(i, batch)]
        lengths = [d.tensors["tokens"].numel() for d in docs]
        placement = plan_dynamic(lengths, self.world, self.tokens_per_rank, self.cost)
        self.last_placement = placement  # (first rank, CP size) of each document: for logs and tests
        by_group: dict[tuple[int, int], list[_Document]] = {}
        for index, first, size, _ in local_sequences(placement, self.rank):
            by_group.setdefault((size, first), []).append(docs[index])
        weight = self.world / len(batches)  # W / (M x dp): DDP averages the pool's gradients
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with module.no_sync():
            for (size, first), members in sorted(by_group.items()):
                loss = self._group_loss(module, members, counts, first, size)
                scale_loss(loss * weight).backward()
                total += loss.detach().double()
        dist.all_reduce(total)
        return (total / len(batches)).float()

    def _global_batch(self, microbatches: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """Every dp rank's micro-batches (the CP ranks of a dp rank hold the same ones), dp rank major, on CPU."""
        mine = [{k: v.cpu() for k, v in mb.items() if isinstance(v, torch.Tensor)} for mb in microbatches]
        if self.groups.dp_size == 1:
            return mine
        gathered: list[Any] = [None] * self.groups.dp_size
        dist.all_gather_object(gathered, mine, group=self.groups.dp)
        return [mb for part in gathered for mb in part]

    def _documents(self, index: int, batch: Mapping[str, torch.Tensor]) -> list[_Document]:
        b, s = batch["tokens"].shape
        bounds = set(range(0, b * s + 1, s))
        if batch.get("cu_seqlens") is not None:
            bounds |= {int(x) for x in batch["cu_seqlens"].tolist()}
        edges = sorted(bounds)
        flat = {k: batch[k].reshape(-1) for k in _KEYS}
        out = []
        for lo, hi in zip(edges, edges[1:]):
            (padded,) = pad_documents([hi - lo], 2 * self.world)
            tensors = {}
            for key, pad in zip(_KEYS, (0, -100, 0.0)):
                piece = flat[key][lo:hi]
                tensors[key] = torch.cat([piece, piece.new_full((padded - (hi - lo),), pad)]).to(self.device)
            # the padding, which MoE layers leave out of their expert counts (so of the bias update)
            tensors["padding_mask"] = torch.arange(padded, device=self.device) >= hi - lo
            out.append(_Document(index, tensors))
        return out

    def _group_loss(self, module, docs: list[_Document], counts: list[float], first: int, size: int) -> torch.Tensor:
        """Sum over this rank's tokens of the documents of one group (whole at size 1, CP shards otherwise) of
        each token's loss over its micro-batch's loss-token count."""
        row = {k: torch.cat([d.tensors[k] for d in docs])[None] for k in (*_KEYS, "padding_mask")}
        row["loss_mask"] = row["loss_mask"] * torch.cat(
            [torch.full_like(d.tensors["loss_mask"], 1.0 / counts[d.microbatch]) for d in docs]
        )
        lengths = [d.tensors["tokens"].numel() for d in docs]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        kwargs: dict[str, Any] = {}
        if size == 1:
            kwargs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=self.device)
            kwargs["position_ids"] = torch.cat([torch.arange(n, device=self.device) for n in lengths])[None]
        else:
            sharding = CPSharding(1, bounds[-1], size, tuple(bounds))
            row = {k: sharding.shard(t, self.rank - first) for k, t in row.items()}
            kwargs["context_parallel"] = CPContext(sharding, CPGroups(self.blocks[(first, size)]), "p2p")
        out = module(row["tokens"], labels=row["labels"], padding_mask=row["padding_mask"], **kwargs)
        return (out * row["loss_mask"]).sum()
