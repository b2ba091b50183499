"""Token permutation for MoE: gather tokens into expert-contiguous order and combine the outputs back.

``plan_permutation`` turns the router's ``indices`` [T, k] into a :class:`PermutePlan`: where each
(token, choice) lands in a buffer whose rows are grouped by expert (expert 0's rows first), plus the
``offsets`` that :func:`mcore.kernels.grouped_gemm.grouped_gemm` needs. The buffer has a static number of
rows (no host sync, shapes fixed for CUDA graphs / torch.compile):

* dropless (default): ``T * k`` rows, all used;
* ``align > 1``: each expert's segment is padded with zero rows to a multiple of ``align`` (FP8 grouped GEMMs
  want 16); the buffer has ``T * k + E * (align - 1)`` rows, those past ``offsets[-1]`` unused;
* ``capacity_factor``: each expert keeps at most ``ceil(T * k * capacity_factor / E)`` choices, dropping the
  rest by position (later tokens first) or by probability (lowest weight first); with ``pad_to_capacity``
  every segment is exactly ``capacity`` rows (``E * capacity`` in all), otherwise the kept rows are packed.

Padding rows hold zeros and a dropped choice contributes nothing to its token's output. ``permute`` and
``unpermute`` are autograd functions whose forward and backward are both gathers (deterministic: no
atomics, no ``index_add_``). On CUDA they run as Triton kernels (``mcore.kernels.triton.moe_permute``: one pass
each, the routing-weight multiply fused into the gather, the weights' gradient into the rows' one); the pure-torch
reference here is the definition (``backend="reference"`` or ``MCORE_KERNELS_BACKEND=reference``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mcore.kernels import dispatch

__all__ = ["PermutePlan", "permute", "plan_permutation", "unpermute"]

_DROP_POLICIES = ("position", "probability")


@dataclass
class PermutePlan:
    """Where every (token, choice) goes.

    * ``slot_of_choice`` [T, k] int64: its row in the permuted buffer, ``-1`` when dropped;
    * ``choice_of_slot`` [rows] int64: the flat choice index ``t * k + j`` a row holds, ``-1`` for padding;
    * ``offsets`` [E] int32: end row of each expert's segment (cumulative; ``grouped_gemm``'s ``offs``);
    * ``tokens_per_expert`` [E] int64: choices kept per expert; ``dropped`` 0-d int64: choices dropped;
    * ``max_unused_tail``: how many last rows at most lie past ``offsets[-1]`` (known without a sync: dropless
      ``E * (align - 1)``, padded capacity 0), ``None`` when any may (capacity dropping); ``grouped_gemm``'s
      ``tail_rows``.
    """

    slot_of_choice: torch.Tensor
    choice_of_slot: torch.Tensor
    offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    max_unused_tail: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_of_choice.shape[0]

    @property
    def topk(self) -> int:
        return self.slot_of_choice.shape[1]

    @property
    def num_rows(self) -> int:
        return self.choice_of_slot.shape[0]


def capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Choices one expert may keep: ``ceil(tokens * topk * capacity_factor / experts)``."""
    return max(1, math.ceil(num_tokens * topk * capacity_factor / num_experts))


def plan_permutation(
    indices: torch.Tensor,
    num_experts: int,
    *,
    weights: torch.Tensor | None = None,
    align: int = 1,
    capacity_factor: float | None = None,
    drop_policy: str = "position",
    pad_to_capacity: bool = False,
) -> PermutePlan:
    """Plan the expert-contiguous layout of ``indices`` [T, k] (see the module docstring). No host sync.

    ``weights`` [T, k] are needed only for ``drop_policy="probability"``.
    """
    _check_plan_args(indices, num_experts, weights, align, capacity_factor, drop_policy, pad_to_capacity)
    tokens, k = indices.shape
    device = indices.device
    flat = indices.reshape(-1)
    n = flat.numel()
    if capacity_factor is not None and drop_policy == "probability":
        # highest weight first within each expert: sort by weight, then stably by expert
        by_weight = torch.argsort(weights.detach().reshape(-1).float(), descending=True, stable=True)
        order = by_weight[torch.argsort(flat[by_weight], stable=True)]
    else:
        order = torch.argsort(flat, stable=True)  # token order within each expert
    sorted_expert = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=device) - starts[sorted_expert]
    if capacity_factor is None:
        kept = torch.ones(n, dtype=torch.bool, device=device)
        kept_counts = counts
    else:
        cap = capacity(tokens, k, num_experts, capacity_factor)
        kept = rank_in_expert < cap
        kept_counts = counts.clamp(max=cap)
    if capacity_factor is not None and pad_to_capacity:
        segment = torch.full_like(counts, cap)
        rows = num_experts * cap
    else:
        segment = (kept_counts + align - 1) // align * align
        rows = n + (num_experts * (align - 1) if align > 1 else 0)
    ends = torch.cumsum(segment, 0)
    slot_sorted = torch.where(kept, (ends - segment)[sorted_expert] + rank_in_expert, rows)
    # scatter into one spare row (index ``rows``) for dropped choices instead of boolean indexing (a sync)
    choice_of_slot = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
    choice_of_slot.scatter_(0, slot_sorted, torch.where(kept, order, -1))
    slot_of_choice = torch.empty(n, dtype=torch.int64, device=device)
    slot_of_choice.scatter_(0, order, torch.where(kept, slot_sorted, -1))
    return PermutePlan(
        slot_of_choice=slot_of_choice.view(tokens, k),
        choice_of_slot=choice_of_slot[:rows],
        offsets=ends.to(torch.int32),
        tokens_per_expert=kept_counts,
        dropped=counts.sum() - kept_counts.sum(),
        max_unused_tail=rows - n if capacity_factor is None else (0 if pad_to_capacity else None),
    )


