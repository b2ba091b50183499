"""Triton kernel of one AdamW step: reads grad/param/exp_avg/exp_avg_sq, writes param/exp_avg/exp_avg_sq and
(optionally) the model parameter in its own dtype, in one pass.

Memory bound: per element it moves 4 (fp32 grad) + 3 x 8 (param and moments, read and written) + 2 (bf16
model parameter) = 30 bytes, against ~48 for torch's fused AdamW followed by a separate gradient-clipping
multiply and a master-to-model copy. With Megatron's precision-aware choices (bf16 gradient, bf16 moments:
each tensor is read and written in its own dtype, the math stays fp32) it moves 2 + 8 + 2 x 4 + 2 = 20 bytes.
One launch per tensor; each program handles one ``BLOCK`` of elements. The square root and the divisions are
the correctly rounded ones (``sqrt_rn``/``div_rn``) so the result follows torch's to the last bit or two; they
cost nothing measurable in a memory-bound kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcore.kernels.adamw_scalars import AdamWScalars

# Elements per program: 16 fp32 values per thread at 8 warps, so every tensor is read with 128-bit loads and
# enough bytes are in flight per SM (the same tile as the other elementwise kernels, see _common.py).
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(
    Param,
    Grad,
    ExpAvg,
    ExpAvgSq,
    Out,
    Multiplier,
    n_elements,
    decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    eps,
    HAS_MULTIPLIER: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 offsets: a flat tensor may hold more than 2**31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(Grad + offsets, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(Param + offsets, mask=mask, other=0.0)
    # the moments may be stored in bf16: upcast on load, update in fp32, round once on store
    m = tl.load(ExpAvg + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(ExpAvgSq + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_MULTIPLIER:
        g = g * tl.load(Multiplier).to(tl.float32)
    if HAS_DECAY:
        p = p * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(Param + offsets, p, mask=mask)
    tl.store(ExpAvg + offsets, m.to(ExpAvg.dtype.element_ty), mask=mask)
    tl.store(ExpAvgSq + offsets, v.to(ExpAvgSq.dtype.element_ty), mask=mask)
    if HAS_OUT:
        tl.store(Out + offsets, p.to(Out.dtype.element_ty), mask=mask)


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    model_params: list[torch.Tensor | None],
    scalars: AdamWScalars,
    grad_multiplier: torch.Tensor | None,
) -> None:
    """Launch the kernel once per non-empty tensor (inputs validated by ``mcore.kernels.adamw_step_``)."""
    s = scalars
    for p, g, m, v, out in zip(params, grads, exp_avgs, exp_avg_sqs, model_params):
        n = p.numel()
        if n == 0:
            continue
        # A non-contiguous gradient is copied once here; everything written is contiguous (checked).
        g = g.reshape(-1)
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p,
            g,
            m,
            v,
            out if out is not None else p,  # never written: HAS_OUT is False
            grad_multiplier if grad_multiplier is not None else p,  # never read: HAS_MULTIPLIER is False
            n,
            1.0 if s.decay is None else s.decay,
            s.beta1,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.step_size,
            s.bias_correction2_sqrt,
            s.eps,
            HAS_MULTIPLIER=grad_multiplier is not None,
            HAS_DECAY=s.decay is not None,
            HAS_OUT=out is not None,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
