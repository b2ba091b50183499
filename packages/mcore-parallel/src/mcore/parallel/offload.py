"""Optimizer CPU offload: fp32 master weights and AdamW moments of a fraction of the parameters in host memory,
their update computed by the CPU (``optim.offload_fraction``; Megatron's ``optimizer_offload_fraction``).

``HostOffload`` moves the masters of the first ``fraction`` of the optimizer's pieces (by elements, in bucket
order: the last layers first) to host memory, where their moments are created too; the device keeps only the
model parameters and the gradient buffer for them. A step then goes:

1. backward: as soon as a DDP bucket's collective is issued (``GradBuffer.launch_callbacks``), its offloaded
   gradients are copied device-to-host on a side stream, behind the collective, into pinned buffers, while
   autograd goes on with earlier layers. Gradients that change after their bucket (sequence-parallel and tied
   embedding gradients, summed by ``finalize_model_grads``) and those without a bucket are copied at the step;
2. step: the device part is updated first (queued on the GPU), then the CPU waits for the gradient copies and
   updates the host part, chunk by chunk; each chunk's updated masters go host-to-device on the side stream
   (into the now free fp32 gradient buffer, cast there to the parameter dtype) while the CPU updates the next
   chunk. The compute stream waits for the last copy before the next forward (a wait on the GPU, no host sync).

On CPU the same code runs with synchronous copies. The CPU update is ``host_adamw_step_``: torch's fused or
foreach AdamW, or mcore's reference ``adamw_step_`` (see ``benchmarks/cpu_adamw.py`` for which is fastest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw as torch_adamw

from mcore.kernels import adamw_step_
from mcore.parallel.grad_clip import clip_coefficient

# The optimizer's MasterPiece objects (param, lo, hi, master, group_index, aliased, grad_view); not imported, as
# the optimizer imports this module.
Piece = Any

__all__ = ["HOST_ADAMW_IMPLS", "HostOffload", "host_adamw_step_", "host_offload"]

HOST_ADAMW_IMPLS = ("fused", "foreach", "mcore")
# The fastest on the CPUs measured (benchmarks/cpu_adamw.py, docs/performance.md).
DEFAULT_HOST_ADAMW = "fused"
# Elements per CPU update call: the host-to-device copy of one chunk overlaps the update of the next.
_CHUNK_ELEMENTS = 32 * 2**20


def host_adamw_step_(
    impl: str,
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step_tensors: list[torch.Tensor],
    *,
    steps: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    multiplier: float | torch.Tensor | None = None,
) -> None:
    """One AdamW step on host tensors; ``steps`` is the step number after it, ``step_tensors`` are incremented.

    ``multiplier`` scales the gradients first: folded into the update (``mcore``), or multiplied into ``grads`` in
    place (torch's paths). The results of ``foreach`` equal ``torch.optim.AdamW(foreach=True).step()``'s and those
    of ``mcore`` ``adamw_step_``'s bit for bit.
    """
    if impl not in HOST_ADAMW_IMPLS:
        raise ValueError(f"host AdamW: impl must be one of {HOST_ADAMW_IMPLS}, got {impl!r}")
    if not masters:
        return
    if impl == "mcore":
        if multiplier is not None and not isinstance(multiplier, torch.Tensor):
            multiplier = torch.full((), float(multiplier), dtype=torch.float32)
        adamw_step_(
            masters, grads, exp_avgs, exp_avg_sqs, steps=steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, grad_multiplier=multiplier, backend="reference",
        )  # fmt: skip
        torch._foreach_add_(step_tensors, 1.0)
        return
    if multiplier is not None:
        torch._foreach_mul_(grads, multiplier)
    torch_adamw(
        masters, grads, exp_avgs, exp_avg_sqs, [], step_tensors, foreach=impl == "foreach", fused=impl == "fused",
        amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False,
    )  # fmt: skip


def host_offload(optimizer, fraction: float, impl: str | None) -> HostOffload | None:
    """The ``HostOffload`` of ``optimizer`` (a ``MixedPrecisionOptimizer`` whose pieces are built, its AdamW not
    yet), or ``None`` for ``fraction == 0``; checks the arguments."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise TypeError(f"optimizer: offload_fraction must be a number in [0, 1], got {fraction!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"optimizer: offload_fraction must lie in [0, 1], got {fraction}")
    if fraction == 0:
        return None
    if optimizer.loss_scaler is not None and not optimizer.fused_step:
        raise ValueError(
            "optimizer: offload_fraction > 0 with a loss scaler (fp16) needs the fused step (fused_step=True, the "
            "default on CUDA), which keeps the gradients scaled until the update"
        )
    low = [k for k, d in optimizer.state_dtypes.items() if d != torch.float32]
    if low and impl not in (None, "mcore"):
        raise ValueError(
            f"optimizer: offload_impl={impl!r} runs torch's AdamW, which keeps fp32 moments; {', '.join(low)} in "
            "bf16 need offload_impl='mcore' (or None, which picks it)"
        )
    # bf16 moments: torch's host AdamW cannot keep them, mcore's reference update can
    impl = impl or ("mcore" if low else DEFAULT_HOST_ADAMW)
    offload = HostOffload(optimizer._pieces, fraction, optimizer.device, impl)
    offload.attach(optimizer.chunks)
    return offload


def _choose(pieces: Sequence[Piece], fraction: float) -> list[int]:
    """The first pieces holding ``fraction`` of the elements (a piece is taken when that brings the share closer)."""
    total = sum(pc.hi - pc.lo for pc in pieces)
    budget, taken, chosen = fraction * total, 0, []
    for i, pc in enumerate(pieces):
        size = pc.hi - pc.lo
        if taken + size / 2 > budget:
            break
        chosen.append(i)
        taken += size
    return chosen


class HostOffload:
    """The host-resident part of a ``MixedPrecisionOptimizer``'s state (see the module docstring)."""

    def __init__(self, pieces: list[Piece], fraction: float, device: torch.device, impl: str) -> None:
        if impl not in HOST_ADAMW_IMPLS:
            raise ValueError(f"optimizer: offload_impl must be one of {HOST_ADAMW_IMPLS}, got {impl!r}")
        self.impl = impl
        self.device = device
        self.cuda = device.type == "cuda"
        self.indices = _choose(pieces, fraction)
        self._pieces = pieces
        sizes = [pieces[i].hi - pieces[i].lo for i in self.indices]
        # pinned: the transfers are DMA, asynchronous and at full bandwidth
        flat_masters = torch.empty(sum(sizes), dtype=torch.float32, pin_memory=self.cuda)
        flat_grads = torch.empty(sum(sizes), dtype=torch.float32, pin_memory=self.cuda)
        self.host_grads: dict[int, torch.Tensor] = {}
        offset = 0
        for i, size in zip(self.indices, sizes):
            pc = pieces[i]
            host = flat_masters[offset : offset + size]
            host.copy_(pc.master)
            self.host_grads[i] = flat_grads[offset : offset + size]
            pc.master = host  # a device copy (not aliased) is freed here; an aliased one stays the model parameter
            pc.aliased = False
            offset += size
        self.numel = offset
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # sequence-parallel and tied-embedding gradients are summed again after their bucket: copy them at the step
        late = ("sequence_parallel", "shared_embedding")
        self._late = {i for i in self.indices if any(getattr(pieces[i].param, a, False) for a in late)}
        self._copies: dict[int, torch.cuda.Event | None] = {}
        self._bucket_pieces: dict[int, list[int]] = {}

    # ---- gradients: device -> host ---------------------------------------------------------------------------

    def attach(self, chunks: Sequence[nn.Module]) -> None:
        """Start each bucket's gradient copies when DDP issues its collective (chunks without buckets: at the step)."""
        by_param: dict[int, list[int]] = {}
        for i in self.indices:
            if i not in self._late and self._pieces[i].grad_view is not None:
                by_param.setdefault(id(self._pieces[i].param), []).append(i)
        for chunk in chunks:
            for buf in getattr(chunk, "grad_buffers", ()):
                for bucket in buf.buckets:
                    mine = [i for p in bucket.params for i in by_param.get(id(p), [])]
                    if mine:
                        self._bucket_pieces[id(bucket)] = mine
                if any(id(b) in self._bucket_pieces for b in buf.buckets):
                    buf.launch_callbacks.append(self._on_bucket_launched)

    def _on_bucket_launched(self, bucket) -> None:
        for i in self._bucket_pieces.get(id(bucket), ()):
            pc = self._pieces[i]
            self._copy_grad(i, pc.grad_view[pc.lo : pc.hi], bucket.grad_handle)

    def _copy_grad(self, i: int, src: torch.Tensor, handle=None) -> None:
        dst = self.host_grads[i]
        if not self.cuda:
            if handle is not None:
                handle.wait()
            dst.copy_(src)
            self._copies[i] = None
            return
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            if handle is not None:
                handle.wait()  # makes the side stream (current here) wait for the collective
            dst.copy_(src, non_blocking=True)
            self._copies[i] = self.stream.record_event()

    def _gather_grads(self, grads: list[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """Every offloaded gradient on the host (issuing the copies not issued during backward), waited for."""
        for i in self.indices:
            if i not in self._copies and grads[i] is not None:
                self._copy_grad(i, grads[i])
        for event in self._copies.values():
            if event is not None:
                event.synchronize()
        out = {i: self.host_grads[i] for i in self.indices if i in self._copies and grads[i] is not None}
        self._copies.clear()
        return out

    def drop_pending(self) -> None:
        """Forget this step's copies (a skipped step), after waiting for those in flight."""
        for event in self._copies.values():
            if event is not None:
                event.synchronize()
        self._copies.clear()

    # ---- the host update and masters: host -> device ----------------------------------------------------------

    @torch.no_grad()
    def update(self, optimizer, grads: list[torch.Tensor | None], norm: torch.Tensor, inv_scale: float | None) -> None:
        """Update the host part of ``optimizer`` (a ``MixedPrecisionOptimizer``) and copy it into the model."""
        host = self._gather_grads(grads)
        if optimizer.fused_step:
            multiplier = optimizer._grad_multiplier(norm, inv_scale)
            multipliers = [] if multiplier is None else [multiplier.cpu()]
        else:  # as the device path: unscale first, then clip by the (unscaled) norm, two roundings
            multipliers = [] if inv_scale is None else [inv_scale]
            if optimizer.clip_grad > 0:
                multipliers.append(clip_coefficient(optimizer.clip_grad, norm).cpu())
        if self.cuda:
            # the host-to-device copies write the gradient buffer and the parameters: only after the compute stream
            # is done with them (the norm, and the device part's update, may still be queued)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        chunk: list[int] = []
        size = 0
        for i in [i for i in self.indices if i in host]:
            chunk.append(i)
            size += self._pieces[i].hi - self._pieces[i].lo
            if size >= _CHUNK_ELEMENTS:
                self._update_chunk(optimizer, chunk, host, multipliers)
                chunk, size = [], 0
        self._update_chunk(optimizer, chunk, host, multipliers)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _update_chunk(self, optimizer, indices: list[int], host: dict[int, torch.Tensor], multipliers) -> None:
        if not indices:
            return
        if optimizer.fused_step:
            multiplier = multipliers[0] if multipliers else None
        else:
            for m in multipliers:
                torch._foreach_mul_([host[i] for i in indices], m)
            multiplier = None
        calls: dict[tuple[int, int], list[int]] = {}
        for i in indices:
            key = (optimizer._adam_group_of[self._pieces[i].group_index], optimizer._piece_steps[i] + 1)
            calls.setdefault(key, []).append(i)
        for (ai, steps), group_indices in calls.items():
            group = optimizer._adam.param_groups[ai]
            masters = [self._pieces[i].master for i in group_indices]
            states = [optimizer._state_of(m) for m in masters]
            beta1, beta2 = group["betas"]
            host_adamw_step_(
                self.impl, masters, [host[i] for i in group_indices], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [s["step"] for s in states], steps=steps, lr=group["lr"],
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], multiplier=multiplier,
            )  # fmt: skip
            for i in group_indices:
                optimizer._piece_steps[i] = steps
        for i in indices:
            self._copy_master(i)

    def _copy_master(self, i: int) -> None:
        pc = self._pieces[i]
        dst = pc.param.data.view(-1)[pc.lo : pc.hi]
        if not self.cuda:
            dst.copy_(pc.master)
            return
        with torch.cuda.stream(self.stream):
            if dst.dtype == torch.float32:
                dst.copy_(pc.master, non_blocking=True)
            else:
                # land in fp32 on the device (the step is done with this gradient) and cast there: half the bytes
                # of a host-side cast would need a second pinned buffer
                if pc.grad_view is not None:
                    landing = pc.grad_view[pc.lo : pc.hi]
                else:
                    landing = torch.empty_like(pc.master, device=self.device)
                landing.copy_(pc.master, non_blocking=True)
                dst.copy_(landing)