def _check_plan_args(indices, num_experts, weights, align, capacity_factor, drop_policy, pad_to_capacity) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.dtype != torch.int64:
        desc = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices)
        raise ValueError(f"plan_permutation: indices must be an int64 [tokens, topk] tensor, got {desc}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"plan_permutation: align must be a positive int, got {align!r}")
    if drop_policy not in _DROP_POLICIES:
        raise ValueError(f"plan_permutation: drop_policy must be one of {_DROP_POLICIES}, got {drop_policy!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"plan_permutation: capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
    if pad_to_capacity and capacity_factor is None:
        raise ValueError("plan_permutation: pad_to_capacity needs a capacity_factor (dropless has no capacity)")
    if pad_to_capacity and align > 1:
        raise ValueError("plan_permutation: pad_to_capacity and align > 1 exclude each other; round the capacity")
    needs_weights = capacity_factor is not None and drop_policy == "probability"
    if needs_weights and (weights is None or tuple(weights.shape) != tuple(indices.shape)):
        got = None if weights is None else tuple(weights.shape)
        raise ValueError(f"plan_permutation: drop_policy='probability' needs weights {tuple(indices.shape)}, got {got}")


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """``x`` with one zero row appended, so that index ``-1`` gathers zeros."""
    return torch.cat((x, x.new_zeros(1, x.shape[1])))


def _triton_impl():
    from mcore.kernels.triton import moe_permute as triton_permute

    return triton_permute


def permute(x: torch.Tensor, plan: PermutePlan, *, backend: str | None = None) -> torch.Tensor:
    """Rows of ``x`` [T, H] in the planned expert-contiguous order: ``[plan.num_rows, H]``, padding zero.

    ``backend``: ``"triton"``, ``"reference"`` or ``None`` (CUDA -> Triton)."""
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise ValueError(f"permute: x must be [{plan.num_tokens}, hidden] (the planned tokens), got {tuple(x.shape)}")
    chosen = dispatch.choose("moe_permute", x, backend=backend)
    return _Permute.apply(x, plan.choice_of_slot, plan.slot_of_choice, chosen)


def unpermute(y: torch.Tensor, weights: torch.Tensor, plan: PermutePlan, *, backend: str | None = None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[slot_of_choice[t, j]]`` over kept choices: ``[T, H]`` in y's dtype.

    ``weights`` [T, k] (fp32 from the router) are applied in fp32; gradients flow to ``y`` and ``weights``.
    """
    if y.dim() != 2 or y.shape[0] != plan.num_rows:
        raise ValueError(f"unpermute: y must be [{plan.num_rows}, hidden] (the planned rows), got {tuple(y.shape)}")
    if tuple(weights.shape) != (plan.num_tokens, plan.topk):
        raise ValueError(f"unpermute: weights must be [{plan.num_tokens}, {plan.topk}], got {tuple(weights.shape)}")
    chosen = dispatch.choose("moe_permute", y, backend=backend)
    return _Unpermute.apply(y, weights, plan.choice_of_slot, plan.slot_of_choice, chosen)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, choice_of_slot, slot_of_choice, backend):
        ctx.save_for_backward(slot_of_choice)
        ctx.backend = backend
        k = slot_of_choice.shape[1]
        if backend == dispatch.TRITON:
            return _triton_impl().permute_forward(x, choice_of_slot, k)
        token_of_slot = torch.where(choice_of_slot >= 0, choice_of_slot // k, -1)
        return _with_zero_row(x)[token_of_slot]

    @staticmethod
    def backward(ctx, dy):
        (slot_of_choice,) = ctx.saved_tensors
        if ctx.backend == dispatch.TRITON:
            return _triton_impl().permute_backward(dy, slot_of_choice), None, None, None
        # each token's gradient is the sum over its kept choices' rows (fp32 sum of k rows)
        dx = _with_zero_row(dy)[slot_of_choice].float().sum(1).to(dy.dtype)
        return dx, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, choice_of_slot, slot_of_choice, backend):
        ctx.save_for_backward(y, weights, choice_of_slot, slot_of_choice)
        ctx.backend = backend
        if backend == dispatch.TRITON:
            return _triton_impl().unpermute_forward(y, weights, slot_of_choice)
        gathered = _with_zero_row(y)[slot_of_choice]  # [T, k, H]
        return torch.einsum("tkh,tk->th", gathered.float(), weights.float()).to(y.dtype)

    @staticmethod
    def backward(ctx, dout):
        y, weights, choice_of_slot, slot_of_choice = ctx.saved_tensors
        if ctx.backend == dispatch.TRITON:
            dy, dweights = _triton_impl().unpermute_backward(dout, y, weights, slot_of_choice)
            dy = dy if ctx.needs_input_grad[0] else None
            dweights = dweights.to(weights.dtype) if ctx.needs_input_grad[1] else None
            return dy, dweights, None, None, None
        k = slot_of_choice.shape[1]
        dout_f = dout.float()
        dweights = None
        if ctx.needs_input_grad[1]:
            gathered = _with_zero_row(y)[slot_of_choice].float()
            dweights = torch.einsum("tkh,th->tk", gathered, dout_f).to(weights.dtype)
        dy = None
        if ctx.needs_input_grad[0]:
            valid = choice_of_slot >= 0
            choice = choice_of_slot.clamp(min=0)
            scale = torch.where(valid, weights.reshape(-1).float()[choice], 0.0)
            dy = (dout_f[choice // k] * scale[:, None]).to(y.dtype)
        return dy, dweights, None, None, None
