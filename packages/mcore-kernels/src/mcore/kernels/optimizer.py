"""One AdamW step over lists of tensors, with the gradient scaled by a device tensor and the model parameters
written in the same pass: a Triton kernel on CUDA and a pure-torch reference elsewhere.

Per element, in fp32 (``g`` read in its own dtype and upcast; ``t`` the step number after this update)::

    g  = grad * grad_multiplier                         (the multiplier is read on the device: no host sync)
    p  = p * (1 - lr * weight_decay)                    (decoupled decay; skipped when weight_decay == 0)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    model_param = p cast to the model parameter's dtype

The moments may be stored in bf16 (Megatron-Core's precision-aware optimizer, ``--exp-avg-dtype`` /
``--exp-avg-sq-dtype``): they are upcast on load, updated and used for the parameter update in fp32, and rounded
to bf16 once on store; the parameter update sees the unrounded values. fp16 moments are refused: ``exp_avg_sq``
holds squared gradients (1e-10 for a gradient of 1e-5), far below fp16's smallest subnormal (6e-8), so they flush
to zero and the update becomes ``m / eps``; making fp16 safe needs a per-tensor scale (as Transformer Engine's
FusedAdam keeps), which this kernel does not have.

This is the order of operations of ``torch.optim.AdamW`` (``amsgrad=False, maximize=False``) and of its
fused CUDA kernel; the step-dependent scalars are computed in double precision on the host (as torch's
non-capturable paths do) and rounded once to fp32. A mixed-precision optimizer can therefore fold gradient
clipping (and loss-scale unscaling) into the update and skip the separate copy of the fp32 masters into
the bf16/fp16 model: one read of grad/param/m/v and one write of param/m/v/model param per element.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from mcore.kernels import dispatch
from mcore.kernels.adamw_scalars import AdamWScalars

__all__ = ["AdamWScalars", "adamw_step_", "reference_adamw_step"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_ALLOWED_DTYPES = {
    "params": (torch.float32,),
    "grads": _GRAD_DTYPES,
    "exp_avgs": _MOMENT_DTYPES,
    "exp_avg_sqs": _MOMENT_DTYPES,
    "model_params": _MODEL_DTYPES,
}


def adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    steps: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_multiplier: torch.Tensor | None = None,
    model_params: Sequence[torch.Tensor | None] | None = None,
    backend: str | None = None,
) -> None:
    """Apply one AdamW update in place to every ``params[i]`` (see the module docstring for the math).

    Args:
        params: fp32 tensors updated in place (the master weights); contiguous, any shape.
        grads: ``grads[i]`` has ``params[i].numel()`` elements (any shape and layout); fp32, bf16 or fp16,
            read and upcast to fp32, never written.
        exp_avgs, exp_avg_sqs: Adam moments, contiguous, ``params[i].numel()`` elements each; updated. fp32 or
            bf16, chosen per tensor (read and upcast, updated in fp32, rounded once when written back).
        steps: the step number *after* this update (1 on the first step), used for the bias corrections of
            every tensor of the call; tensors at different step counts need separate calls.
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW`` (decoupled weight decay).
        grad_multiplier: optional fp32 tensor of one element on the params' device (a clip coefficient, an
            inverse loss scale, or their product) that multiplies every gradient before the update. It is
            read by the kernel, so passing a value still being computed on the GPU costs no host sync.
        model_params: optional list, one entry per param: ``None`` or a contiguous fp32/bf16/fp16 tensor of
            ``params[i].numel()`` elements that receives the updated ``params[i]`` cast to its dtype (the
            model's copy of a master weight).
        backend: ``"triton"`` or ``"reference"``; ``None`` picks by device (see :mod:`mcore.kernels.dispatch`).

    Every list has one entry per param; an empty ``params`` is a no-op.
    """
    scalars = _check_inputs(
        params, grads, exp_avgs, exp_avg_sqs, model_params, grad_multiplier, steps, lr, beta1, beta2, eps, weight_decay
    )
    if not params:
        return
    outs = list(model_params) if model_params is not None else [None] * len(params)
    if dispatch.choose("adamw", params[0], backend=backend) == dispatch.TRITON:
        from mcore.kernels.triton.adamw import adamw_step as step
    else:
        step = reference_adamw_step
    step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), outs, scalars, grad_multiplier)


def reference_adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    model_params: list[torch.Tensor | None],
    scalars: AdamWScalars,
    grad_multiplier: torch.Tensor | None,
) -> None:
    """Pure-torch update, one tensor at a time, with the same fp32 operations in the same order as the kernel
    (bf16 moments: upcast, updated in fp32, the parameter updated with the fp32 values, rounded once on store)."""
    s = scalars
    for p, g, m_stored, v_stored, out in zip(params, grads, exp_avgs, exp_avg_sqs, model_params):
        p = p.view(-1)
        m, v = (t.view(-1) if t.dtype == torch.float32 else t.view(-1).float() for t in (m_stored, v_stored))
        g = g.reshape(-1).float()
        if grad_multiplier is not None:
            g = g * grad_multiplier.reshape(())
        if s.decay is not None:
            p.mul_(s.decay)
        m.mul_(s.beta1).add_(g, alpha=s.one_minus_beta1)
        v.mul_(s.beta2).addcmul_(g, g, value=s.one_minus_beta2)
        denom = (v.sqrt() / s.bias_correction2_sqrt).add_(s.eps)
        p.addcdiv_(m, denom, value=-s.step_size)
        for stored, fp32 in ((m_stored, m), (v_stored, v)):
            if stored.dtype != torch.float32:
                stored.view(-1).copy_(fp32)
        if out is not None:
            out.view(-1).copy_(p)


# ---- validation -------------------------------------------------------------------------------------------------


def _check_real(name: str, value: object, low: float, high: float | None = None, *, open_high: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if ok and high is not None:
        ok = value < high if open_high else value <= high
    if not ok:
        bound = f">= {low}" if high is None else f"in [{low}, {high}{')' if open_high else ']'}"
        raise ValueError(f"adamw_step_: {name} must be a finite number {bound}, got {value!r}")


def _check_inputs(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    model_params: Sequence[torch.Tensor | None] | None,
    grad_multiplier: torch.Tensor | None,
    steps: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> AdamWScalars:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"adamw_step_: steps must be an int >= 1 (the step number after this update), got {steps!r}")
    _check_real("lr", lr, 0.0)
    _check_real("beta1", beta1, 0.0, 1.0, open_high=True)
    _check_real("beta2", beta2, 0.0, 1.0, open_high=True)
    _check_real("eps", eps, 0.0)
    _check_real("weight_decay", weight_decay, 0.0)

    device = _check_lists(params, grads, exp_avgs, exp_avg_sqs, model_params)
    _check_grad_multiplier(grad_multiplier, device)
    return AdamWScalars.of(
        steps=int(steps),
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
    )


def _check_lists(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    model_params: Sequence[torch.Tensor | None] | None,
) -> torch.device | None:
    """Check the tensor lists (types, dtypes, sizes, devices, contiguity); return the params' device."""
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if model_params is not None:
        lists["model_params"] = model_params
    for name, seq in lists.items():
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
            raise TypeError(f"adamw_step_: {name} must be a list of tensors, got {type(seq).__name__}")
    lengths = {name: len(seq) for name, seq in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"adamw_step_: every list needs one entry per param, got lengths {lengths}")

    device = params[0].device if params and isinstance(params[0], torch.Tensor) else None
    for i in range(len(params)):
        # a None model-param entry means "no model copy of this master": nothing to check
        entries = {name: seq[i] for name, seq in lists.items() if not (name == "model_params" and seq[i] is None)}
        for name, t in entries.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"adamw_step_: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        numel = params[i].numel()
        for name, t in entries.items():
            allowed = _ALLOWED_DTYPES[name]
            if t.dtype not in allowed:
                names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
                moment = allowed is _MOMENT_DTYPES
                why = " (fp16 moments underflow without a per-tensor scale; use bfloat16)" if moment else ""
                raise TypeError(f"adamw_step_: {name}[{i}] must be {names}, got {t.dtype}{why}")
            if t.numel() != numel:
                raise ValueError(
                    f"adamw_step_: {name}[{i}] has shape {tuple(t.shape)} ({t.numel()} elements) but params[{i}] has "
                    f"shape {tuple(params[i].shape)} ({numel} elements); every tensor of index {i} needs {numel}"
                )
            if t.device != device:
                raise ValueError(
                    f"adamw_step_: {name}[{i}] is on {t.device} but params[0] is on {device}; move all to one device"
                )
            if name != "grads" and not t.is_contiguous():
                raise ValueError(
                    f"adamw_step_: {name}[{i}] (shape {tuple(t.shape)}, strides {t.stride()}) must be contiguous: "
                    "it is written in place through a flat view"
                )
    return device


def _check_grad_multiplier(grad_multiplier: torch.Tensor | None, device: torch.device | None) -> None:
    """A one-element fp32 tensor on the params' device, or None."""
    if grad_multiplier is None:
        return
    if not isinstance(grad_multiplier, torch.Tensor):
        raise TypeError(
            f"adamw_step_: grad_multiplier must be a one-element fp32 tensor or None, got "
            f"{type(grad_multiplier).__name__}"
        )
    if grad_multiplier.dtype != torch.float32 or grad_multiplier.numel() != 1:
        raise ValueError(
            f"adamw_step_: grad_multiplier must be a one-element float32 tensor, got {grad_multiplier.dtype} "
            f"of shape {tuple(grad_multiplier.shape)}"
        )
    if device is not None and grad_multiplier.device != device:
        raise ValueError(
            f"adamw_step_: grad_multiplier is on {grad_multiplier.device} but params are on {device}; create it "
            "on the params' device (it is read inside the kernel)"
        )
