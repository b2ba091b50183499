"""Context-parallel attention: the four ``cp_comm_type`` of Megatron-Core, with their backward.

Every rank holds its :class:`~mcore.parallel.context_parallel.CPSharding` pieces of q, k, v
(``[b, s_local, heads, head_dim]``) and gets the attention output of its own queries:

- ``p2p``: K/V travel around the ring (``isend``/``irecv`` to the next rank, posted before the step's
  block is computed, so the transfer hides behind it); each step's ``(out, lse)`` is merged by
  log-sum-exp. The backward sends K/V around again, with the dK/dV accumulators one hop behind; after
  the last step each accumulator arrives at its owner.
- ``all_gather``: K/V gathered along the sequence, one attention call; the backward reduce-scatters dK/dV.
- ``a2a`` (Ulysses): an all-to-all trades the head dim for the sequence (each rank then holds all tokens of
  ``heads / cp`` heads), one attention call, and the inverse all-to-all; K/V heads must divide by cp.
- ``a2a+p2p`` (hierarchical): ``a2a`` inside groups of ``a2a_size`` ranks, ``p2p`` across the groups.

The blocks are :func:`mcore.kernels.attention_blocks.layout_forward` / ``layout_backward``: our Triton
kernel on CUDA, the torch reference elsewhere.

Attention sinks (GPT-OSS: one logit ``z_h`` per query head in the denominator only). For a query ``i`` of head ``h``
over key blocks ``B_1..B_n`` (ring steps, or one gathered block), ``out_i = sum_j exp(s_ij - L_i) v_j`` with
``L_i = log(exp(z_h) + sum_t sum_{j in B_t} exp(s_ij))``. A block's partial ``(o_t, l_t)`` over its keys merges by
log-sum-exp (``L = logaddexp(l_1, .., l_n)``, ``out = sum_t exp(l_t - L) o_t``), so the sink must enter exactly one
block's ``l_t``, else it would count ``n`` times: it goes with the block every query has, step 0's (the query's own
pieces, whose diagonal is never masked; with a window too). Backward: the kernels take the merged ``L`` and ``out``,
so ``P_ij = exp(s_ij - L_i)`` is already the whole-row probability in every block, and ``dz_h = -sum_i P_i,sink
delta_i`` (``P_i,sink = exp(z_h - L_i)``, ``delta_i = dout_i . out_i``) is taken once, again at step 0. Each rank so
holds the sink gradient of its own queries; the dp x cp gradient reduction sums the ranks' parts, which is the
whole sequence's. Under ``a2a`` a rank attends all tokens of ``heads / size`` heads: it takes those heads' sink
logits (a slice of the parameter, whose other entries get zero gradient here) and their gradient is complete for
the group's tokens; the same sum over the CP group assembles every head. ``a2a+p2p`` is both: the head slice of the
a2a group, the sink at its ring's step 0.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from mcore.kernels import dispatch
from mcore.kernels.attention_blocks import layout_attention, layout_backward, layout_forward, merge_partials
from mcore.parallel.comm import gather_from_sequence_parallel_region
from mcore.parallel.context_parallel import CPSharding, pieces_layout
from mcore.parallel.cp_shift import shift_left

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclasses.dataclass(frozen=True)
class CPGroups:
    """Process groups of one CP group: ``cp`` (all its ranks, in CP-rank order) and, for ``a2a+p2p``, the
    ``a2a`` group of this rank (``a2a_size`` consecutive CP ranks) and its ``p2p`` ring (same position in
    every a2a group)."""

    cp: dist.ProcessGroup
    a2a: dist.ProcessGroup | None = None
    p2p: dist.ProcessGroup | None = None
    a2a_size: int = 1


def new_cp_groups(cp_ranks: list[int], a2a_size: int = 1, backend: str | None = None) -> CPGroups:
    """Create the groups of every CP group; all ranks call this with the same list (``new_group`` is collective).
    ``backend`` (e.g. ``"nccl"`` over a gloo world) defaults to the world's."""
    cp = len(cp_ranks)
    if a2a_size < 1 or cp % a2a_size:
        raise ValueError(f"new_cp_groups: a2a_size ({a2a_size}) must divide the CP size ({cp})")
    me = dist.get_rank()
    cp_group = dist.new_group(cp_ranks, backend=backend)
    a2a = p2p = None
    if a2a_size > 1:
        for first in range(0, cp, a2a_size):
            group = dist.new_group(cp_ranks[first : first + a2a_size], backend=backend)
            a2a = group if me in cp_ranks[first : first + a2a_size] else a2a
        for inner in range(a2a_size):
            ranks = cp_ranks[inner::a2a_size]
            group = dist.new_group(ranks, backend=backend)
            p2p = group if me in ranks else p2p
    return CPGroups(cp_group, a2a, p2p, a2a_size)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharding: CPSharding,
    groups: CPGroups,
    *,
    comm_type: str = "p2p",
    causal: bool = True,
    window_size: int | None = None,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence; returns ``[b, s_local, Hq, Dv]``.
    ``deterministic``: the blocks' backward sums dQ in a fixed order (see :func:`mcore.kernels.attention`)."""
    cp_rank, cp = dist.get_rank(groups.cp), dist.get_world_size(groups.cp)
    _check(q, k, v, sharding, cp, comm_type, groups)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if backend is None:
        backend = "triton" if q.is_cuda and dispatch.triton_available() else "reference"
    rule = (causal, window_size)
    blocks = (backend, deterministic)
    if comm_type == "p2p" or cp == 1:
        ring = list(range(cp))
        return _ring(q, k, v, sharding, [[r] for r in ring], cp_rank, groups.cp, rule, scale, sinks, blocks)
    if comm_type == "all_gather":
        k_all, v_all = (_gather_seq(t, groups.cp) for t in (k, v))
        k_pieces = sharding.gathered_pieces(range(cp))
        layout = pieces_layout(sharding.pieces(cp_rank), k_pieces, q.shape[0], q.shape[1], k_all.shape[1], *rule)
        out, _ = layout_attention(
            q, k_all, v_all, layout, softmax_scale=scale, sinks=sinks, backend=backend, deterministic=deterministic
        )
        return out
    a2a_group, size = (groups.cp, cp) if comm_type == "a2a" else (groups.a2a, groups.a2a_size)
    inner = dist.get_rank(a2a_group)
    first = cp_rank - inner  # CP rank of this a2a group's first member
    qs, ks, vs = (_seq_to_heads(t, a2a_group, size) for t in (q, k, v))
    head_sinks = None if sinks is None else sinks.view(size, -1)[inner]
    if comm_type == "a2a":
        pieces = sharding.gathered_pieces(range(cp))
        layout = pieces_layout(pieces, pieces, q.shape[0], qs.shape[1], ks.shape[1], *rule)
        out, _ = layout_attention(
            qs, ks, vs, layout, softmax_scale=scale, sinks=head_sinks, backend=backend, deterministic=deterministic
        )
    else:
        members = [[g * size + i for i in range(size)] for g in range(cp // size)]
        ring_rank = first // size
        out = _ring(qs, ks, vs, sharding, members, ring_rank, groups.p2p, rule, scale, head_sinks, blocks)
    return _heads_to_seq(out, a2a_group, size)


def _check(q, k, v, sharding: CPSharding, cp: int, comm_type: str, groups: CPGroups) -> None:
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"context_parallel_attention: cp_comm_type must be one of {CP_COMM_TYPES}, got {comm_type!r}")
    if sharding.cp != cp:
        raise ValueError(f"context_parallel_attention: the sharding is for cp={sharding.cp}, the CP group has {cp}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[:2] != (sharding.batch, sharding.local_len):
            raise ValueError(
                f"context_parallel_attention: {name} must be [b={sharding.batch}, s_local={sharding.local_len}, "
                f"heads, head_dim], got {tuple(t.shape)}"
            )
    if comm_type in ("a2a", "a2a+p2p"):
        size = cp if comm_type == "a2a" else groups.a2a_size
        if comm_type == "a2a+p2p" and (groups.a2a is None or groups.p2p is None):
            raise ValueError(
                "context_parallel_attention: a2a+p2p needs CPGroups with a2a and p2p groups (new_cp_groups)"
            )
        if q.shape[2] % size or k.shape[2] % size:
            raise ValueError(
                f"context_parallel_attention: {comm_type} splits heads over {size} ranks, but there are "
                f"{q.shape[2]} query and {k.shape[2]} key/value heads; use p2p or all_gather"
            )


# ------------------------------------------------------------------------------------------- all-to-all


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()  # first: empty_like keeps a permuted tensor's strides, all_to_all_single wants dense
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """``[b, s, H, D]`` (this rank's tokens, all heads) -> ``[b, size * s, H / size, D]`` (the group's tokens in
    rank order, this rank's heads); the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _seq_heads(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _heads_seq(grad, ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _heads_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _seq_heads(grad, ctx.group, ctx.size), None, None


def _seq_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    b, s, h, d = x.shape
    send = x.reshape(b, s, size, h // size, d).permute(2, 0, 1, 3, 4)  # [dest rank, b, s, H/size, D]
    recv = _all_to_all(send, group)  # [source rank, b, s, H/size, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * s, h // size, d)


def _heads_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    b, s_all, h, d = x.shape
    send = x.reshape(b, size, s_all // size, h, d).permute(1, 0, 2, 3, 4)  # [dest rank, b, s, H/size, D]
    recv = _all_to_all(send, group)  # [source rank (head group), b, s, H/size, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s_all // size, size * h, d)


def _seq_to_heads(x, group, size):
    return _SeqToHeads.apply(x, group, size)


def _heads_to_seq(x, group, size):
    return _HeadsToSeq.apply(x, group, size)


def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along the sequence (rank order); the backward reduce-scatters (every rank's queries used it)."""
    return gather_from_sequence_parallel_region(x.transpose(0, 1), group).transpose(0, 1)


# ------------------------------------------------------------------------------------------------- ring


def _ring(q, k, v, sharding, members, ring_rank, group, rule, scale, sinks, blocks):
    """Ring attention over ``group``; ``members[i]`` are the CP ranks whose tokens ring member ``i`` holds."""
    n = len(members)
    pieces = [sharding.gathered_pieces(m) for m in members]
    b, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    # Step t holds the K/V of ring member (ring_rank - t) mod n.
    layouts = tuple(
        pieces_layout(pieces[ring_rank], pieces[(ring_rank - t) % n], b, q_len, k_len, *rule) for t in range(n)
    )
    return _RingAttention.apply(q, k, v, sinks, layouts, group, scale, blocks)


def _peer(group: dist.ProcessGroup, step: int) -> int:
    """Global rank ``step`` places further along the ring."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    return dist.get_global_rank(group, (me + step) % size)


def _exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int) -> tuple[list[torch.Tensor], list]:
    """Post sends of ``tensors`` to the next rank and receives of as many from the previous one."""
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, _peer(group, 1), group, tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, _peer(group, -1), group, tag + i) for i, r in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layouts, group, scale, blocks):
        backend, _ = blocks
        n = len(layouts)
        out = lse = None
        cur_k, cur_v = k, v
        for step in range(n):
            if step < n - 1:
                (next_k, next_v), requests = _exchange([cur_k, cur_v], group, tag=0)
            part = layout_forward(q, cur_k, cur_v, layouts[step], scale, sinks if step == 0 else None, backend=backend)
            out, lse = part if out is None else merge_partials(out, lse, *part)
            if step < n - 1:
                _wait(requests)
                cur_k, cur_v = next_k, next_v
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.config = (layouts, group, scale, blocks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        layouts, group, scale, (backend, deterministic) = ctx.config
        n = len(layouts)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dsinks = None
        cur_k, cur_v = k, v
        dkv_requests = []
        for step in range(n):
            if step < n - 1:
                (next_k, next_v), kv_requests = _exchange([cur_k, cur_v], group, tag=0)
            dq_t, dk_t, dv_t, ds_t = layout_backward(
                q, cur_k, cur_v, out, lse, dout, layouts[step], scale, sinks if step == 0 else None,
                backend=backend, deterministic=deterministic,
            )  # fmt: skip
            dq += dq_t
            dsinks = ds_t if step == 0 else dsinks
            dk_t, dv_t = dk_t.float(), dv_t.float()
            if step > 0:  # the accumulators of this K/V from the ranks that held it before
                _wait(dkv_requests)
                dk_t, dv_t = dk_t + acc_k, dv_t + acc_v  # noqa: F821 - set at the previous step
            if n == 1:
                acc_k, acc_v = dk_t, dv_t
                break
            # One hop behind the K/V; after the last step the accumulator reaches the K/V's owner.
            (acc_k, acc_v), dkv_requests = _exchange([dk_t, dv_t], group, tag=2)
            if step < n - 1:
                _wait(kv_requests)
                cur_k, cur_v = next_k, next_v
        _wait(dkv_requests)
        return dq.to(q.dtype), acc_k.to(k.dtype), acc_v.to(v.dtype), dsinks, None, None, None, None


@dataclasses.dataclass(frozen=True)
class CPContext:
    """What a model needs to run its attention context-parallel for one micro-batch: the batch's sharding,
    the groups and the communication type. ``GPTModel.forward(context_parallel=...)`` takes it."""

    sharding: CPSharding
    groups: CPGroups
    comm_type: str = "p2p"
    backend: str | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.comm_type not in CP_COMM_TYPES:
            raise ValueError(f"CPContext: cp_comm_type must be one of {CP_COMM_TYPES}, got {self.comm_type!r}")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.groups.cp)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[b, s_local]`` positions of this rank's tokens inside their documents (for RoPE)."""
        return self.sharding.positions(self.rank).to(device)

    def shift_left(self, x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
        """This rank's shard of ``x`` shifted left by ``k`` tokens inside each document, ``fill`` past a document's
        end (multi-token prediction's next tokens; :func:`mcore.parallel.cp_shift.shift_left`)."""
        return shift_left(x, k, self.sharding, self.groups.cp, fill)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the CP group (a new tensor, outside autograd): whole-sequence token counts."""
        total = tensor.detach().clone()
        dist.all_reduce(total, group=self.groups.cp)
        return total

    def attention(self, q, k, v, *, causal=True, window_size=None, softmax_scale=None, sinks=None) -> torch.Tensor:
        return context_parallel_attention(
            q, k, v, self.sharding, self.groups, comm_type=self.comm_type, causal=causal,
            window_size=window_size, softmax_scale=softmax_scale, sinks=sinks, backend=self.backend,
            deterministic=self.deterministic,
        )  # fmt: skip
