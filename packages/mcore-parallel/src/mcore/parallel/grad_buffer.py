"""Contiguous, bucketed gradient (and parameter) storage for data parallelism.

Parameters are laid out in backward order (the reverse of ``module.parameters()``) in one flat buffer per
parameter dtype; ``param.main_grad`` is a view into it. Consecutive parameters are grouped into buckets
of at least ``bucket_size`` elements; a bucket's collective is issued once all its parameters' gradients
have been accumulated. Buckets are always issued in index order, so every data-parallel rank issues the
same sequence of collectives even if gradients become ready in a different order.

With the distributed optimizer each bucket is padded to a multiple of ``dp * _SHARD_ALIGN`` elements and
rank ``r`` owns the contiguous ``r``-th ``1/dp`` of every bucket: the gradient collective is a
reduce-scatter into that shard, and the parameters are also views into a flat buffer so that the
updated shards are all-gathered in place, bucket by bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mcore.parallel.comm import all_gather_into, group_rank, group_size, reduce_scatter_into
from mcore.parallel.param_attrs import mark_main_grad_unfilled, set_main_grad, take_main_grad_unfilled

__all__ = ["Bucket", "GradBuffer"]

# Shards start on multiples of 64 elements (>= 128 bytes), which collectives and vectorized kernels like.
_SHARD_ALIGN = 64


@dataclass(eq=False)
class Bucket:
    """A contiguous range ``[start, end)`` of a ``GradBuffer`` (``end`` includes padding)."""

    index: int
    params: list[nn.Parameter]
    start: int
    end: int
    shard_start: int
    shard_end: int
    ready: set[int] = field(default_factory=set)
    grad_handle: dist.Work | None = None
    param_handle: dist.Work | None = None
    launched: bool = False


class GradBuffer:
    """Flat gradient buffer (``grad_dtype``) for parameters of one dtype, split into buckets."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        dp_group: dist.ProcessGroup | None,
        bucket_size: int,
        grad_dtype: torch.dtype,
        use_distributed_optimizer: bool,
        grad_scale: float | None = None,
    ) -> None:
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"GradBuffer: parameters must share one dtype and device, got {dtypes} on {devices}")
        self.param_dtype = params[0].dtype
        self.device = params[0].device
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        self.use_distributed_optimizer = use_distributed_optimizer
        # None: average over dp_group. Expert buffers pass 1 / (dense dp size): a replica sums the contributions
        # of every rank of its ep group, so its group (expert dp) is smaller than the data it saw.
        self.grad_scale = grad_scale
        pad_to = self.dp_size * _SHARD_ALIGN if use_distributed_optimizer else 1

        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        offset = 0
        current: list[nn.Parameter] = []
        start = 0

        def close_bucket() -> None:
            nonlocal offset, current, start
            end = -(-offset // pad_to) * pad_to
            shard = (end - start) // self.dp_size if use_distributed_optimizer else end - start
            lo = start + (self.dp_rank * shard if use_distributed_optimizer else 0)
            bucket = Bucket(len(self.buckets), current, start, end, lo, lo + shard)
            self.buckets.append(bucket)
            for p in current:
                self.bucket_of[p] = bucket
            offset = start = end
            current = []

        for p in params:
            self.ranges[p] = (offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            if offset - start >= bucket_size:
                close_bucket()
        if current:
            close_bucket()
        self.numel = offset

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        # zero()'s views of the ranges it fills around the unfilled parameters: (the unfilled ids, the views)
        self._fill_views: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        self.param_data: torch.Tensor | None = None
        if use_distributed_optimizer:
            # parameters become views of one flat tensor so that each bucket can be all-gathered in place
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
        for p, (lo, hi) in self.ranges.items():
            set_main_grad(p, self.grad_data[lo:hi].view(p.shape))
            if self.param_data is not None:
                self.param_data[lo:hi].copy_(p.data.reshape(-1))
                p.data = self.param_data[lo:hi].view(p.shape)
        self._next_to_launch = 0
        # called with each bucket right after its collective is issued (grad_handle set; None at dp=1): the
        # optimizer's host offload starts the bucket's device-to-host gradient copy there, behind the collective
        self.launch_callbacks: list[Callable[[Bucket], None]] = []

    # ---- gradient reduction -------------------------------------------------------------------------------

    def mark_ready(self, param: nn.Parameter) -> None:
        """Record that ``param``'s gradient for this step is complete; issue every bucket that can go."""
        bucket = self.bucket_of[param]
        if id(param) in bucket.ready:
            raise RuntimeError(
                f"gradient of a parameter of shape {tuple(param.shape)} became ready twice before "
                "finish_grad_sync(): run the backward of every micro-batch but the last inside no_sync()"
            )
        bucket.ready.add(id(param))
        while self._next_to_launch < len(self.buckets):
            nxt = self.buckets[self._next_to_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        for p in bucket.params:  # left unfilled by zero() and written by nothing this step: its gradient is zero
            if take_main_grad_unfilled(p):
                lo, hi = self.ranges[p]
                self.grad_data[lo:hi].zero_()
        self._next_to_launch = bucket.index + 1
        if self.grad_scale is not None and self.grad_scale != 1.0:
            self.grad_data[bucket.start : bucket.end].mul_(self.grad_scale)
        if self.dp_size > 1:
            self._issue_reduction(bucket)
        for callback in self.launch_callbacks:
            callback(bucket)

    def _issue_reduction(self, bucket: Bucket) -> None:
        grad = self.grad_data[bucket.start : bucket.end]
        if self.grad_scale is None:
            # average before summing: keeps low-precision gradient buffers away from overflow
            grad.div_(self.dp_size)
        if self.use_distributed_optimizer:
            shard = self.grad_data[bucket.shard_start : bucket.shard_end]
            bucket.grad_handle = reduce_scatter_into(shard, grad, self.dp_group, async_op=True)
        else:
            bucket.grad_handle = dist.all_reduce(grad, group=self.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Issue the buckets not issued yet (all of them without overlap), wait for all, reset readiness."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.grad_handle is not None:
                bucket.grad_handle.wait()
            bucket.grad_handle = None
        self._reset_readiness()

    def launched_buckets(self) -> int:
        """How many buckets of the current step have had their collective issued."""
        return sum(b.launched for b in self.buckets)

    def _reset_readiness(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched = False
        self._next_to_launch = 0

    def zero(self, unfilled: Collection[nn.Parameter] = ()) -> None:
        """Zero the gradients and forget readiness (waits for any collective still in flight). The regions of
        ``unfilled`` (parameters whose first write of a step overwrites, see ``param_attrs.take_wgrad_target``)
        keep their stale values and are marked so (``param_attrs.mark_main_grad_unfilled``): a writer that adds
        zeroes its region first, and a bucket zeroes those still unwritten before it is reduced (``_launch``), so
        no stale value reaches a collective, the optimizer or the gradient norm."""
        for bucket in self.buckets:
            if bucket.grad_handle is not None:
                bucket.grad_handle.wait()
                bucket.grad_handle = None
        if not unfilled:
            self.grad_data.zero_()
        else:
            # one multi-tensor launch for every range (norms, biases, the embedding between the linears' regions):
            # a launch per range cost the host ~35 launches at the step's start, where the GPU waits for it
            key = tuple(sorted(id(p) for p in unfilled))
            if self._fill_views is None or self._fill_views[0] != key:
                views = [self.grad_data[lo:hi] for lo, hi in self._fill_ranges(unfilled)]
                self._fill_views = (key, views)
            if self._fill_views[1]:
                torch._foreach_zero_(self._fill_views[1])
            for p in unfilled:
                mark_main_grad_unfilled(p)
        self._reset_readiness()

    def _fill_ranges(self, unfilled: Collection[nn.Parameter]) -> list[tuple[int, int]]:
        """The ranges of ``grad_data`` outside ``unfilled``'s regions (bucket padding included), merged."""
        skipped = sorted(self.ranges[p] for p in unfilled)
        out, cursor = [], 0
        for lo, hi in skipped:
            if lo > cursor:
                out.append((cursor, lo))
            cursor = max(cursor, hi)
        if cursor < self.grad_data.numel():
            out.append((cursor, self.grad_data.numel()))
        return out

    # ---- parameter all-gather (distributed optimizer) -------------------------------------------------------

    def shard_view(self, data: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return data[bucket.shard_start : bucket.shard_end]

    def start_param_gather(self) -> None:
        """All-gather every bucket's updated parameter shard (async), first-needed bucket first."""
        if self.param_data is None or self.dp_size == 1:
            return
        for bucket in reversed(self.buckets):  # forward order: the first layers live in the last buckets
            self.wait_param_gather(bucket)
            full = self.param_data[bucket.start : bucket.end]
            bucket.param_handle = all_gather_into(
                full, self.shard_view(self.param_data, bucket), self.dp_group, async_op=True
            )

    def wait_param_gather(self, bucket: Bucket) -> None:
        if bucket.param_handle is not None:
            bucket.param_handle.wait()
            bucket.param_handle = None

    def finish_param_gather(self) -> None:
        for bucket in self.buckets:
            self.wait_param_gather(bucket)

    @property
    def param_gather_pending(self) -> bool:
        return any(b.param_handle is not None for b in self.buckets)
