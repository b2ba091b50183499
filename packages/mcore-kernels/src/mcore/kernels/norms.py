"""RMSNorm and LayerNorm over the last dim: a Triton kernel on CUDA and a pure-torch reference elsewhere.

Both backends accumulate in fp32, return the output in ``x``'s dtype and implement the same
``torch.autograd.Function``: forward saves the per-row ``rstd`` (and ``mean``), backward returns
``dx`` in x's dtype and ``dweight``/``dbias`` in the parameters' dtypes. With
``zero_centered_weight=True`` the effective scale is ``1 + weight`` (Gemma style), which lets a
weight-decayed parameter decay towards the identity scale.
"""

from __future__ import annotations

import numbers

import torch

from mcore.kernels import dispatch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered_weight: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Root-mean-square normalization of the last dim: ``x / sqrt(mean(x**2) + eps) * weight``.

    Args:
        x: ``[..., hidden]``, fp16/bf16/fp32, any leading dims (flattened into rows).
        weight: ``[hidden]``, fp16/bf16/fp32 (may differ from x's dtype), same device as ``x``.
        eps: added to the mean square before the reciprocal square root.
        zero_centered_weight: scale by ``1 + weight`` instead of ``weight``.
        backend: ``"triton"`` or ``"reference"``; ``None`` lets :func:`mcore.kernels.dispatch.choose` decide.

    Returns:
        A tensor shaped and typed like ``x``.
    """
    _check_norm_inputs("rms_norm", x, weight, None, eps)
    chosen = dispatch.choose("rms_norm", x, weight, backend=backend)
    return _NormFunction.apply(x, weight, None, float(eps), True, bool(zero_centered_weight), chosen)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    zero_centered_weight: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Layer normalization of the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``var`` is the biased variance (divided by ``hidden``), as in ``torch.nn.functional.layer_norm``.
    ``bias`` may be ``None``; otherwise it is ``[hidden]`` like ``weight``. The other arguments are as in
    :func:`rms_norm`.
    """
    _check_norm_inputs("layer_norm", x, weight, bias, eps)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    chosen = dispatch.choose("layer_norm", *tensors, backend=backend)
    return _NormFunction.apply(x, weight, bias, float(eps), False, bool(zero_centered_weight), chosen)


def _check_norm_inputs(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> None:
    named = {"x": x, "weight": weight} if bias is None else {"x": x, "weight": weight, "bias": bias}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dim to normalize, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    for name, t in named.items():
        if name != "x" and tuple(t.shape) != (hidden,):
            raise ValueError(
                f"{op}: {name} must have shape ({hidden},) to match the last dim of x {tuple(x.shape)}, "
                f"got {tuple(t.shape)}"
            )
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}; move both to one device")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a non-negative real number, got {eps!r}")


def reference_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    is_rms: bool,
    zero_centered_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Pure-torch forward: ``(y, mean | None, rstd)``, statistics fp32 of shape ``x.shape[:-1]``."""
    xf = x.float()
    mean = None if is_rms else xf.mean(dim=-1)
    xc = xf if mean is None else xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
    scale = weight.float() + 1.0 if zero_centered_weight else weight.float()
    y = xc * rstd.unsqueeze(-1) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def reference_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    is_rms: bool,
    zero_centered_weight: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure-torch backward: ``(dx, dweight, dbias | None)``; ``dx`` in x's dtype, the parameter gradients fp32.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * scale``:
    ``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` (the last term only for LayerNorm),
    ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)``.
    """
    hidden = x.shape[-1]
    xf, dyf = x.float(), dy.float()
    rstd_ = rstd.unsqueeze(-1)
    xhat = (xf if mean is None else xf - mean.unsqueeze(-1)) * rstd_
    scale = weight.float() + 1.0 if zero_centered_weight else weight.float()
    g = dyf * scale
    inner = g - xhat * (g * xhat).mean(dim=-1, keepdim=True)
    if not is_rms:
        inner = inner - g.mean(dim=-1, keepdim=True)
    dx = (inner * rstd_).to(x.dtype)
    dw = (dyf * xhat).reshape(-1, hidden).sum(dim=0)
    db = dyf.reshape(-1, hidden).sum(dim=0) if has_bias else None
    return dx, dw, db


def _backend_impl(backend: str):
    if backend == dispatch.TRITON:
        from mcore.kernels.triton import norms as triton_norms

        return triton_norms.norm_forward, triton_norms.norm_backward
    return reference_forward, reference_backward


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, zero_centered_weight, backend):
        forward_fn, _ = _backend_impl(backend)
        y, mean, rstd = forward_fn(x, weight, bias, eps, is_rms, zero_centered_weight)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.is_rms = is_rms
        ctx.zero_centered_weight = zero_centered_weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        _, backward_fn = _backend_impl(ctx.backend)
        has_bias = ctx.bias_dtype is not None
        dx, dw, db = backward_fn(dy, x, weight, mean, rstd, ctx.is_rms, ctx.zero_centered_weight, has_bias)
        dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = db.to(ctx.bias_dtype) if has_bias and ctx.needs_input_grad[2] else None
        dx = dx if ctx.needs_input_grad[0] else None
        return dx, dw, db, None, None, None, None
