"""Token dispatchers: move routed tokens to the ranks holding their experts and the outputs back.

Experts are laid out in blocks: ep rank ``r`` holds global experts ``[r * E_local, (r + 1) * E_local)``, and the
``etp`` ranks of an expert-tensor-parallel group hold slices of the same experts' FFN dimension.

* :class:`AllToAllDispatcher` (default): the rows a rank planned (expert-contiguous, global expert order) go to
  the ep rank of their expert with one variable-size all-to-all, then are gathered over the etp group (every
  etp shard needs every row of its experts). The experts' partial outputs are reduce-scattered over etp and sent
  back by the inverse all-to-all. **The one host synchronization of the layer's step** is here: the split sizes
  (``[etp, ep, E]`` rows per expert, two all-gathers of int64 counts) are copied to the host once per forward;
  backward reuses them. Everything else (reordering, offsets) stays on the device; experts that need their
  offsets on the host (per-expert GEMMs, ``experts.wants_host_offsets``) get them derived from those host counts
  (no second sync), or at ep = etp = 1 from a copy started right after the plan (``expert_gemm.HostOffsets``).
* :class:`AllGatherDispatcher`: every rank gathers all tokens and routing decisions of its ep x etp block,
  computes its own experts on the rows routed to them, and reduce-scatters the (partial) outputs. No host sync
  and no split exchange; the gathered tokens cost ``ep * etp`` times the activation memory, so it suits small
  ep or expert TP alone. Every rank of the block must route the same number of tokens (fixed micro-batches).

Both open ``record_function`` ranges ``mcore.moe.permute`` / ``experts`` / ``unpermute`` (the router's is
``mcore.moe.router``, in the layer): ``benchmarks/step_profile.py`` files each kernel, forward and backward, under
its part of the layer. They cost a few microseconds per layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from mcore.kernels.moe import permute, plan_permutation, unpermute
from mcore.parallel.comm import all_gather_into, group_rank, group_size
from mcore.parallel.expert_comm import all_to_all_rows, gather_rows, reduce_scatter_rows
from mcore.parallel.expert_gemm import HostOffsets

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher"]

DISPATCHERS = ("alltoall", "allgather")

# experts(rows [N, H], offsets [E_local] int32, tail_rows=None, host_offsets=None) -> [N, H]; ``tail_rows``: at most
# that many last rows lie past offsets[-1] (None: unknown); ``host_offsets`` (a HostOffsets) passed only to experts
# whose ``wants_host_offsets`` is true
ExpertsFn = Callable[..., torch.Tensor]


def _wants_host_offsets(experts: ExpertsFn) -> bool:
    return bool(getattr(experts, "wants_host_offsets", False))


@dataclass
class _Exchange:
    """What ``combine`` needs from ``dispatch``: host split sizes and the device reordering."""

    input_splits: list[int]
    output_splits: list[int]
    etp_sizes: list[int]
    order: torch.Tensor | None  # expert-major row j = source-major row order[j]
    inverse: torch.Tensor | None
    rows: int  # rows of the plan (the sent ones plus any unused tail)
    local_ends: list[int] | None = None  # the local offsets on the host (from the split exchange's counts)


def _expert_major_order(chunks: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunks`` [sources, E_local] row counts laid out source-major; return the gather index that makes them
    expert-major (expert 0's rows from every source first) and its inverse. On the device, no sync."""
    sources, experts = chunks.shape
    flat = chunks.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(sources, experts).t().reshape(-1)
    sizes = chunks.t().reshape(-1)
    target_starts = torch.cumsum(sizes, 0) - sizes
    shift = torch.repeat_interleave(starts - target_starts, sizes, output_size=total)
    order = shift + torch.arange(total, device=chunks.device)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(total, device=chunks.device))
    return order, inverse


