"""Delayed scaling (tensor-wise): an operand scaled by the amaxes of its previous calls, kept on the device.

:class:`AmaxHistory` holds the last ``length`` amaxes of one operand in a ring of ``length + 2`` fp32 slots and
a host-side call counter (no host sync ever). At call ``n`` the amax this call measures goes into slot
``n % (length + 2)``; the window it is scaled by is every slot but that one and the next, ``(n + 1) % (length +
2)``, which holds the oldest amax, the one leaving the window: exactly the last ``length`` amaxes (the slots of
calls not made yet are zero, and amaxes are >= 0, so they never raise the max). Each call zeroes the next slot for
the following call's record.

Why the two spare slots: on CUDA the whole bookkeeping runs inside the one cast kernel (``quant_fused``'s dual
cast): its programs read the window, every program adds its tile's max to the record slot by an atomic max
(which needs that slot zeroed beforehand: the previous call did it), and one program zeroes the next slot; no
program reads a slot another one writes. Without them the step paid four small torch ops per operand (the window
max, a zeroed scalar, its reset and an indexed copy), host time that left the GPU idle in the 8b4l fp8 step.

The first call has no history: it measures the amax first (current scaling) and records it. Under tensor
parallelism ``reduce`` (a MAX all-reduce over the ranks sharing the tensor) is applied to the recorded slot in
place, so every rank's history holds the group's amax (the first call's scale uses the reduced amax as well).

Overflow: where a tensor's own amax exceeds the one its scale came from, every element above the scale's amax
saturates to the fp8 maximum (``overflow="saturate"``, the default and Transformer Engine's behaviour).
``overflow="recast"`` casts such a tensor again, after the reduction (every rank decides on the same reduced amax),
with current scaling from its recorded amax: the same bits as a current-scaling cast from that amax, and the plain
delayed cast when it did not overflow. On CUDA the decision stays on the device (``triton.delayed_recast``:
one more pass over the tensor only when it overflowed); the torch path reads the two amaxes back to the host.
"""

from __future__ import annotations

import torch

from mcore.kernels import dispatch
from mcore.kernels.fp8_casts import quantize_dual
from mcore.kernels.quantization import AmaxReduce, Quantized

COMPUTES = ("max", "most_recent")
OVERFLOWS = ("saturate", "recast")


class AmaxHistory:
    """Delayed scaling state of one operand: the last ``length`` amaxes, on the device."""

    def __init__(self, length: int, compute: str, overflow: str = "saturate") -> None:
        if length < 1:
            raise ValueError(f"AmaxHistory: length must be >= 1, got {length}")
        if compute not in COMPUTES:
            raise ValueError(f"AmaxHistory: compute must be one of {COMPUTES}, got {compute!r}")
        if overflow not in OVERFLOWS:
            raise ValueError(f"AmaxHistory: overflow must be one of {OVERFLOWS}, got {overflow!r}")
        self.length, self.compute, self.overflow = length, compute, overflow
        self.history: torch.Tensor | None = None  # [length + 2] fp32 ring, created on the first record's device
        self.count = 0

    @property
    def slots(self) -> int:
        return self.length + 2

    def _buffer(self, device: torch.device) -> torch.Tensor:
        if self.history is None or self.history.device != device:
            self.history = torch.zeros(self.slots, dtype=torch.float32, device=device)
        return self.history

    def _ring(self) -> tuple[int, int, int]:
        """(the slot this call records into, the next one, which it zeroes, the most recent record's)."""
        return self.count % self.slots, (self.count + 1) % self.slots, (self.count - 1) % self.slots

    def _window(self) -> torch.Tensor:
        """Which slots hold the last ``length`` amaxes (bool ``[slots]``)."""
        slot, nxt, _ = self._ring()
        keep = torch.ones(self.slots, dtype=torch.bool, device=self.history.device)
        keep[slot] = keep[nxt] = False
        return keep

    def scale_amax(self) -> torch.Tensor | None:
        """The amax to scale with (max of the window, or the most recent), ``None`` before the first record."""
        if self.count == 0:
            return None
        if self.compute == "most_recent":
            return self.history[self._ring()[2]].clone()
        return torch.where(self._window(), self.history, 0.0).max()

    def record(self, amax: torch.Tensor) -> None:
        """Store this call's ``amax`` and zero the slot the next call records into."""
        history = self._buffer(amax.device)
        slot, nxt, _ = self._ring()
        history[slot] = amax.reshape(())
        history[nxt] = 0.0
        self.count += 1

    def quantize(
        self,
        t: torch.Tensor,
        dtype: torch.dtype,
        *,
        transposed: bool,
        reduce: AmaxReduce | None = None,
        backend: str | None = None,
    ) -> tuple[Quantized, Quantized | None]:
        """``(q, q_t)`` of the 2-D ``t`` (``fp8_casts.quantize_dual`` at ``tensor``) scaled by the history, this
        call's amax recorded (reduced by ``reduce``); the first call measures its own amax first. With
        ``overflow="recast"`` a tensor whose (reduced) amax exceeds the history's is cast again from it."""
        history = self._buffer(t.device)
        slot, nxt, _ = self._ring()
        record = history[slot : slot + 1]
        if self.count == 0:  # no history: current scaling, this amax recorded
            pair = quantize_dual(t, dtype, "tensor", transposed=transposed, reduce_q=reduce, amax_out=record,
                                 backend=backend)  # fmt: skip
            history[nxt] = 0.0
            _reduce(reduce, record)
        elif t.numel() and dispatch.choose("quantize_fp8", t, backend=backend) == dispatch.TRITON:
            pair = self._triton_delayed(t, dtype, transposed, reduce)
        else:
            pair = self._reference_delayed(t, dtype, transposed, reduce)
        self.count += 1
        return pair

    def _triton_delayed(self, t, dtype, transposed, reduce) -> tuple[Quantized, Quantized | None]:
        """The whole bookkeeping inside the one cast; the recast (if asked for) decides on the device."""
        from mcore.kernels.triton.delayed_recast import delayed_recast
        from mcore.kernels.triton.quant_fused import delayed_dual_cast

        slot, nxt, recent = self._ring()
        ring = (self.history, slot, nxt, recent, self.compute == "max")
        data, scale, data_t = delayed_dual_cast(t, dtype, *ring, write_t=transposed)
        _reduce(reduce, self.history[slot : slot + 1])
        if self.overflow == "recast":
            delayed_recast(t, *ring, (data, scale, data_t))  # in place, after the reduction
        scale = scale.reshape(())
        return Quantized(data, scale, "tensor"), Quantized(data_t, scale, "tensor") if transposed else None

    def _reference_delayed(self, t, dtype, transposed, reduce) -> tuple[Quantized, Quantized | None]:
        """The same in torch ops; the recast decision reads the two amaxes back (a host sync: this path only)."""
        slot, nxt, _ = self._ring()
        record = self.history[slot : slot + 1]
        used = self.scale_amax()
        pair = quantize_dual(t, dtype, "tensor", transposed=transposed, amax=used, amax_out=record,
                             backend="reference")  # fmt: skip
        self.history[nxt] = 0.0
        _reduce(reduce, record)
        own = record.reshape(())
        # a NaN amax overflows too, as on CUDA (where the cast records NaN as inf): multiplier 1, like current scaling
        if self.overflow == "recast" and bool((own > used) | own.isnan()):
            pair = quantize_dual(t, dtype, "tensor", transposed=transposed, amax=own.clone(), backend="reference")
        return pair


def _reduce(fn: AmaxReduce | None, t: torch.Tensor) -> None:
    if fn is not None:
        fn(t)