class AllToAllDispatcher:
    """All-to-all over ``ep_group`` then all-gather over ``etp_group`` (see the module docstring)."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None):
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.local_experts = num_experts // self.ep
        self.ep_rank, self.etp_rank = group_rank(ep_group), group_rank(etp_group)

    def dispatch(self, rows: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Exchange]:
        """``rows`` [R, H] planned for all experts with cumulative ``offsets`` [E]: returns the rows of this
        rank's experts (expert-major), their offsets [E_local] and the state ``combine`` needs."""
        if self.ep == 1 and self.etp == 1:
            return rows, offsets, _Exchange([], [], [], None, None, rows.shape[0])
        segment = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.int64))
        counts = segment
        if self.ep > 1:
            counts = torch.empty(self.ep * self.num_experts, dtype=torch.int64, device=rows.device)
            all_gather_into(counts, segment, self.ep_group)
        if self.etp > 1:
            gathered = torch.empty(self.etp * counts.numel(), dtype=torch.int64, device=rows.device)
            all_gather_into(gathered, counts, self.etp_group)
            counts = gathered
        counts = counts.view(self.etp, self.ep, self.ep, self.local_experts)  # [etp, src ep, dst ep, E_local]
        every = counts.tolist()  # the host sync: rows of every (etp, src, dst, expert); a few hundred ints
        host = [[[sum(e) for e in dst] for dst in src] for src in every]  # split sizes of every (etp, src, dst)
        me_q, me_r = self.etp_rank, self.ep_rank
        input_splits = host[me_q][me_r]
        output_splits = [host[me_q][j][me_r] for j in range(self.ep)]
        etp_sizes = [sum(host[q][j][me_r] for j in range(self.ep)) for q in range(self.etp)]
        received = all_to_all_rows(rows[: sum(input_splits)], output_splits, input_splits, self.ep_group)
        received = gather_rows(received, etp_sizes, self.etp_group)
        n = self.local_experts
        chunks = counts[:, :, me_r, :].reshape(self.etp * self.ep, n)
        order, inverse = _expert_major_order(chunks, sum(etp_sizes))
        local_offsets = torch.cumsum(chunks.sum(0), 0).to(torch.int32)
        per_expert = [sum(every[q][j][me_r][e] for q in range(self.etp) for j in range(self.ep)) for e in range(n)]
        local_ends = list(itertools.accumulate(per_expert))  # == local_offsets, on the host already
        state = _Exchange(input_splits, output_splits, etp_sizes, order, inverse, rows.shape[0], local_ends)
        return received[order], local_offsets, state

    def combine(self, y: torch.Tensor, state: _Exchange) -> torch.Tensor:
        """Expert outputs (expert-major, partial over etp) back to this rank's planned rows [R, H]."""
        if state.order is None:
            return y
        y = reduce_scatter_rows(y[state.inverse], state.etp_sizes, self.etp_group)
        y = all_to_all_rows(y, state.input_splits, state.output_splits, self.ep_group)
        tail = state.rows - y.shape[0]
        return torch.cat((y, y.new_zeros(tail, y.shape[1]))) if tail else y

    def __call__(self, x, routing, experts: ExpertsFn, **plan_kwargs) -> tuple[torch.Tensor, object]:
        """Route ``x`` [T, H] by ``routing`` through ``experts``; returns ``([T, H], plan)``."""
        local = self.ep == 1 and self.etp == 1
        wants_host = _wants_host_offsets(experts)
        with record_function("mcore.moe.permute"):
            plan = plan_permutation(routing.indices, self.num_experts, weights=routing.weights, **plan_kwargs)
            # one process's experts: their offsets are the plan's; start the copy before the permute is queued
            early = HostOffsets.start(plan.offsets) if wants_host and local else None
            rows, local_offsets, state = self.dispatch(permute(x, plan), plan.offsets)
        # received rows (ep/etp > 1) fill their segments exactly; the local plan's tail is known from its shape
        tail = plan.max_unused_tail if state.order is None else 0
        kwargs = {}
        if wants_host:
            kwargs["host_offsets"] = early if local else HostOffsets.from_ends(state.local_ends)
        with record_function("mcore.moe.experts"):
            y = experts(rows, local_offsets, tail_rows=tail, **kwargs)
        with record_function("mcore.moe.unpermute"):
            return unpermute(self.combine(y, state), routing.weights, plan), plan


class AllGatherDispatcher:
    """All-gather tokens over ``ep`` then ``etp``; each rank runs its experts; reduce-scatter back."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None):
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.local_experts = num_experts // self.ep
        self.ep_rank = group_rank(ep_group)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        t = gather_rows(t, [t.shape[0]] * self.ep, self.ep_group)
        return gather_rows(t, [t.shape[0]] * self.etp, self.etp_group)

    def __call__(self, x, routing, experts: ExpertsFn, **plan_kwargs) -> tuple[torch.Tensor, object]:
        if plan_kwargs.get("capacity_factor") is not None:
            raise ValueError("the allgather dispatcher is dropless: set capacity_factor=None or use 'alltoall'")
        tokens = x.shape[0]
        with record_function("mcore.moe.permute"):
            x_all = self._gather(x)
            weights_all = self._gather(routing.weights)
            with torch.no_grad():
                indices_all = self._gather(routing.indices)
                local = indices_all - self.ep_rank * self.local_experts
                # another rank's experts go to one extra bucket past the local ones, which no GEMM reads
                local = torch.where((local >= 0) & (local < self.local_experts), local, self.local_experts)
            plan = plan_permutation(local, self.local_experts + 1, align=plan_kwargs.get("align", 1))
            offsets = plan.offsets[: self.local_experts]
            # per-expert GEMMs: the offsets' copy to the host starts before the permute is queued
            kwargs = {"host_offsets": HostOffsets.start(offsets)} if _wants_host_offsets(experts) else {}
            rows = permute(x_all, plan)
        with record_function("mcore.moe.experts"):
            y = experts(rows, offsets, **kwargs)
        with record_function("mcore.moe.unpermute"):
            out = unpermute(y, weights_all, plan)
            out = reduce_scatter_rows(out, [tokens * self.ep] * self.etp, self.etp_group)
            return reduce_scatter_rows(out, [tokens] * self.ep, self.ep_group), plan
